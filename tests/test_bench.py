"""The benchmark harness end to end on CPU, and its reporting rules.

One real run (tiny Llama, fp32, CPU) of megatrain, plain Trainer and DeepSpeed (not installed
here, or not runnable on CPU: it must be reported as unavailable, never with numbers). In fp32
on CPU megatrain is exact, so its per-step losses must match the plain Trainer's.
"""

from __future__ import annotations

import json
import re
import struct

import pytest

from megatrain_hf.bench import main
from megatrain_hf.bench.presets import PRESETS, useful_flops_per_step
from megatrain_hf.bench.report import render_markdown, write_reports
from megatrain_hf.bench.runner import build_parser, merged_results, parse_systems, run_system
from megatrain_hf.bench.systems import deepspeed_config, fsdp2_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LOSS_ATOL_FP32 = 1e-5


def _megatrain_importable() -> str | None:
    """None when MegaTrainPlugin imports, else why not (the megatrain assertions then skip)."""
    try:
        from megatrain_hf import MegaTrainPlugin
    except ImportError as exc:
        try:
            from megatrain_hf.integrations.trainer import MegaTrainPlugin  # noqa: F401
        except ImportError:
            return f"MegaTrainPlugin cannot be imported yet: {exc}"
    return None


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = main(["--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2", "--steps", "2",
               "--warmup-steps", "1", "--systems", "megatrain,plain,deepspeed", "--device", "cpu", "--dtype", "fp32",
               "--out", str(out)])
    report = json.loads((out / "results.json").read_text())
    return rc, out, report


def test_exit_code_and_files(bench):
    rc, out, report = bench
    assert rc == 0
    assert list(report["results"]) == ["megatrain", "plain", "deepspeed"]
    assert (out / "results.md").read_text().startswith("# megatrain benchmark")
    png = (out / "results.png").read_bytes()
    assert png[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", png[16:24])  # IHDR chunk
    assert png[12:16] == b"IHDR" and width > 100 and height > 100
    assert report["workload"]["tokens_per_step"] == 32 * 2 * 2
    assert "6 * P * T + 12 * L * H * S * T" in report["meta"]["flops_formula"]


def test_plain_ran_and_measured(bench):
    _, _, report = bench
    plain = report["results"]["plain"]
    assert plain["status"] == "ok", plain.get("reason")
    assert plain["tokens_per_s"] > 0 and plain["tflops"] > 0
    assert plain["measured_steps"] == 2 and len(plain["steps"]) == 3  # warmup step kept raw, not measured
    assert plain["step_time_mean_s"] > 0 and plain["host_peak_rss_gib"] > 0
    assert plain["params"] == PRESETS["tiny"].params()
    assert plain["link_bytes_per_step"] is None and "not instrumented" in plain["link_note"]
    assert plain["system_check"]["distributed_type"].endswith("NO")
    phases = plain["host_rss_by_phase"]  # where the host peak happens (setup vs training)
    assert list(phases) == ["model_built", "trainer_built", "train_begin", "first_step_done", "train_end"]
    assert all(0 < v["rss_gib"] <= v["peak_rss_gib"] for v in phases.values())


def test_deepspeed_reported_unavailable_without_numbers(bench):
    _, out, report = bench
    ds = report["results"]["deepspeed"]
    assert ds["status"] == "unavailable"
    assert "deepspeed" in ds["reason"].lower() or "cuda" in ds["reason"].lower()
    assert not {"tokens_per_s", "tflops", "step_time_mean_s", "host_peak_rss_gib"} & set(ds)
    row = next(line for line in (out / "results.md").read_text().splitlines() if line.startswith("| deepspeed |"))
    assert not re.search(r"\d", row), row
    assert "unavailable" in row


def test_megatrain_ran_and_matches_plain_losses(bench):
    reason = _megatrain_importable()
    if reason:
        pytest.skip(reason)
    _, out, report = bench
    mt, plain = report["results"]["megatrain"], report["results"]["plain"]
    assert mt["status"] == "ok", mt.get("reason")
    assert mt["tokens_per_s"] > 0 and mt["tflops"] > 0
    assert mt["system_check"]["engine"] is not None
    mt_losses = [e["loss"] for e in mt["losses"]]
    plain_losses = [e["loss"] for e in plain["losses"]]
    assert len(mt_losses) == len(plain_losses) == 3
    assert mt_losses == pytest.approx(plain_losses, abs=LOSS_ATOL_FP32, rel=0)
    assert "vs plain" in (out / "results.md").read_text()


def _fake_report(results: dict) -> dict:
    workload = {"model": "tiny", "shape": PRESETS["tiny"].to_dict(), "approx_params": 1, "seq_len": 8,
                "micro_batch": 1, "grad_accum": 1, "tokens_per_step": 8, "steps": 1, "warmup_steps": 0,
                "dtype": "bf16", "device": "cuda", "seed": 0, "activation_checkpointing": True}
    meta = {"flops_formula": "f", "hardware": {"gpus": None, "cpu_model": "x", "cpu_logical": 1, "cpu_physical": 1,
                                               "ram_total_gib": 1.0},
            "git": {"commit": None, "note": "no git", "dirty": None}, "versions": {"torch": "t"},
            "command_line": "c", "argv": [], "created_utc": "d"}
    return {"meta": meta, "workload": workload, "results": results}


def test_report_never_shows_numbers_for_systems_that_did_not_run(tmp_path):
    # Even with stray numbers in a failed result, its row shows none, and nothing is compared to it.
    results = {
        "plain": {"status": "failed", "reason": "out of memory: CUDA out of memory (139.8 GiB)", "tokens_per_s": 9.0},
        "deepspeed": {"status": "unavailable", "reason": "deepspeed cannot be imported"},
    }
    md = render_markdown(_fake_report(results))
    rows = [line for line in md.splitlines() if line.startswith(("| plain |", "| deepspeed |"))]
    assert len(rows) == 2 and not any(re.search(r"\d", row) for row in rows)
    assert "139.8 GiB" in md  # the real reason is shown, below the table
    paths = write_reports(_fake_report(results), tmp_path)
    assert paths["png"].read_bytes()[:8] == PNG_SIGNATURE


def test_worker_timeout_is_a_failure_with_reason(tmp_path):
    args = build_parser().parse_args(["--model", "tiny", "--seq-len", "8", "--steps", "1", "--device", "cpu",
                                      "--dtype", "fp32", "--timeout", "0.5", "--out", str(tmp_path)])
    (tmp_path / "logs").mkdir()
    result = run_system("plain", args, PRESETS["tiny"], tmp_path)
    assert result["status"] == "failed" and "timed out" in result["reason"]
    assert "tokens_per_s" not in result


def test_flops_formula_and_presets():
    assert PRESETS["llama-3.14b"].params() == pytest.approx(3.14e9, rel=0.01)
    assert PRESETS["llama-1.36b"].params() == pytest.approx(1.36e9, rel=0.01)
    assert PRESETS["llama-7b"].params() == pytest.approx(6.74e9, rel=0.01)
    shape = PRESETS["llama-3.14b"]
    flops = useful_flops_per_step(3_140_000_000, shape, 4096, 16384)
    assert flops == 6 * 3_140_000_000 * 16384 + 12 * 26 * 3072 * 4096 * 16384


def test_baseline_configs_offload_to_pinned_cpu():
    zero = deepspeed_config()["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    fsdp = fsdp2_config()
    assert fsdp["version"] == 2 and fsdp["cpu_offload"] is True


def test_cli_rejects_unknown_system_and_mismatched_merge(tmp_path):
    with pytest.raises(ValueError, match="allowed"):
        parse_systems("megatrain,zero4")
    (tmp_path / "results.json").write_text(json.dumps({"workload": {"seq_len": 1}, "results": {}}))
    with pytest.raises(ValueError, match="different workload"):
        merged_results(tmp_path, {"seq_len": 2}, ["plain"])
    kept = {"workload": {"seq_len": 2}, "results": {"deepspeed": {"status": "ok"}, "plain": {"status": "ok"}}}
    (tmp_path / "results.json").write_text(json.dumps(kept))
    assert list(merged_results(tmp_path, {"seq_len": 2}, ["plain"])) == ["deepspeed"]
    # a record written before the shape had more fields still merges; a changed field does not
    kept["workload"] = {"seq_len": 2, "shape": {"hidden": 8}}
    (tmp_path / "results.json").write_text(json.dumps(kept))
    assert list(merged_results(tmp_path, {"seq_len": 2, "shape": {"hidden": 8, "tied": False}}, ["plain"])) == ["deepspeed"]
    with pytest.raises(ValueError, match="different workload"):
        merged_results(tmp_path, {"seq_len": 2, "shape": {"hidden": 16, "tied": False}}, ["plain"])


def test_depth_scaling_report_from_real_runs(tmp_path, bench, capsys):
    """Two megatrain runs of the tiny model at 2 and 4 layers (CPU), then the scaling report: a
    row per depth, layer-tokens/s from the step times, spreads against the issue's bounds."""
    from megatrain_hf.bench.scaling import load_points, main as scaling_main, spread

    _, first, _ = bench  # the module's run: the tiny preset's own depth
    paths = [first / "results.json"]
    out = tmp_path / "deeper"
    layers = PRESETS["tiny"].layers * 2
    assert main(["--model", "tiny", "--layers", str(layers), "--seq-len", "32", "--micro-batch", "2",
                 "--grad-accum", "2", "--steps", "2", "--warmup-steps", "1", "--systems", "megatrain",
                 "--device", "cpu", "--dtype", "fp32", "--out", str(out)]) == 0
    paths.append(out / "results.json")
    points = load_points(paths)
    assert [p["layers"] for p in points] == [PRESETS["tiny"].layers, layers]
    for p, path in zip(points, paths):
        r = json.loads(path.read_text())
        tokens = r["workload"]["tokens_per_step"]
        assert p["layer_tokens_per_s"] == pytest.approx(p["layers"] * tokens / r["results"]["megatrain"]["step_time_mean_s"])
    assert scaling_main(["--out", str(tmp_path / "scaling"), *map(str, paths)]) == 0
    text = (tmp_path / "scaling" / "scaling.md").read_text()
    assert "# megatrain depth scaling" in text and "not measured (no GPU)" in text
    assert f"layer-tokens/s spread: {100 * spread([p['layer_tokens_per_s'] for p in points]):.1f} %" in text
    assert (tmp_path / "scaling" / "scaling.png").read_bytes().startswith(PNG_SIGNATURE)
    capsys.readouterr()
    bad = tmp_path / "bad.json"
    report = json.loads(paths[0].read_text())
    report["results"]["megatrain"] = {"status": "failed", "reason": "out of memory"}
    bad.write_text(json.dumps(report))
    with pytest.raises(SystemExit) as info:
        scaling_main(["--out", str(tmp_path / "s2"), str(bad)])
    assert info.value.code == 2 and "no successful 'megatrain' result (failed: out of memory)" in capsys.readouterr().err


def test_profiled_step_runs_after_the_measured_ones(tmp_path):
    """--profile: two more steps, the second recorded into a Chrome trace with the host update's
    ranges; the measured steps are the requested ones."""
    import subprocess
    import sys
    from pathlib import Path

    from megatrain_hf.bench import worker

    out = tmp_path / "megatrain.json"
    assert worker.main(["--system", "megatrain", "--json-out", str(out), "--model", "tiny", "--seq-len", "32",
                        "--micro-batch", "2", "--grad-accum", "1", "--steps", "2", "--warmup-steps", "1",
                        "--dtype", "fp32", "--device", "cpu", "--profile"]) == 0
    result = json.loads(out.read_text())
    assert result["status"] == "ok", result
    assert result["profiled_step"] == 5 and result["measured_steps"] == 2
    trace = json.loads(Path(f"{out}.trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("megatrain.update[") for n in names)
    summary = subprocess.run([sys.executable, "scripts/trace_summary.py", f"{out}.trace.json"], capture_output=True,
                             text=True, check=True, cwd=Path(__file__).parents[1])
    assert "megatrain.update" in summary.stdout


def test_link_bytes_count_the_device_updates_state():
    """device_update moves optimizer state over the link: counted in the engine's stats (reset with
    the rest) and in the bench's link bytes."""
    from megatrain_hf.bench.worker import link_bytes
    from megatrain_hf.stats import EngineStats

    stats = EngineStats(h2d_bytes=100, d2h_bytes=10, update_h2d_bytes=1000, update_d2h_bytes=2000)
    counters = {k: v for k, v in vars(stats).items() if not k.startswith("_")}
    assert link_bytes("megatrain", counters)["link_bytes_per_step"] == {"h2d": 1100, "d2h": 2010, "total": 3110}
    stats.reset()
    assert stats.update_h2d_bytes == stats.update_d2h_bytes == stats.h2d_bytes == 0

"""The benchmark harness end to end on CPU, and its reporting rules.

One real run (tiny Llama, fp32, CPU) of megatrain, plain Trainer and DeepSpeed (not installed
here, or not runnable on CPU: it must be reported as unavailable, never with numbers). In fp32
on CPU megatrain is exact, so its per-step losses must match the plain Trainer's. Then the pure
parts: the FLOP convention, the trend test, the baselines' configurations and the GPU suite's
dry run (every command it would run parses with the bench's own parser).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct

import pytest

from megatrain_hf.bench import main
from megatrain_hf.bench.flops import model_flops_per_step, model_flops_per_token, non_embedding_params
from megatrain_hf.bench.presets import PRESETS
from megatrain_hf.bench.report import render_markdown, write_reports
from megatrain_hf.bench.runner import build_parser, merged_results, parse_systems, run_system, worker_env
from megatrain_hf.bench.systems import (DEEPSPEED_SYSTEMS, SYSTEMS, check_workload, deepspeed_config, fsdp2_config,
                                        host_cores, system_config)
from megatrain_hf.bench.trend import step_trend, trend_label
from megatrain_hf.errors import MegatrainConfigError
from tests.helpers import REPO_ROOT

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


@pytest.mark.slow
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
    assert "6*N + 12*L*H*Q*S" in report["meta"]["flops_convention"]
    md = (out / "results.md").read_text()
    assert "PaLM" in md.split("| system |")[0]  # the convention is stated above the table


@pytest.mark.slow
def test_plain_ran_and_measured(bench):
    _, _, report = bench
    plain = report["results"]["plain"]
    assert plain["status"] == "ok", plain.get("reason")
    assert plain["tokens_per_s"] > 0 and plain["tflops"] > plain["tflops_causal"] > 0
    assert plain["measured_steps"] == 2 and len(plain["steps"]) == 3  # warmup step kept raw, not measured
    assert plain["step_times_s"] == [s["total_s"] for s in plain["steps"][1:]]
    assert plain["warmup_step_times_s"] == [plain["steps"][0]["total_s"]]
    assert all(s["host_rss_gib"] > 0.05 and "gpu_allocated_gib" not in s for s in plain["steps"])  # per step
    assert plain["trend"]["measured_steps"] == 2 and plain["trend"]["assessed"] is False
    tokens = report["workload"]["tokens_per_step"]
    assert plain["tflops"] == pytest.approx(model_flops_per_token(PRESETS["tiny"], 32) * tokens
                                            / plain["step_time_mean_s"] / 1e12)
    assert plain["step_time_mean_s"] > 0 and plain["host_peak_rss_gib"] > 0
    assert plain["params"] == PRESETS["tiny"].params()
    assert plain["link_bytes_per_step"] is None and "not instrumented" in plain["link_note"]
    assert plain["system_check"]["distributed_type"].endswith("NO")
    phases = plain["host_rss_by_phase"]  # where the host peak happens (setup vs training)
    assert list(phases) == ["model_built", "trainer_built", "train_begin", "first_step_done", "train_end"]
    assert all(0 < v["rss_gib"] <= v["peak_rss_gib"] for v in phases.values())


@pytest.mark.slow
def test_deepspeed_reported_unavailable_without_numbers(bench):
    _, out, report = bench
    ds = report["results"]["deepspeed"]
    assert ds["status"] == "unavailable"
    assert "deepspeed" in ds["reason"].lower() or "cuda" in ds["reason"].lower()
    assert not {"tokens_per_s", "tflops", "step_time_mean_s", "host_peak_rss_gib"} & set(ds)
    row = next(line for line in (out / "results.md").read_text().splitlines() if line.startswith("| deepspeed |"))
    assert not re.search(r"\d", row), row
    assert "unavailable" in row
    # its configuration is reported all the same, with the sizes derived from the model
    zero = ds["system_config"]["deepspeed"]["zero_optimization"]
    assert zero["reduce_bucket_size"] == PRESETS["tiny"].hidden ** 2


@pytest.mark.slow
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
    meta = {"flops_convention": "f", "hardware": {"gpus": None, "cpu_model": "x", "cpu_logical": 1, "cpu_physical": 1,
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


@pytest.mark.parametrize("family", ["llama", "gemma", "gpt2", "phi3", "mixtral", "qwen2_moe"])
def test_engine_flops_model_equals_the_shapes(family):
    """The engine's N (from the modules) is the bench's (from the config): tied tables once, learned
    positions left out, of the routed experts the num_experts_per_tok a token is computed with."""
    from tests.helpers import tiny_model
    from megatrain_hf import attach
    from megatrain_hf.memory import ModelShape

    model = tiny_model(family)
    shape = ModelShape.from_hf_config(model.config)
    engine = attach(model, device="cpu")
    matmul, trainable, layers, heads, head_dim = engine.stats._flops_model
    assert matmul == trainable == non_embedding_params(shape)
    assert (layers, heads, head_dim) == (shape.layers, shape.heads, shape.dim_head)
    if shape.experts:  # 4 experts, top-2: half of the routed experts' parameters count
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert sum(p.numel() for p in model.parameters()) - matmul == shape.vocab * shape.hidden + experts // 2


def test_flops_formula_llama_7b_by_hand():
    """PaLM's convention for the Llama-2-7B shape at S = 4096, against a hand computation."""
    shape = PRESETS["llama-7b"]
    # per layer: q, k, v, o 4 x 4096^2 = 67,108,864; gate, up, down 3 x 4096 x 11008 = 135,266,304;
    # two norms 8,192 -> 202,383,360; x 32 = 6,476,267,520; + final norm 4,096 + LM head
    # 32,000 x 4,096 = 131,072,000 -> N = 6,607,343,616 (the input table, another 131,072,000, left out)
    assert shape.params() == 6_738_415_616
    assert non_embedding_params(shape) == 6_607_343_616
    # 6 N = 39,644,061,696; 12 L H Q S = 12 x 32 x 32 x 128 x 4096 = 6,442,450,944
    assert model_flops_per_token(shape, 4096) == 46_086_512_640
    assert model_flops_per_step(shape, 4096, 65_536) == 46_086_512_640 * 65_536
    # a tied table is one tensor: counted once, as the head
    tied = dataclasses.replace(shape, tied=True)
    assert non_embedding_params(tied) == tied.params() == 6_607_343_616
    # GQA: H counts query heads; the smaller k/v projections only change N
    gqa = dataclasses.replace(shape, kv_heads=8)
    assert model_flops_per_token(gqa, 4096) - 6 * non_embedding_params(gqa) == 6_442_450_944
    with pytest.raises(MegatrainConfigError):
        model_flops_per_token(shape, 0)
    # "palm_causal": the attention term halved (a causal kernel computes the lower triangle)
    assert model_flops_per_token(shape, 4096, convention="palm_causal") == 39_644_061_696 + 6_442_450_944 // 2
    # 512K tokens: attention is 91% of the causal count (docs/long-context.md)
    at_512k = model_flops_per_token(shape, 524288, convention="palm_causal")
    assert round(1 - 6 * non_embedding_params(shape) / at_512k, 2) == 0.91
    with pytest.raises(MegatrainConfigError, match="convention"):
        model_flops_per_token(shape, 4096, convention="halved")


def test_presets_sizes():
    assert PRESETS["llama-3.14b"].params() == pytest.approx(3.14e9, rel=0.01)
    assert PRESETS["llama-1.36b"].params() == pytest.approx(1.36e9, rel=0.01)
    assert PRESETS["llama-7b"].params() == pytest.approx(6.74e9, rel=0.01)


def test_trend_flags_warming_up_and_not_steady_noise():
    steady = [2.00, 2.02, 1.99, 2.01, 2.00, 1.98, 2.01, 2.00]
    t = step_trend(steady)
    assert t["assessed"] and t["flag"] is None and trend_label(t) == ""
    assert abs(t["slope_rel_per_step"]) < 0.002
    # DeepSpeed ZeRO-3 at 16K with two warm-up steps (d99d99b, steps 3-6): still getting faster
    warming = [2.600, 2.588, 2.460, 2.418]
    t = step_trend(warming)
    assert t["flag"] == "warming_up"
    assert t["slope_rel_per_step"] == pytest.approx(-0.0674 / 2.5165, rel=1e-3)
    assert t["halves_rel"] == pytest.approx((2.439 - 2.594) / 2.5165, rel=1e-3)
    assert trend_label(t).startswith("still warming up: steps trend -2.7 %/step")
    slowing = [1.0, 1.02, 1.04, 1.06, 1.08]
    assert step_trend(slowing)["flag"] == "slowing_down"
    assert trend_label(step_trend(slowing)).startswith("slowing down: steps trend +")
    # a drift too slow per step for the slope limit that still adds up over a long run: halves catch it
    slow = [1.0 + 0.006 * i for i in range(12)]
    t = step_trend(slow)
    assert abs(t["slope_rel_per_step"]) < 0.01 and t["halves_rel"] > 0.03 and t["flag"] == "slowing_down"
    # two steps: a difference, not a trend
    t = step_trend([2.6, 2.4])
    assert t["assessed"] is False and t["flag"] is None and "not assessed" in trend_label(t)


def test_report_shows_trend_next_to_the_system_and_every_step(tmp_path):
    ok = {"status": "ok", "tokens_per_s": 6000.0, "tflops": 120.0, "step_time_mean_s": 2.5165,
          "step_time_median_s": 2.524, "host_peak_rss_gib": 70.0, "host_ru_maxrss_gib": 70.1,
          "gpu_peak_allocated_gib": 10.0,
          "link_bytes_per_step": None, "phases_mean_s": {p: 0.1 for p in ("between", "fwd_bwd", "optimizer", "post")},
          "warmup_step_times_s": [6.789, 3.211], "step_times_s": [2.600, 2.588, 2.460, 2.418],
          "trend": step_trend([2.600, 2.588, 2.460, 2.418])}
    report = _fake_report({"deepspeed": ok})
    md = render_markdown(report)
    row = next(line for line in md.splitlines() if line.startswith("| deepspeed ("))
    assert "still warming up: steps trend -2.7 %/step" in row
    assert "| deepspeed | 6.789, 3.211 | 2.600, 2.588, 2.460, 2.418 | -2.7 | -6.2 | still warming up" in md
    assert "Trend rule: flagged when" in md


def test_baseline_configs_are_the_tuned_ones():
    shape = PRESETS["llama-3.14b"]
    h = shape.hidden
    zero3 = deepspeed_config("deepspeed", shape)["zero_optimization"]
    assert zero3["stage"] == 3
    assert zero3["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero3["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero3["overlap_comm"] is True and zero3["contiguous_gradients"] is True
    # transformers' "auto" sizes, written out: h^2, 0.9 h^2, 10 h
    assert (zero3["reduce_bucket_size"], zero3["stage3_prefetch_bucket_size"],
            zero3["stage3_param_persistence_threshold"]) == (9_437_184, 8_493_465, 30_720)
    assert (9_437_184, 8_493_465, 30_720) == (h * h, int(0.9 * h * h), 10 * h)
    assert zero3["sub_group_size"] == zero3["stage3_max_live_parameters"] == zero3["stage3_max_reuse_distance"] == 10**9
    assert "fast_init" not in zero3["offload_optimizer"]  # NVMe-only in 0.19.8
    zero2 = deepspeed_config("deepspeed_zero2", shape)["zero_optimization"]
    assert zero2["stage"] == 2 and "offload_param" not in zero2  # weights stay on the GPU
    assert zero2["offload_optimizer"] == {"device": "cpu", "pin_memory": True} and zero2["reduce_bucket_size"] == h * h
    assert not any(k.startswith("stage3_") for k in zero2)
    pp = deepspeed_config("deepspeed_offloadpp", shape)["zero_optimization"]
    assert pp["stage"] == 3 and pp["offload_optimizer"]["ratio"] == 0.3 and "offload_param" not in pp
    # ratio is resolved per sub-group (the first int((1 - ratio) n) on the GPU): enough of them
    groups = -(-shape.params() // pp["sub_group_size"])
    assert groups >= 30 and abs((groups - int(0.7 * groups)) / groups - 0.3) < 0.05
    zf = deepspeed_config("deepspeed_zenflow", shape)["zero_optimization"]
    assert zf["stage"] == 2 and zf["offload_optimizer"]["device"] == "cpu" and zf["overlap_comm"] is True
    assert zf["zenflow"]["update_interval"] == 4 and zf["zenflow"]["overlap_step"] is True
    assert 0 < zf["zenflow"]["topk_ratio"] < 1
    for system in DEEPSPEED_SYSTEMS:
        config = deepspeed_config(system, shape)
        assert config["optimizer"]["type"] == "AdamW" and "scheduler" not in config  # CPU Adam; Trainer's schedule
    fsdp = fsdp2_config()
    assert fsdp["version"] == 2 and fsdp["cpu_offload"] is True
    with pytest.raises(MegatrainConfigError, match="not a DeepSpeed system"):
        deepspeed_config("fsdp2", shape)


def test_every_system_is_documented_and_configured():
    shape = PRESETS["tiny"]
    for system in SYSTEMS:
        config = system_config(system, shape)
        assert config["note"]
    assert "stale by design" in system_config("deepspeed_zenflow", shape)["note"]


def test_cpu_optimizer_threads_are_the_hosts_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what a launcher may leave behind
    cores = host_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    for system in DEEPSPEED_SYSTEMS | {"fsdp2"}:
        assert worker_env(system)["OMP_NUM_THREADS"] == str(cores)
        assert system_config(system, PRESETS["tiny"])["OMP_NUM_THREADS"] == cores
    assert worker_env("megatrain")["OMP_NUM_THREADS"] == "1"  # megatrain and plain: the environment as given


def test_zenflow_refuses_trainer_accumulation(tmp_path):
    check_workload("deepspeed_zenflow", 1)
    with pytest.raises(MegatrainConfigError, match="update_interval"):
        check_workload("deepspeed_zenflow", 4)
    args = build_parser().parse_args(["--model", "tiny", "--grad-accum", "4", "--device", "cpu",
                                      "--out", str(tmp_path)])
    (tmp_path / "logs").mkdir()
    result = run_system("deepspeed_zenflow", args, PRESETS["tiny"], tmp_path)
    assert result["status"] == "unavailable" and "tokens_per_s" not in result


def test_deepspeed_accepts_the_configs():
    """DeepSpeed's own config classes (extra keys forbidden) take every config, "auto" filled in."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    for system in sorted(DEEPSPEED_SYSTEMS):
        config = deepspeed_config(system, PRESETS["llama-3.14b"])
        config.update(bf16={"enabled": True}, fp16={"enabled": False}, gradient_accumulation_steps=1,
                      gradient_clipping=1.0, train_batch_size=4, train_micro_batch_size_per_gpu=4)
        config["optimizer"]["params"] = {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
        zero = DeepSpeedConfig(config).zero_config
        expected = config["zero_optimization"]
        assert int(zero.stage) == expected["stage"] and zero.reduce_bucket_size == expected["reduce_bucket_size"]
        assert zero.offload_optimizer.ratio == expected["offload_optimizer"].get("ratio", 1.0)
        assert (zero.zenflow is not None) == ("zenflow" in expected)


def test_cli_rejects_unknown_system_and_mismatched_merge(tmp_path):
    with pytest.raises(MegatrainConfigError, match="allowed"):
        parse_systems("megatrain,zero4")
    (tmp_path / "results.json").write_text(json.dumps({"workload": {"seq_len": 1}, "results": {}}))
    with pytest.raises(MegatrainConfigError, match="different workload"):
        merged_results(tmp_path, {"seq_len": 2}, ["plain"])
    kept = {"workload": {"seq_len": 2}, "results": {"deepspeed": {"status": "ok"}, "plain": {"status": "ok"}}}
    (tmp_path / "results.json").write_text(json.dumps(kept))
    assert list(merged_results(tmp_path, {"seq_len": 2}, ["plain"])) == ["deepspeed"]
    # a record written before the shape had more fields still merges; a changed field does not
    kept["workload"] = {"seq_len": 2, "shape": {"hidden": 8}}
    (tmp_path / "results.json").write_text(json.dumps(kept))
    assert list(merged_results(tmp_path, {"seq_len": 2, "shape": {"hidden": 8, "tied": False}}, ["plain"])) == ["deepspeed"]
    with pytest.raises(MegatrainConfigError, match="different workload"):
        merged_results(tmp_path, {"seq_len": 2, "shape": {"hidden": 16, "tied": False}}, ["plain"])


@pytest.mark.slow
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
                             text=True, check=True, cwd=REPO_ROOT)
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


def test_gpu_suite_dry_run_commands_parse():
    """Every stage of scripts/gpu_suite.sh, dry: each bench command parses with the bench's own
    parser, names known systems that accept the workload, and fits one call by its estimate."""
    import shlex
    import subprocess
    from pathlib import Path

    root = REPO_ROOT
    listing = subprocess.run(["bash", "scripts/gpu_suite.sh", "--list"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.splitlines()
    stages = {line.split()[0]: int(line.split()[1].strip("~")) for line in listing}
    assert {"tests", "baselines-16k", "baselines-4x16k", "1.36b", "7b"} <= set(stages)
    assert all(estimate <= 585 for estimate in stages.values()), stages
    env = {**os.environ, "DRY_RUN": "1", "MEGATRAIN_COMMIT": "abc1234", "MEGATRAIN_CONFIG": '{"device_update": true}'}
    done = subprocess.run(["bash", "scripts/gpu_suite.sh", *stages], cwd=root, capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    commands = [shlex.split(line[len("DRY:"):]) for line in done.stdout.splitlines() if line.startswith("DRY:")]
    parts = {"longctx": ["longctx-64k", "longctx-128k"], "longctx-more": ["longctx-256k"],  # several benches
             "state-3b": ["state-3b-fp32", "state-3b-8bit", "state-3b-4bit"],
             "grad-3b": ["grad-3b-fp32", "grad-3b-bf16"]}
    # dp-7b: one run on 1 GPU, one on 2; disk-13b: the raw disk rates and the estimate before its bench
    assert len(commands) == len(stages) + 1 + 2 + sum(len(p) - 1 for p in parts.values())
    dp = [w for w in commands if "scripts/gpu_train.py" in w]
    assert [w[w.index("--nproc_per_node") + 1] for w in dp] == ["1", "2"]
    assert all(w[w.index("--micro-batch") + 1] == "2" and w[w.index("--hidden") + 1] == "4096" for w in dp)
    benches = {}
    for words in commands:
        if "megatrain_hf.cli" not in words or "bench" not in words:
            continue
        argv = words[words.index("bench") + 1:]
        args = build_parser().parse_args(argv)
        stage = Path(args.out).name
        assert Path(args.out).parent.name == "abc1234"  # named with the commit
        if stage.startswith("disk-13b"):  # megatrain alone, with the disk tier
            assert json.loads(words[1].split("=", 1)[1])["offload_dir"] and args.systems == "megatrain"
        elif stage.startswith("grad-3b"):  # megatrain alone, one grad_dtype per bench, accumulation 1
            assert json.loads(words[1].split("=", 1)[1])["grad_dtype"] == stage.split("-")[-1]
            assert args.grad_accum == 1 and args.systems == "megatrain"
        elif stage == "qlora-70b":  # its own options, not the caller's
            assert words[:2] == ["env", 'MEGATRAIN_CONFIG={"max_gpu_memory": "24GiB"}'] and args.lora_rank == 16
        elif stage.startswith("state-3b"):  # megatrain alone, one optimizer_state per bench
            assert json.loads(words[1].split("=", 1)[1])["optimizer_state"] == stage.split("-")[-1]
        elif stage.startswith("longctx"):  # megatrain alone, with its long-context options
            assert words[1].startswith("MEGATRAIN_CONFIG=") and json.loads(words[1].split("=", 1)[1])
            assert args.model == "llama-7b" and args.seq_len >= 65536 and args.systems == "megatrain"
        else:
            assert words[:3] == ["env", "-u", "MEGATRAIN_CONFIG"]  # megatrain's defaults in the comparisons
        for system in parse_systems(args.systems):
            check_workload(system, args.grad_accum)
        assert args.budget_s is not None and args.device == "cuda" and args.dtype == "bf16"
        benches[stage] = args
    assert set(benches) == (set(stages) - {"tests", "probe", "quality", "dp-7b", *parts}) | {p for ps in parts.values() for p in ps}
    sixteen = benches["baselines-16k"]
    assert (sixteen.model, sixteen.seq_len * sixteen.micro_batch * sixteen.grad_accum) == ("llama-3.14b", 16384)
    assert sixteen.warmup_steps >= 8 and "deepspeed" in sixteen.systems
    four = benches["baselines-4x16k"]
    assert (four.seq_len * four.micro_batch, four.grad_accum) == (16384, 4)
    assert (benches["1.36b"].model, benches["1.36b"].grad_accum) == ("llama-1.36b", 4)
    seven = benches["7b"]
    assert (seven.model, seven.seq_len * seven.micro_batch, seven.grad_accum) == ("llama-7b", 8192, 8)
    ran = {s for a in benches.values() for s in parse_systems(a.systems)}
    assert ran == set(SYSTEMS)  # every system has a stage
    more = benches["baselines-16k-more"]
    assert more.steps % 4 == 0  # ZenFlow's whole update cycles


def test_budget_skips_systems_without_time_and_combine_joins_parts(tmp_path):
    from megatrain_hf.bench.combine import combine, main as combine_main

    out = tmp_path / "part"
    assert main(["--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--systems", "plain,megatrain",
                 "--budget-s", "10", "--out", str(out)]) == 1  # nothing ran
    report = json.loads((out / "results.json").read_text())
    for result in report["results"].values():
        assert result["status"] == "skipped" and "--budget-s 10" in result["reason"] and "tokens_per_s" not in result
    row = next(line for line in (out / "results.md").read_text().splitlines() if line.startswith("| plain |"))
    assert not re.search(r"\d", row)
    a, b = _fake_report({"deepspeed": {"status": "unavailable", "reason": "x"}}), _fake_report(
        {"plain": {"status": "unavailable", "reason": "y"}})
    combined = combine([("a.json", a), ("b.json", b)])
    assert list(combined["results"]) == ["plain", "deepspeed"]  # the bench's order
    assert combined["results"]["plain"]["source"]["file"] == "b.json"
    b["workload"] = {**b["workload"], "seq_len": 16}
    with pytest.raises(MegatrainConfigError, match="differs"):
        combine([("a.json", a), ("b.json", b)])
    (tmp_path / "a.json").write_text(json.dumps(a))
    assert combine_main(["--out", str(tmp_path / "c"), str(tmp_path / "a.json")]) == 0
    assert "Combined from `" in (tmp_path / "c" / "results.md").read_text()


def test_deepspeed_system_check_reads_what_took_effect():
    """The check on a stand-in for DeepSpeed's engine: passes on the configured variant, fails on another."""
    import enum
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from transformers import LlamaConfig

    from megatrain_hf.bench.systems import _check_deepspeed

    class Device(str, enum.Enum):  # DeepSpeed's OffloadDeviceEnum
        cpu = "cpu"

    def trainer(system, stage, param, ratio, zenflow, basic="DeepSpeedCPUAdam", placement=None):
        opt = SimpleNamespace(device=Device.cpu, pin_memory=True, ratio=ratio)
        engine = SimpleNamespace(
            zero_optimization_stage=lambda: stage, zero_offload_optimizer=lambda: opt,
            zero_offload_param=lambda: SimpleNamespace(device=Device.cpu) if param else None, zenflow=zenflow,
            optimizer=SimpleNamespace(subgroup_to_device=placement) if placement else SimpleNamespace(),
            basic_optimizer=type(basic, (), {})())
        shape = PRESETS["tiny"]
        config = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                             num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                             num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab, tie_word_embeddings=False)
        return SimpleNamespace(accelerator=SimpleNamespace(distributed_type=DistributedType.DEEPSPEED),
                               model_wrapped=engine, model=SimpleNamespace(config=config))

    facts = _check_deepspeed(trainer("deepspeed", 3, True, 1.0, False), "deepspeed")
    assert facts["offload_param_device"] == "cpu" and facts["basic_optimizer"] == "DeepSpeedCPUAdam"
    placement = {i: ("cuda" if i < 7 else "cpu") for i in range(10)}
    facts = _check_deepspeed(trainer("pp", 3, False, 0.3, False, placement=placement), "deepspeed_offloadpp")
    assert (facts["optimizer_subgroups"], facts["optimizer_subgroups_on_cpu"]) == (10, 3)
    assert _check_deepspeed(trainer("zf", 2, False, 1.0, True, "ZenFlowCPUAdam"), "deepspeed_zenflow")["zenflow"]
    with pytest.raises(RuntimeError, match="offload ratio"):
        _check_deepspeed(trainer("pp", 3, False, 1.0, False), "deepspeed_offloadpp")
    with pytest.raises(RuntimeError, match="ZeRO stage 2"):
        _check_deepspeed(trainer("z2", 3, False, 1.0, False), "deepspeed_zero2")
    with pytest.raises(RuntimeError, match="offload devices"):
        _check_deepspeed(trainer("z2", 2, True, 1.0, False), "deepspeed_zero2")
    with pytest.raises(RuntimeError, match="CPU Adam"):
        _check_deepspeed(trainer("z3", 3, True, 1.0, False, "FusedAdam"), "deepspeed")

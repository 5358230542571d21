"""TFLOPS of every raw benchmark result, recomputed by PaLM's model-FLOPs convention.

Convention (Chowdhery et al. 2022, "PaLM", Appendix B; the same as nanoGPT's ``estimate_mfu``)::

    training FLOPs per token = 6 * N + 12 * L * H * Q * S

N: parameters, excluding the input-embedding lookup table (a table tied to the LM head counts
once, as the head's matmul); L: layers; H: attention heads; Q: head dimension (H * Q is the
hidden size for Llama); S: sequence length. Causal attention is counted in full (not halved);
activation recompute is not counted. TFLOPS = FLOPs per token x tokens per optimizer step /
step time / 1e12.

The numbers recorded in the raw files (``tflops``) used ``6 * P + 12 * L * hidden * S`` per
token with P *including* the input embedding; this script recomputes from the recorded step
times (``megatrain bench`` results: mean over the measured steps; ``scripts/gpu_train.py``
results: the median it recorded) and the recorded model shape and parameter count. Every
benchmark here trains all parameters of an untied Llama, so N = P - vocab x hidden.

    python scripts/recompute_tflops.py                  # every docs/results/*.json, Markdown table
    python scripts/recompute_tflops.py docs/results/llama-7b-8x8k-d99d99b.json
    python scripts/recompute_tflops.py --csv
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def flops_per_token(params: int, *, hidden: int, layers: int, heads: int, vocab: int, seq_len: int,
                    tied: bool = False, head_dim: int | None = None) -> float:
    """``6 * N + 12 * L * H * Q * S`` with N = params minus the input-embedding table (kept when tied)."""
    n = params - (0 if tied else vocab * hidden)
    q = head_dim if head_dim else hidden // heads
    return 6.0 * n + 12.0 * layers * heads * q * seq_len


def _bench_rows(path: Path, data: dict) -> list[dict]:
    meta, workload = data["meta"], data["workload"]
    shape = workload["shape"]
    hw = meta.get("hardware", {})
    commit = (meta.get("git") or {}).get("commit")
    rows = []
    for system, r in data["results"].items():
        if r.get("status") != "ok":
            rows.append({"file": path.name, "system": system, "status": r.get("status")})
            continue
        carried = r.get("carried_over")
        per_token = flops_per_token(
            r["params"], hidden=shape["hidden"], layers=shape["layers"], heads=shape["heads"],
            vocab=shape["vocab"], seq_len=workload["seq_len"], tied=bool(shape.get("tied", False)),
            head_dim=shape.get("head_dim"),
        )
        step_s = r["step_time_mean_s"]
        rows.append({
            "file": path.name,
            "system": system,
            "status": "ok",
            # a system carried over with --merge (or inserted later) ran in another invocation
            "commit": (carried or {}).get("git_commit", commit) if carried else commit,
            "run_utc": (carried or {}).get("created_utc", meta.get("created_utc")),
            "other_invocation": bool(carried),
            "gpus": len(hw.get("gpus", [])),
            "ram_gib": round(hw.get("ram_total_gib", 0.0), 1),
            "tokens_per_step": r["tokens_per_step"],
            "seq_len": workload["seq_len"],
            "measured_steps": r.get("measured_steps"),
            "step_s": step_s,
            "step_kind": "mean",
            "tokens_per_s": r["tokens_per_s"],
            "tflops_recorded": r.get("tflops"),
            "tflops": per_token * r["tokens_per_step"] / step_s / 1e12,
            "gpu_alloc_gib": r.get("gpu_peak_allocated_gib"),
            "gpu_reserved_gib": r.get("gpu_peak_reserved_gib"),
            "host_gib": r.get("host_peak_rss_gib"),
        })
    return rows


def _gpu_train_rows(path: Path, data: dict) -> list[dict]:
    a = data["args"]
    per_token = flops_per_token(data["params"], hidden=a["hidden"], layers=a["layers"], heads=a["heads"],
                                vocab=a["vocab"], seq_len=a["seq"])
    step_s = data["median_step_s"]
    return [{
        "file": path.name,
        "system": data["system"],
        "status": "ok",
        "commit": None,  # scripts/gpu_train.py did not record it; the file name carries it
        "run_utc": None,
        "other_invocation": False,
        "gpus": None,
        "ram_gib": None,
        "tokens_per_step": data["tokens_per_step"],
        "seq_len": a["seq"],
        "measured_steps": len(data["step_times"]) - 2,
        "step_s": step_s,
        "step_kind": "median",
        "tokens_per_s": data["tokens_per_s"],
        "tflops_recorded": data.get("tflops"),
        "tflops": per_token * data["tokens_per_step"] / step_s / 1e12,
        "gpu_alloc_gib": data.get("gpu_peak_GiB"),
        "gpu_reserved_gib": None,
        "host_gib": data.get("host_peak_rss_GiB"),
    }]


def rows_of(path: Path) -> list[dict]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict) and {"meta", "workload", "results"} <= data.keys():
        return _bench_rows(path, data)
    if isinstance(data, dict) and {"args", "median_step_s", "params"} <= data.keys():
        return _gpu_train_rows(path, data)
    return []  # not a throughput result (e.g. the soak)


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path, help="result JSON files (default: docs/results/*.json)")
    p.add_argument("--csv", action="store_true", help="CSV instead of a Markdown table")
    args = p.parse_args(argv)
    files = args.files or sorted(RESULTS.glob("*.json"))
    rows = [row for f in files for row in rows_of(f)]
    fields = ["file", "system", "commit", "other_invocation", "gpus", "ram_gib", "tokens_per_step", "seq_len",
              "measured_steps", "step_s", "step_kind", "tokens_per_s", "tflops_recorded", "tflops",
              "gpu_alloc_gib", "gpu_reserved_gib", "host_gib"]
    if args.csv:
        w = csv.DictWriter(sys.stdout, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow(row)
        return 0
    print("| file | system | commit | tokens/step | seq | step s | tokens/s | TFLOPS recorded (6P) | "
          "**TFLOPS (PaLM)** | GPU alloc / reserved GiB | host GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['file']} | {r['system']} | {r['status']} |  |  |  |  |  |  |  |  |")
            continue
        commit = (r["commit"] or "—")[:7] + (" (other invocation)" if r["other_invocation"] else "")
        print(
            f"| {r['file']} | {r['system']} | {commit} | {r['tokens_per_step']:,} | {r['seq_len']} | "
            f"{r['step_s']:.3f} ({r['step_kind']}) | {r['tokens_per_s']:,.0f} | {_fmt(r['tflops_recorded'], '.1f')} | "
            f"**{r['tflops']:.1f}** | {_fmt(r['gpu_alloc_gib'], '.2f')} / {_fmt(r['gpu_reserved_gib'], '.2f')} | "
            f"{_fmt(r['host_gib'], '.2f')} |"
        )
    print()
    print("TFLOPS (PaLM) = (6 N + 12 L H Q S) x tokens per step / step time / 1e12, N without the input "
          "embedding; recorded = 6 P + 12 L hidden S with P including it.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

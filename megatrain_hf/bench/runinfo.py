"""What a benchmark ran on and what it ran: hardware, versions, git commit, command, workload.

Collected by the runner without importing torch's CUDA side (versions come from package
metadata, the GPU's name from ``nvidia-smi``); each worker adds what it sees from inside.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from .flops import CONVENTIONS as FLOPS_CONVENTIONS
from .flops import FLOPS_CONVENTION, model_flops_per_token
from .presets import ModelShape
from .trend import RULE as TREND_RULE

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "megatrain_hf")


def workload(args: argparse.Namespace, shape: ModelShape) -> dict[str, Any]:
    """Everything that must be equal for two results to be comparable."""
    return {
        "model": args.model,
        "shape": shape.to_dict(),
        "approx_params": shape.params(),
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "tokens_per_step": args.seq_len * args.micro_batch * args.grad_accum,
        "model_flops_per_token": model_flops_per_token(shape, args.seq_len),
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "lora_rank": getattr(args, "lora_rank", None),
        "base_quantization": getattr(args, "base_quantization", "none"),
        "activation_checkpointing": True,
    }


def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        done = subprocess.run(cmd, check=False, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_info() -> dict[str, Any]:
    """The checkout's commit; ``MEGATRAIN_COMMIT`` wins (a copied tree whose .git is not the source's)."""
    repo = str(Path(__file__).resolve().parents[2])
    declared = os.environ.get("MEGATRAIN_COMMIT")
    if declared:
        return {"commit": declared, "dirty": None, "note": "from MEGATRAIN_COMMIT"}
    commit = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    status = _run(["git", "status", "--porcelain"], cwd=repo)
    return {"commit": commit, "dirty": bool(status) if status is not None else None,
            "note": None if commit else "git rev-parse HEAD failed (not a git checkout, or no commit yet)"}


def hardware() -> dict[str, Any]:
    gpus = None
    if shutil.which("nvidia-smi"):
        text = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
        gpus = [line.strip() for line in text.splitlines()] if text else None
    return {
        "cpu_logical": os.cpu_count(),
        "cpu_physical": psutil.cpu_count(logical=False),
        "cpu_model": _cpu_model(),
        "ram_total_gib": psutil.virtual_memory().total / 2**30,
        "gpus": gpus,
        "platform": platform.platform(),
    }


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def run_metadata(argv: list[str] | None, out: Path) -> dict[str, Any]:
    return {
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # The interpreter's own argv ("python -m megatrain_hf.bench ..." or the console script).
        "command_line": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "python_executable": sys.executable,
        "cwd": os.getcwd(),
        "out": str(out),
        "git": git_info(),
        "hardware": hardware(),
        "versions": versions(),
        "flops_convention": FLOPS_CONVENTION,
        "definitions": DEFINITIONS,
    }


DEFINITIONS = {
    "step_time": "wall time from the end of one optimizer step to the end of the next (on_step_end to "
                 "on_step_end, device synchronized), warmup steps excluded; mean and median over measured steps; "
                 "every step's time in step_times_s (warmup steps' in warmup_step_times_s)",
    "trend": "whether the measured steps still get faster or slower: " + TREND_RULE,
    "tokens_per_s": "tokens_per_step / mean step time (= measured tokens / measured wall time)",
    "tflops": FLOPS_CONVENTION,
    "tflops_causal": "convention 'palm_causal': " + FLOPS_CONVENTIONS["palm_causal"],
    "gpu_peak": "torch.cuda.max_memory_allocated from the moment the model is built (its random init, on the "
                "GPU for systems other than DeepSpeed, is then freed and the statistics reset) to the end of "
                "training; megatrain under max_gpu_memory: its own maxima; also max_memory_reserved, and device "
                "memory in use per cudaMemGetInfo sampled every 50 ms",
    "host_peak_rss": "max of psutil RSS sampled every 50 ms in the worker (a fresh process per system); "
                     "getrusage ru_maxrss reported as a cross-check",
    "link_bytes_per_step": "host<->device bytes per optimizer step; only megatrain counts them (engine stats), "
                           "other systems: null, not instrumented",
    "phases": "between: previous step end -> on_step_begin (logging, batch fetch); fwd_bwd: -> "
              "on_pre_optimizer_step (all micro-batches' forward+backward, clipping); optimizer: -> "
              "on_optimizer_step; post: -> on_step_end. DeepSpeed steps inside backward, so its optimizer "
              "time appears in fwd_bwd",
}

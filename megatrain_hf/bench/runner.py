"""``megatrain bench``: every system side by side on one machine, in one invocation.

The runner itself never touches CUDA (a CUDA context here would sit in GPU memory while the
workers run). For each system it starts a fresh worker process (:mod:`.worker`) with a timeout,
collects the worker's JSON (or, when the worker died without writing one, its exit status and
the tail of its log), then writes ``results.json``, ``results.md`` and ``results.png``.
DeepSpeed and FSDP2 workers get a world-size-1 distributed environment (MASTER_ADDR/PORT, RANK,
WORLD_SIZE, LOCAL_RANK), the same thing ``torchrun --nproc_per_node 1`` would set, without an
extra launcher process between the runner and the measured one, and, since their optimizer steps
on the CPU through torch's OpenMP, ``OMP_NUM_THREADS`` = the host's cores
(:func:`.systems.host_cores`). Every system runs the same ``--warmup-steps`` untimed steps first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import MegatrainConfigError
from .presets import PRESETS, SHAPE_FIELDS, ModelShape, add_lora_arguments, add_shape_arguments, shape_from_args
from .report import write_reports
from .runinfo import run_metadata, workload
from .systems import (CPU_OPTIMIZER_SYSTEMS, DEEPSPEED_SYSTEMS, DISTRIBUTED_SYSTEMS, SYSTEMS, check_workload,
                      host_cores, system_config)

logger = logging.getLogger(__name__)

REPORT_MARGIN_S = 15.0  # writing results.json/.md/.png after the last worker
MIN_SYSTEM_S = 30.0  # below this no worker gets past building its model

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatrain bench",
        description="Train the same Llama-shaped model with megatrain and the baselines (plain Trainer; "
        "DeepSpeed ZeRO-3 offload, ZeRO-2 offload, ZeRO-Offload++, ZenFlow; FSDP2 CPU offload); "
        "write results.json/.md/.png.",
    )
    add_shape_arguments(p)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="measured optimizer steps")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="optimizer steps every system runs first, untimed (the report flags a system whose "
                   "measured steps still trend: raise this)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per system before its worker is killed")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole invocation: each worker's timeout is cut to what is left (less "
                   f"{REPORT_MARGIN_S:g} s for the reports), and a system with under {MIN_SYSTEM_S:g} s left is "
                   "reported 'skipped', not started")
    p.add_argument("--seed", type=int, default=0)
    add_lora_arguments(p)
    p.add_argument("--out", default="bench_output", help="directory for results.json, results.md, results.png")
    p.add_argument("--profile", action="store_true",
                   help="each system runs two more steps after the measured ones; the second is recorded by "
                   "torch.profiler into OUT/logs/<system>.json.trace.json (for reading where time goes; not measured)")
    p.add_argument("--merge", action="store_true",
                   help="keep the other systems' results from an existing OUT/results.json of the same workload")
    return p


def parse_systems(text: str) -> list[str]:
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise MegatrainConfigError(f"--systems {text!r}: unknown {unknown}; allowed: {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(systems))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_command(system: str, args: argparse.Namespace, shape: ModelShape, json_path: Path) -> list[str]:
    cmd = [sys.executable, "-m", "megatrain_hf.bench.worker", "--system", system, "--json-out", str(json_path),
           "--model", args.model]
    for name in SHAPE_FIELDS:
        cmd += [f"--{name.replace('_', '-')}", str(getattr(shape, name))]
    for name in ("seq_len", "micro_batch", "grad_accum", "steps", "warmup_steps", "dtype", "device", "seed"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if getattr(args, "profile", False):
        cmd.append("--profile")
    if getattr(args, "lora_rank", None) is not None:
        cmd += ["--lora-rank", str(args.lora_rank), "--base-quantization", args.base_quantization]
    return cmd


def worker_env(system: str) -> dict[str, str]:
    """The runner's environment, this package importable, and a process group of one when needed."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    if system in CPU_OPTIMIZER_SYSTEMS:
        env["OMP_NUM_THREADS"] = str(host_cores())
    if system in DISTRIBUTED_SYSTEMS:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    return env


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the worker's process group (it leads its own session), then kill it if needed."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _log_tail(path: Path, n_chars: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-n_chars:]


def run_system(system: str, args: argparse.Namespace, shape: ModelShape, out: Path,
               timeout: float | None = None) -> dict[str, Any]:
    """One worker, start to finish (killed after ``timeout``, default ``--timeout``); a result dict
    whatever happens to the worker."""
    timeout = args.timeout if timeout is None else timeout
    config = system_config(system, shape)
    if system in DEEPSPEED_SYSTEMS and importlib.util.find_spec("deepspeed") is None:
        return {"system": system, "status": "unavailable", "system_config": config,
                "reason": f"deepspeed is not installed in this Python ({sys.executable}): "
                          "importlib.util.find_spec('deepspeed') is None"}
    try:
        check_workload(system, args.grad_accum)
    except ValueError as exc:
        return {"system": system, "status": "unavailable", "system_config": config, "reason": str(exc)}
    json_path = out / "logs" / f"{system}.json"
    log_path = out / "logs" / f"{system}.log"
    json_path.unlink(missing_ok=True)
    cmd = worker_command(system, args, shape, json_path)
    logger.info("bench: starting %s: %s", system, " ".join(cmd))
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=worker_env(system), start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            returncode = None
    wall_s = time.perf_counter() - start
    if json_path.exists():  # written last thing by the worker: its result stands even if it hung at exit
        result = json.loads(json_path.read_text())
        if returncode is None:
            result["note"] = f"worker hung after writing its result; killed after {timeout:g} s"
    elif returncode is None:
        result = {"status": "failed", "reason": f"timed out after {timeout:g} s (--timeout, or what --budget-s "
                                                f"left); worker killed",
                  "log_tail": _log_tail(log_path)}
    else:
        hint = " (SIGKILL: often the kernel's OOM killer, host RAM exhausted)" if returncode == -signal.SIGKILL else ""
        result = {"status": "failed", "reason": f"worker exited with status {returncode}{hint} without a result",
                  "log_tail": _log_tail(log_path)}
    result.update(system=system, system_config=config, worker_wall_s=wall_s, worker_returncode=returncode,
                  worker_command=cmd, worker_log=str(log_path.relative_to(out)))
    return result


def _same_workload(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Equal on every field both records have (later versions describe the shape in more fields)."""
    if set(old) - set(new):
        return False
    for key, value in old.items():
        if isinstance(value, dict) and isinstance(new[key], dict):
            if any(new[key].get(k) != v for k, v in value.items()):
                return False
        elif new[key] != value:
            return False
    return True


def merged_results(out: Path, this_workload: dict[str, Any], systems: list[str]) -> dict[str, Any]:
    """Results of systems not run now, from OUT/results.json of the same workload (``--merge``)."""
    path = out / "results.json"
    if not path.exists():
        return {}
    previous = json.loads(path.read_text())
    if not _same_workload(previous.get("workload") or {}, this_workload):
        raise MegatrainConfigError(
            f"--merge: {path} holds a different workload ({previous.get('workload')}) than this run "
            f"({this_workload}); use another --out or drop --merge."
        )
    meta = previous.get("meta", {})
    origin = {"created_utc": meta.get("created_utc"), "command_line": meta.get("command_line"),
              "git_commit": meta.get("git", {}).get("commit")}
    kept = {k: v for k, v in previous.get("results", {}).items() if k not in systems}
    for result in kept.values():
        result.setdefault("carried_over", origin)  # first origin wins across repeated merges
        _current_convention(result, this_workload)
    return kept


def _current_convention(result: dict[str, Any], this_workload: dict[str, Any]) -> None:
    """A carried-over result written under an earlier FLOP convention gets TFLOPS by the current one
    (same workload, so the same model FLOPs per step; its measured step time is kept)."""
    per_token = this_workload.get("model_flops_per_token")
    if result.get("status") != "ok" or "model_flops_per_step" in result or per_token is None:
        return
    flops = per_token * this_workload["tokens_per_step"]
    result.update(model_flops_per_token=per_token, model_flops_per_step=flops,
                  tflops=flops / result["step_time_mean_s"] / 1e12,
                  tflops_note="recomputed from the carried-over mean step time with the current FLOP convention")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the markdown table. Exit 0 when at least one system ran."""
    args = build_parser().parse_args(argv)
    shape = shape_from_args(args)
    systems = parse_systems(args.systems)
    for name in ("seq_len", "micro_batch", "grad_accum", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_steps < 0:
        raise SystemExit(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    this_workload = workload(args, shape)
    results = merged_results(out, this_workload, systems) if args.merge else {}
    deadline = time.monotonic() + args.budget_s if args.budget_s is not None else None
    for system in systems:
        timeout = args.timeout
        if deadline is not None:
            left = deadline - time.monotonic() - REPORT_MARGIN_S
            if left < MIN_SYSTEM_S:
                results[system] = {"system": system, "status": "skipped", "system_config": system_config(system, shape),
                                   "reason": f"--budget-s {args.budget_s:g}: {max(left, 0):.0f} s left, not started"}
                logger.info("bench: %s skipped: %s", system, results[system]["reason"])
                continue
            timeout = min(timeout, left)
        results[system] = run_system(system, args, shape, out, timeout)
        r = results[system]
        logger.info("bench: %s -> %s %s", system, r["status"], r.get("reason", ""))
    order = [s for s in SYSTEMS if s in results]
    report = {
        "meta": run_metadata(argv, out),
        "workload": this_workload,
        "results": {s: results[s] for s in order},
    }
    paths = write_reports(report, out)
    print(paths["markdown"].read_text())
    return 0 if any(r["status"] == "ok" for r in results.values()) else 1


__all__ = ["PRESETS", "build_parser", "main"]

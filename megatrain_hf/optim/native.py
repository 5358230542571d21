"""The native host kernel (``csrc/host_adamw.cpp``): built on first use, loaded through ctypes.

It is plain C++ (no torch headers), compiled with the system compiler (``$CXX``, else ``c++``)
for this machine's CPU (``-march=native``) into ``$MEGATRAIN_CACHE`` (default
``~/.cache/megatrain_hf``), named by a hash of the source, the flags and the CPU, so a shared home
directory never hands one machine another's build. Building takes about a second; if it fails
(no compiler), :func:`host_adamw` returns None with one warning and HostAdamW uses torch's kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "host_adamw.cpp"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=c++17", "-pthread")


_CPU_KEYS = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")


def _cpu_tag() -> str:
    """What ``-march=native`` depends on: the first core's model and feature lines (x86 and ARM)."""
    seen: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in _CPU_KEYS and key not in seen:
                    seen[key] = line.strip()
    except OSError:
        pass
    return platform.machine() + platform.processor() + "".join(seen[k] for k in sorted(seen))


def _cache_dir() -> Path:
    return Path(os.environ.get("MEGATRAIN_CACHE") or Path.home() / ".cache" / "megatrain_hf")


def build(path: Path | None = None) -> Path:
    """Compile the kernel (if not cached) and return the shared library's path; raises on failure."""
    compiler = os.environ.get("CXX", "c++")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *FLAGS, _cpu_tag())).encode()).hexdigest()[:16]
    target = path or _cache_dir() / f"host_adamw-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent build never sees a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_PTRS = ctypes.POINTER(ctypes.c_void_p)
_FLOATS = ctypes.POINTER(ctypes.c_float)


@functools.lru_cache(maxsize=1)
def host_adamw() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (logged once) if it cannot be built here."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("megatrain: native host AdamW kernel unavailable (%s); using torch's fused kernel", exc)
        return None
    fn = lib.megatrain_adamw
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, _PTRS, _PTRS, _PTRS, _PTRS, _PTRS, ctypes.POINTER(ctypes.c_int64)] + [_FLOATS] * 7 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_int,
    ]
    return lib


def adamw(
    lib: ctypes.CDLL,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    stages: list[torch.Tensor | None],
    scalars: dict[str, list[float]],
    clip: float,
    maximize: bool,
    threads: int,
) -> None:
    """One AdamW step over contiguous fp32 tensors (``scalars``: per-tensor hyper-parameters, see the C++)."""
    n = len(params)
    for t in (*params, *grads, *exp_avgs, *exp_avg_sqs):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"native AdamW needs contiguous fp32 CPU tensors, got {t.dtype} {t.device}")

    def ptrs(tensors):
        return (ctypes.c_void_p * n)(*[t.data_ptr() if t is not None else None for t in tensors])

    def floats(name):
        return (ctypes.c_float * n)(*scalars[name])

    status = lib.megatrain_adamw(
        n, ptrs(params), ptrs(grads), ptrs(exp_avgs), ptrs(exp_avg_sqs), ptrs(stages),
        (ctypes.c_int64 * n)(*[t.numel() for t in params]),
        floats("decay"), floats("lerp"), floats("beta2"), floats("sq_coef"), floats("bc2_sqrt"), floats("eps"),
        floats("neg_step_size"), float(clip), int(maximize), int(threads),
    )
    if status != 0:
        logger.warning("megatrain: native AdamW could not start all %d threads; the update ran on fewer", threads)

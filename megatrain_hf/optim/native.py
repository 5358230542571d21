"""The native host kernel (``csrc/host_adamw.cpp``): built on first use, loaded through ctypes.

It is plain C++ (no torch headers), compiled with the system compiler (``$CXX``, else ``c++``)
for this machine's CPU (``-march=native``) into ``$MEGATRAIN_CACHE`` (default
``~/.cache/megatrain_hf``), named by a hash of the sources (``csrc/*``), the flags and the CPU, so a shared home
directory never hands one machine another's build. On a CPU with AVX-512 the compressed update's
decode and encode are vectorised (``csrc/quant_avx512.h``); ``build(defines=("MEGATRAIN_SCALAR",))``
builds the scalar loops alone, bitwise the same (the tests compare the two). Building takes about a second; if it fails
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


def _sources() -> bytes:
    """host_adamw.cpp and the headers it includes, named and in a fixed order."""
    return b"".join(p.name.encode() + p.read_bytes() for p in sorted(SOURCE.parent.iterdir()) if p.is_file())


def build(path: Path | None = None, defines: tuple[str, ...] = ()) -> Path:
    """Compile the kernel (if not cached) and return the shared library's path; raises on failure.
    ``defines``: preprocessor macros (``-D``), part of the cache key."""
    compiler = os.environ.get("CXX", "c++")
    flags = (*FLAGS, *(f"-D{d}" for d in defines))
    key = hashlib.sha256(_sources() + " ".join((compiler, *flags, _cpu_tag())).encode()).hexdigest()[:16]
    target = path or _cache_dir() / f"host_adamw-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
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
        return load(build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("megatrain: native host AdamW kernel unavailable (%s); using torch's fused kernel", exc)
        return None


def load(path: Path) -> ctypes.CDLL:
    """A built kernel library with its entry points typed (raises OSError if it cannot be loaded)."""
    lib = ctypes.CDLL(str(path))
    lib.megatrain_simd.restype = ctypes.c_int
    lib.megatrain_simd.argtypes = []
    fn = lib.megatrain_adamw
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, _PTRS, _PTRS, _PTRS, _PTRS, _PTRS, _PTRS, ctypes.POINTER(ctypes.c_int64)] + [
        _FLOATS] * 7 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_int,
    ]
    fn = lib.megatrain_adamw_compressed
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, *[_PTRS] * 8, ctypes.POINTER(ctypes.c_int64)] + [_FLOATS] * 7 + [
        ctypes.c_int, ctypes.c_int64] + [_FLOATS] * 4 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
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
    """One AdamW step over contiguous fp32 tensors (``scalars``: per-tensor hyper-parameters, see the C++;
    a gradient may be bf16)."""
    _check_cpu(params, exp_avgs, exp_avg_sqs, dtype=torch.float32)
    n = len(params)
    status = lib.megatrain_adamw(
        n, *_grad_ptrs(grads, params), _ptrs(exp_avgs), _ptrs(exp_avg_sqs), _ptrs(stages),
        (ctypes.c_int64 * n)(*[t.numel() for t in params]), *_hyper(scalars, n), float(clip), int(maximize),
        int(threads),
    )
    _report(status, threads)


_HYPER = ("decay", "lerp", "beta2", "sq_coef", "bc2_sqrt", "eps", "neg_step_size")


def _check_cpu(*groups: list[torch.Tensor], dtype: torch.dtype | None) -> None:
    for group in groups:
        for t in group:
            if (dtype is not None and t.dtype != dtype) or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"native AdamW needs contiguous {dtype or ''} CPU tensors, got {t.dtype} {t.device}")


def _grad_ptrs(grads: list[torch.Tensor], params: list[torch.Tensor]):
    """(params, fp32 gradients, bf16 gradients): each gradient in the array of its dtype, None in the other."""
    _check_cpu(grads, dtype=None)
    if any(g.dtype not in (torch.float32, torch.bfloat16) for g in grads):
        raise ValueError(f"native AdamW takes fp32 or bf16 gradients, got {sorted({str(g.dtype) for g in grads})}")
    return (_ptrs(params), _ptrs([g if g.dtype == torch.float32 else None for g in grads]),
            _ptrs([g if g.dtype == torch.bfloat16 else None for g in grads]))


def _ptrs(tensors):
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() if t is not None else None for t in tensors])


def _hyper(scalars: dict[str, list[float]], n: int) -> list:
    return [(ctypes.c_float * n)(*scalars[name]) for name in _HYPER]


def _floats(t: torch.Tensor):
    return ctypes.cast(t.data_ptr(), _FLOATS)


def adamw_compressed(
    lib: ctypes.CDLL,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    codes: tuple[list[torch.Tensor], list[torch.Tensor]],
    scales: tuple[list[torch.Tensor | None], list[torch.Tensor | None]],
    stages: list[torch.Tensor | None],
    scalars: dict[str, list[float]],
    fmt,
    clip: float,
    maximize: bool,
    threads: int,
) -> None:
    """One AdamW step with compressed moments (``fmt``: a ``quant.Format``), dequantize -> update ->
    requantize per block in one pass (``megatrain_adamw_compressed`` in the C++)."""
    _check_cpu(params, dtype=torch.float32)
    _check_cpu(*codes, dtype=None)
    n = len(params)
    if fmt.quantized:
        tables = [fmt.table(0), fmt.midpoints(0), fmt.table(1), fmt.midpoints(1)]
    else:
        tables = [torch.zeros(1)] * 4  # not read
    status = lib.megatrain_adamw_compressed(
        n, *_grad_ptrs(grads, params), _ptrs(codes[0]), _ptrs(scales[0]), _ptrs(codes[1]), _ptrs(scales[1]),
        _ptrs(stages), (ctypes.c_int64 * n)(*[t.numel() for t in params]), *_hyper(scalars, n), int(fmt.bits),
        int(fmt.block), *[_floats(t) for t in tables], float(clip), int(maximize), int(threads),
    )
    if status == -2:
        raise ValueError(f"native AdamW: unsupported compressed format {fmt}")
    _report(status, threads)


def _report(status: int, threads: int) -> None:
    if status != 0:
        logger.warning("megatrain: native AdamW could not start all %d threads; the update ran on fewer", threads)

"""Host RAM before allocating: what a model's units need, what is available, and the refusal.

:func:`host_breakdown_for_units` counts the real modules exactly as the host store will lay them
out (``core/layout.py``), :func:`check_host_memory` raises ``HostMemoryError`` with the arithmetic and
the fix, and :func:`admit` is the admission check of the training plan (``megatrain_hf/plan.py``),
which also settles ``host_staging="auto"``.
"""

from __future__ import annotations

import logging

import psutil
import torch

from ..errors import HostMemoryError, MegatrainConfigError
from ..core.layout import TensorSpec, UnitSizes, lay_out, wire_dtype
from .host_tiers import host_tiers
from ..core.frozen_formats import quant_format

logger = logging.getLogger(__name__)

GiB = 2**30

DEFAULT_HEADROOM_BYTES = 2 * GiB
"""Host RAM left free on top of the plan: the Python process, torch, the tokenizer, the data
loader and the OS page cache need some."""

TIER_LABELS = {
    "master": "fp32 master weights",
    "grad": "gradient accumulators",
    "exp_avg": "AdamW exp_avg (fp32)",
    "exp_avg_sq": "AdamW exp_avg_sq (fp32)",
    "staging": "compute-dtype staging copies",
    "frozen": "frozen weights (wire dtype)",
    "checkpoints": "offloaded activation checkpoints",
    "disk_slots": "RAM window of the disk tier",
    "moments_in_ram": "AdamW moments kept in RAM",
}


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest unit that keeps the number at least 1 (GiB, MiB, KiB, else B), unit
    included: a small model's plan reads "3.52 MiB", not "0.00 GiB"."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def available_host_bytes() -> int:
    """Host RAM available to a new allocation now (``psutil.virtual_memory().available``)."""
    return int(psutil.virtual_memory().available)


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MegatrainConfigError(f"{name}={value!r}: must be an integer >= {minimum}")
    return value


def host_breakdown_for_units(
    units: list[tuple[str, torch.nn.Module]],
    *,
    compute_dtype: torch.dtype,
    staging: bool = True,
    embedding_units: frozenset[int] = frozenset({0}),
    optimizer_state: bool | str = True,
    frozen_in_wire_dtype: bool = True,
    quantize=None,
    grad_dtype: torch.dtype = torch.float32,
    fp32_params: frozenset[int] = frozenset(),
) -> dict[str, int]:
    """Exact host bytes per tier for real modules, walked the way ``HostStore`` walks them.

    ``staging``: whether the store keeps a compute-dtype copy (it never does for fp32 compute);
    ``optimizer_state``: count ``HostAdamW``'s two moments per trainable element (True: fp32, or
    the ``optimizer_state`` format's name), False: not;
    ``frozen_in_wire_dtype``: frozen weights in the wire dtype, else in fp32 (``HostStore``'s). Tied
    parameters (one tensor in two units) are counted once, frozen ones in their wire dtype only;
    ``quantize(param)``: the scheme a frozen weight is stored in (``HostStore``'s), None: as is;
    ``grad_dtype``: ``HostStore``'s (its bf16 accumulators, ``core/grad_accumulators.py``);
    ``fp32_params``: ``HostStore``'s (parameters sent in fp32 whatever their shape).
    """
    sizes = unit_sizes(units, compute_dtype=compute_dtype, embedding_units=embedding_units,
                       frozen_in_wire_dtype=frozen_in_wire_dtype, quantize=quantize, fp32_params=fp32_params)
    return host_tiers(sizes, compute_dtype, staging=staging, optimizer_state=optimizer_state, grad_dtype=grad_dtype)


def unit_sizes(units: list[tuple[str, torch.nn.Module]], *, compute_dtype: torch.dtype,
               embedding_units: frozenset[int] = frozenset({0}), frozen_in_wire_dtype: bool = True,
               quantize=None, fp32_params: frozenset[int] = frozenset()) -> list[UnitSizes]:
    """Each unit's flat sizes, laid out as ``HostStore`` lays them out (``quantize``, ``fp32_params``: as in
    :func:`host_breakdown_for_units`)."""
    seen: set[int] = set()
    sizes = []
    for u, (_, module) in enumerate(units):
        specs = []
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in seen:  # tied: lives in the first unit that has it
                continue
            seen.add(id(p))
            wire = wire_dtype(p.dtype, p.ndim, compute_dtype, embedding=u in embedding_units, name=name,
                              fp32=id(p) in fp32_params)
            if not p.requires_grad and not frozen_in_wire_dtype and wire.is_floating_point:
                wire = torch.float32
            scheme = quantize(p) if quantize is not None and not p.requires_grad else None
            fmt = quant_format(scheme, tuple(p.shape), wire) if scheme is not None else None
            if fmt is not None:
                specs.append(TensorSpec(fmt.nbytes, False, torch.uint8))
                continue
            specs.append(TensorSpec(p.numel(), p.requires_grad, wire))
        sizes.append(lay_out(specs))
    return sizes


def check_host_memory(
    needed_bytes: int,
    breakdown: dict[str, int],
    available: int | None = None,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
) -> int:
    """Raise ``MemoryError`` (with the arithmetic and the fix) unless ``needed_bytes`` plus
    ``headroom_bytes`` fit in ``available`` (default: :func:`available_host_bytes`).

    ``breakdown`` maps tier names (``master``, ``grad``, ... or any label) to bytes; it is shown in
    the message. Returns the bytes to spare.
    """
    _check_int("needed_bytes", needed_bytes, 0)
    _check_int("headroom_bytes", headroom_bytes, 0)
    if available is None:
        available = available_host_bytes()
    spare = available - needed_bytes - headroom_bytes
    if spare >= 0:
        logger.info(
            "host memory: %.2f GiB needed + %.2f GiB headroom <= %.2f GiB available (%.2f GiB to spare)",
            needed_bytes / GiB, headroom_bytes / GiB, available / GiB, spare / GiB,
        )
        return spare
    width = max([len(TIER_LABELS.get(k, k)) for k in breakdown] + [28])
    rows = [f"  {TIER_LABELS.get(k, k):<{width}} {human_bytes(v):>12}" for k, v in breakdown.items()]
    listed = sum(breakdown.values())
    if listed != needed_bytes:
        rows.append(f"  {'other':<{width}} {human_bytes(needed_bytes - listed):>12}")
    rows += [
        f"  {'= needed':<{width}} {human_bytes(needed_bytes):>12}",
        f"  {'+ headroom (process, data, OS)':<{width}} {human_bytes(headroom_bytes):>12}",
        f"  {'= required':<{width}} {human_bytes(needed_bytes + headroom_bytes):>12}",
        f"  {'available now':<{width}} {human_bytes(available):>12}",
        f"  {'short by':<{width}} {human_bytes(-spare):>12}",
    ]
    message = (
        f"megatrain needs {human_bytes(needed_bytes)} of host RAM (+ {human_bytes(headroom_bytes)} headroom) but "
        f"only {human_bytes(available)} is available:\n" + "\n".join(rows) + "\n"
        "Fix: train a smaller model (fewer layers or a smaller preset; `megatrain estimate` prints the "
        "largest that fits), use LoRA/PEFT (frozen base weights cost 2 B/param in bf16 instead of ~18 B), "
        "free RAM held by other processes, or use a machine with more RAM. If this machine grants more "
        "than it reports available (some VMs grow their RAM as it is used), "
        "MegaTrainConfig(check_host_memory=False) skips the check."
    )
    raise HostMemoryError(message)


def model_bytes(units: list[tuple[str, torch.nn.Module]]) -> int:
    """Bytes the model's tensors hold now: released as they move into the store, so the admission counts
    them as available (each storage once; a weight not read from its checkpoint yet holds one element)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for _, m in units for p in m.parameters()}
    return sum(storages.values())


def admit(sizes: list[UnitSizes], compute_dtype: torch.dtype, host_staging: bool | str, optimizer_state: bool | str,
          available: int | None, extra: dict[str, int] | None = None,
          grad_dtype: torch.dtype = torch.float32) -> bool:
    """Raise with the arithmetic before allocating, rather than meet the OOM killer later.

    ``sizes``: the units as the store lays them out (:func:`unit_sizes`); ``available``: the RAM to plan
    against (None: not checked, ``check_host_memory=False``). Returns whether to keep the host staging
    copy: with ``host_staging="auto"`` it is dropped when that is what makes the plan fit (the training
    plan records it). ``extra``: further host tiers (label -> bytes) to count.
    """
    if available is None:
        return host_staging is not False

    def check(staging: bool) -> None:
        breakdown = host_tiers(sizes, compute_dtype, staging=staging, optimizer_state=optimizer_state,
                               grad_dtype=grad_dtype) | (extra or {})
        check_host_memory(sum(breakdown.values()), breakdown, available=available)

    if host_staging is False:
        check(False)
        return False
    try:
        check(True)
        return True
    except MemoryError:
        if host_staging is True or compute_dtype == torch.float32:
            raise
        check(False)  # raises (with the smaller plan's arithmetic) if even that does not fit
        return False

"""The disk tier's arithmetic: where the optimizer state goes, and the refusal when RAM + disk are short.

:func:`tier_bytes` is the arithmetic (disk bytes, RAM window, bytes read and written per optimizer
step) shared by the training plan (``megatrain_hf/plan.py``) and ``megatrain estimate``;
:func:`place_tiers` settles ``offload_state`` against the machine's RAM and ``offload_dir``'s free
space (``shutil.disk_usage``) and raises with the numbers when even RAM + disk are short.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import torch

from ..errors import DiskSpaceError
from ..core.disk_io import ALIGN, align_up, check_offload_dir, remove_stale_run_dirs
from ..core.layout import UnitSizes
from .host_tiers import moment_bytes, moment_parts
from . import host as host_memory
from .host import GiB, human_bytes


DEFAULT_WINDOW = 4
"""RAM slots of the disk tier (the unit updating, one written back behind it, two read ahead); the
same number as ``optim/paged_state.py``'s default."""

DISK_HEADROOM_BYTES = 1 * GiB
"""Free space left on ``offload_dir``'s filesystem on top of the tier (logs, checkpoints' temp files)."""



@dataclass(frozen=True)
class DiskTier:
    """The optimizer state's placement and its bytes."""

    on_disk: bool
    units: tuple[int, ...] = ()  # the units whose moments are on disk (the others' are in RAM)
    disk_bytes: int = 0  # the files of the tier
    ram_bytes: int = 0  # the RAM window (slots) that pages them
    read_per_step: int = 0  # bytes read from disk per optimizer step (every unit once)
    written_per_step: int = 0  # bytes written per optimizer step (every unit once)
    masters: tuple[int, ...] = ()  # the units whose staged fp32 masters are on disk too (offload_state="all")
    master_bytes: int = 0  # the RAM those masters no longer take (4 B per staged element)


def tier_bytes(sizes: list[UnitSizes], window: int = DEFAULT_WINDOW, units: list[int] | None = None,
               optimizer_state: str = "fp32", masters: list[int] = ()) -> DiskTier:
    """The moments of ``units`` (default: every unit with trainable parameters) of units laid out as
    ``sizes`` on disk, in ``optimizer_state``'s format, and the fp32 masters ``[:n_staged]`` of those of
    ``masters`` that have any: per unit one file, the master first, then each of the moments' tensors
    (fp32 flats, or codes and scales: ``memory/host_tiers.moment_parts``), each ALIGN-aligned; ``window``
    slots of the largest in RAM."""
    units = [u for u, s in enumerate(sizes) if s.n_train] if units is None else units
    masters = tuple(u for u in units if u in set(masters) and sizes[u].n_staged)
    per_unit = [2 * sum(align_up(n) for n in moment_parts(sizes[u], optimizer_state))
                + (align_up(4 * sizes[u].n_staged) if u in masters else 0) for u in units]
    total = sum(per_unit)
    slot = max(per_unit + [ALIGN])
    return DiskTier(True, tuple(units), total, min(window, len(units)) * slot, total, total, masters,
                    sum(4 * sizes[u].n_staged for u in masters))


def disk_free_bytes(path: str) -> int:
    return int(shutil.disk_usage(path).free)


def check_disk(offload_dir: str, needed: int, free: int | None = None) -> None:
    """Raise ``MemoryError`` with the arithmetic unless ``needed`` + headroom fit in ``offload_dir``'s free space
    (measured once the run directories of processes no longer alive are removed: their space is this run's)."""
    path = check_offload_dir(offload_dir)
    if free is None:
        remove_stale_run_dirs(path)
        free = disk_free_bytes(path)
    if needed + DISK_HEADROOM_BYTES <= free:
        return
    raise DiskSpaceError(
        f"megatrain's disk tier needs {human_bytes(needed)} in offload_dir={offload_dir!r} (+ "
        f"{human_bytes(DISK_HEADROOM_BYTES)} headroom) but its filesystem has {human_bytes(free)} free:\n"
        f"  optimizer state (AdamW moments, fp32 masters) {human_bytes(needed):>12}\n"
        f"  + headroom                                   {human_bytes(DISK_HEADROOM_BYTES):>12}\n"
        f"  free on {path}   {human_bytes(free):>12}\n"
        f"  short by                                     {human_bytes(needed + DISK_HEADROOM_BYTES - free):>12}\n"
        "Fix: free space there, point offload_dir at a larger disk, or train a smaller model "
        "(`megatrain estimate --offload-dir DIR` prints the largest that fits RAM + disk)."
    )


def place_tiers(sizes: list[UnitSizes], compute_dtype: torch.dtype, host_staging: bool | str,
                moments: str | None, offload_dir: str | None, offload_state: str, ram: int | None,
                disk_free: int | None, masters_possible: bool, grad_dtype: torch.dtype = torch.float32,
                window: int = DEFAULT_WINDOW) -> tuple[bool, DiskTier]:
    """Where the optimizer state of units laid out as ``sizes`` goes: (keep the staging copy, the tier).

    The arithmetic of the training plan's placement (``megatrain_hf/plan.py`` decides which options
    combine and refuses the others before this runs). ``moments``: HostAdamW's moment format (None: no
    HostAdamW state); ``ram``: the RAM to plan against (None: ``check_host_memory=False``, not checked);
    ``disk_free``: ``offload_dir``'s free bytes (None: measured here). ``offload_state="auto"``: the
    moments stay in RAM when the plan fits there, else the fewest units' moments go to disk (the last
    units in update order first) that make it fit, then, if even every unit's moments on disk leave RAM
    short, the staged fp32 masters of the fewest units too (where ``masters_possible``); ``"moments"``:
    every unit's moments on disk whatever RAM there is; ``"all"``: every unit's moments and staged
    masters. Raises ``HostMemoryError`` / ``DiskSpaceError`` with the arithmetic when RAM + disk are short.
    """
    def admit(state: bool | str, extra: dict | None = None, staging=host_staging) -> bool:
        return host_memory.admit(sizes, compute_dtype, staging, state, ram, extra=extra, grad_dtype=grad_dtype)

    if offload_dir is None or moments is None:
        return admit(moments or False), DiskTier(False)
    if offload_state == "auto":
        try:
            return admit(moments), DiskTier(False)
        except MemoryError:
            pass
    with_state = [u for u, s in enumerate(sizes) if s.n_train]
    with_masters = [u for u in with_state if sizes[u].n_staged]
    masters_total = 4 * sum(s.n_train for s in sizes)

    def split(k: int, m: int = 0) -> tuple[DiskTier, dict]:  # the last k units' moments, the last m's masters
        tier = tier_bytes(sizes, window, units=with_state[len(with_state) - k:], optimizer_state=moments,
                          masters=with_masters[len(with_masters) - m:] if m else ())
        kept = sum(2 * moment_bytes(sizes[u], moments) for u in with_state[: len(with_state) - k])
        extra = {"disk_slots": tier.ram_bytes, "moments_in_ram": kept}
        return tier, extra | ({"master": masters_total - tier.master_bytes} if m else {})

    def fits(k: int, m: int) -> bool:
        try:
            admit(False, split(k, m)[1], staging=True if m else host_staging)
            return True
        except MemoryError:
            return False

    def fewest(n: int, ok) -> int:  # the smallest i in [1, n] with ok(i), given ok(n) or n the fallback
        lo, hi = 0, n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi

    k, m = len(with_state), len(with_masters) if offload_state == "all" else 0
    if offload_state == "auto" and ram is not None:
        if fits(k, 0) or not (masters_possible and with_masters):
            k = fewest(k, lambda i: fits(i, 0))  # (the full split raises below with its arithmetic if short)
        else:
            m = fewest(len(with_masters), lambda j: fits(k, j))
    tier, extra = split(k, m)
    check_disk(offload_dir, tier.disk_bytes, disk_free)
    return admit(False, extra, staging=True if m else host_staging), tier


# ---------------------------------------------------------------------------------- planning from a shape
def shape_tier(shape, compute_dtype: str = "bf16", lora_rank: int | None = None,
               window: int = DEFAULT_WINDOW, optimizer_state: str = "fp32", masters: bool = False,
               experts_dtype: str = "auto") -> DiskTier:
    """:func:`tier_bytes` of a model shape (``memory/shapes.py``), as the store would lay it out;
    ``masters``: every unit's staged masters on disk too (``offload_state="all"``); ``experts_dtype``:
    ``MegaTrainConfig.experts_dtype``."""
    from .plan import _DTYPE_BY_NAME, LORA_TARGETS, _layout
    from ..core.layout import lay_out

    dtype = _DTYPE_BY_NAME[compute_dtype]
    sizes = [lay_out(u.specs(dtype)) for u in _layout(shape, lora_rank, LORA_TARGETS, experts_dtype=experts_dtype)]
    return tier_bytes(sizes, window, optimizer_state=optimizer_state,
                      masters=range(len(sizes)) if masters else ())


def ram_with_tier(plan, tier: DiskTier) -> int:
    """Host RAM of ``plan`` (``MemoryPlan``) with its moments (and ``tier.masters``' masters) on disk: their
    window instead of them."""
    return plan.host_total - plan.host_exp_avg - plan.host_exp_avg_sq - tier.master_bytes + tier.ram_bytes


def deepest_with_tier(shape, ram_available: int, disk_free: int, plan_of, masters: bool = False,
                      window: int = DEFAULT_WINDOW) -> tuple[int, int]:
    """The most layers of ``shape`` that RAM + disk hold: the moments that RAM cannot keep go to disk
    (``offload_state="auto"``, a unit at a time), or with ``masters`` every unit's moments and staged
    masters (``offload_state="all"``); (layers, params).

    ``plan_of(shape)``: the ``MemoryPlan`` with the caller's options. Both sides grow with depth, so
    a bisection finds it (0 when not even one layer fits)."""
    def fits(layers: int) -> bool:
        plan = plan_of(shape.with_layers(layers))
        tier = shape_tier(plan.shape, plan.compute_dtype, plan.lora_rank, window=window,
                          optimizer_state=plan.optimizer_state, masters=masters)
        base = ram_with_tier(plan, tier) + host_memory.DEFAULT_HEADROOM_BYTES  # every moment on disk
        slot = tier.ram_bytes // window
        to_disk = max(0, base + tier.disk_bytes - ram_available)  # moments RAM cannot keep
        to_disk = min(tier.disk_bytes, -(-to_disk // slot) * slot if to_disk else 0)  # whole units (at most)
        to_disk = tier.disk_bytes if masters else to_disk
        return base <= ram_available and to_disk + DISK_HEADROOM_BYTES <= disk_free

    lo, hi = 0, 1
    while fits(hi) and hi < 1 << 16:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, shape.with_layers(lo).params() if lo else 0

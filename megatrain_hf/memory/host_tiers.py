"""Host bytes per tier of a layout: what the store and HostAdamW will allocate, before they do.

The planner's arithmetic over units laid out by ``core/layout.lay_out``: masters, gradient
accumulators (``core/grad_accumulators.grad_bytes``), the two AdamW moments in their format
(``core/layout.MOMENT_FORMATS``; the codes and scales of a compressed format as
:func:`moment_parts`), the compute-dtype staging copy and the frozen flats. Tests hold it equal to
what a real store and optimizer allocate.
"""

from __future__ import annotations

import torch

from ..core.grad_accumulators import grad_bytes, low_precision_units
from ..core.layout import MOMENT_FORMATS, UnitSizes


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def moment_parts(sizes: UnitSizes, optimizer_state: str) -> tuple[int, ...]:
    """Bytes of each contiguous tensor of one AdamW moment of one unit in ``optimizer_state``: the
    codes, laid out like the master flat, then (blockwise formats) one fp32 scale per block of each
    trainable tensor. HostAdamW allocates these in RAM; the disk tier pages them as bytes."""
    bits, block = MOMENT_FORMATS[optimizer_state]
    codes = (sizes.n_train * bits + 7) // 8
    return (codes, 4 * max(1, sum(-(-n // block) for n in sizes.train_numels))) if block else (codes,)


def moment_bytes(sizes: UnitSizes, optimizer_state: str) -> int:
    """Host bytes of one AdamW moment of one unit in ``optimizer_state`` (:func:`moment_parts`' sum)."""
    return sum(moment_parts(sizes, optimizer_state))


def host_tiers(units: list[UnitSizes], compute_dtype: torch.dtype, *, staging: bool,
               optimizer_state: bool | str = True, grad_dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Host bytes per tier of units laid out by :func:`lay_out`.

    ``staging``: whether the store keeps the compute-dtype copy (never for fp32 compute);
    ``optimizer_state``: HostAdamW's two moments per trainable element in that format (``"fp32"``,
    ``"bf16"``, ``"8bit"``, ``"4bit"``; ``True``: fp32), or ``False``: not counted;
    ``grad_dtype``: the accumulators of the bf16-streamed part of every unit but the last (``core/grad_accumulators.py``).
    """
    low = low_precision_units(len(units), grad_dtype)
    trainable = sum(s.n_train for s in units)
    staged = sum(s.n_staged for s in units) if staging and compute_dtype != torch.float32 else 0
    frozen = sum(n * dtype_bytes(d) for s in units for d, n in s.frozen.items())
    state = "fp32" if optimizer_state is True else optimizer_state
    moments = sum(moment_bytes(s, state) for s in units if s.n_train) if state else 0
    return {
        "master": 4 * trainable,
        "grad": sum(grad_bytes(s.n_train, s.n_staged, u in low) for u, s in enumerate(units)),
        "exp_avg": moments,
        "exp_avg_sq": moments,
        "staging": staged * dtype_bytes(compute_dtype),
        "frozen": frozen,
    }

"""Decisions of the plan that need the model's sizes: where ``max_seq_len`` puts the optimizer state and the
activation checkpoints (the joint long-context plan of ``memory/seq_placement.py`` narrowed to exact choices),
and which units stay whole on the compute device (``resident_units``). :func:`plan.resolve` calls them; the
engine asks :func:`check_length` for each longer training sequence."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch

from .config import MegaTrainConfig
from .core.layout import UnitSizes
from .errors import LongContextFitError, UsageError
from .memory import host as host_memory
from .memory import seq_placement
from .memory.long_context import JointPlan
from .memory.shapes import ModelShape

if TYPE_CHECKING:
    from .plan import Machine, Run, TrainingPlan

logger = logging.getLogger("megatrain_hf.plan")


@dataclass(frozen=True)
class ResidencyPlan:
    """Units kept whole on the compute device (``core/resident.py``): masters, gradients and moments there."""

    units: frozenset[int] = frozenset()  # placed: the first ones in forward order
    fit: int | None = None  # how many the GPU budget holds (None: no budget known)
    budget: int | None = None  # bytes the resident units may take (the budget less the step's working set)
    device_bytes: int = 0  # what the placed units take on the device



# ---------------------------------------------------------------------------------- max_seq_len
_CHOSEN = {"offload_checkpoints": "auto", "checkpoint_interval": "auto", "host_staging": "auto"}
"""The options ``max_seq_len``'s placement sets when they are left at these values (and ``offload_state``
with ``offload_dir``)."""


def _fixed(c: MegaTrainConfig, machine: Machine, run: Run) -> tuple[seq_placement.Fixed, tuple, dict]:
    """(what the placement must keep of ``c``, the machine's (GPU, RAM, disk) bytes, the plan's other inputs)."""
    auto = lambda key: None if getattr(c, key) == _CHOSEN[key] else getattr(c, key)  # noqa: E731
    compute = "bf16" if c.resolve_dtype(trainer_bf16=run.bf16) == torch.bfloat16 else "fp32"
    fixed = seq_placement.Fixed(compute, c.optimizer_state, c.grad_dtype, c.checkpoint_dtype, auto("host_staging"),
                                auto("offload_checkpoints"), auto("checkpoint_interval"),
                                c.offload_state if c.offload_dir is not None else "auto", run.grad_accum or 1)
    disk = None if c.offload_dir is None else machine.disk_free if machine.disk_free is not None else \
        seq_placement.UNBOUNDED
    gpu = min((b for b in (c.gpu_memory_bytes(), machine.gpu_memory) if b is not None), default=None)
    budget = (gpu, machine.ram_available if c.check_host_memory else None, disk)
    return fixed, budget, dict(chunked_loss=c.chunked_loss is not False, loss_chunk_tokens=c.loss_chunk_tokens)


def place_long_context(c: MegaTrainConfig, machine: Machine, run: Run, shape: Callable[[], ModelShape] | None,
                       notes: list) -> tuple[MegaTrainConfig, JointPlan]:
    """``max_seq_len``: ``c`` with its "auto" placement options set to the exact placement at that length
    (``memory/seq_placement.py``), and that placement; raises :class:`LongContextFitError` when none fits."""
    if shape is None:
        raise UsageError("megatrain: max_seq_len needs the model's shape to place its state and checkpoints, and "
                         "this entry point gave none. Fix: attach the model (megatrain_hf.attach, the Trainer "
                         "plugin), or megatrain estimate --max-seq-len N for a shape.")
    fixed, (gpu, host, disk), kw = _fixed(c, machine, run)
    joint = seq_placement.place(shape(), c.max_seq_len, gpu, host, disk, fixed, **kw)
    chosen = {"offload_checkpoints": joint.ckpt.options()["offload_checkpoints"],
              "checkpoint_interval": joint.ckpt.interval}
    if fixed.compute_dtype == "bf16":  # (fp32 compute has no staging copy)
        chosen["host_staging"] = joint.state.host_staging
    filled = {k: v for k, v in chosen.items() if getattr(c, k) == _CHOSEN[k]}
    if c.offload_dir is not None and c.offload_state == "auto" and joint.state.on_disk != "none":
        filled["offload_state"] = joint.state.on_disk
    gib = host_memory.gib
    notes.append(("max_seq_len placement", f"{c.max_seq_len} tokens: {joint.placement()}; GPU {gib(sum(joint.gpu.values()))}"
                  f" GiB, host {gib(sum(joint.host.values()))} GiB, disk {gib(sum(joint.disk.values()))} GiB; set "
                  + (", ".join(f"{k}={v!r}" for k, v in filled.items()) or "nothing (every option was given)")))
    return replace(c, **filled), joint


def check_length(plan: TrainingPlan, seq_len: int, longest_before: int = 0) -> None:
    """:meth:`TrainingPlan.check_length`."""
    c, joint = plan.config, plan.long_context
    if joint is None or seq_len <= c.max_seq_len:
        return
    fixed, (gpu, host, disk), kw = _fixed(c, plan.machine, plan.run)
    fixed = replace(fixed, host_staging=joint.state.host_staging, offload_state=joint.state.on_disk)  # as attached
    if seq_placement.holds(joint.shape, seq_len, gpu, host, disk, fixed, **kw) is not None:
        if longest_before <= c.max_seq_len:  # the first sequence beyond it
            logger.warning("megatrain: a training sequence of %d tokens is longer than max_seq_len=%d; the placement "
                           "planned for %d still fits it (%s). Set max_seq_len to the longest sequence of the data "
                           "to plan for it.", seq_len, c.max_seq_len, c.max_seq_len, joint.placement())
        return
    raise LongContextFitError(
        f"megatrain: a training sequence of {seq_len} tokens is longer than MegaTrainConfig(max_seq_len="
        f"{c.max_seq_len}), and the placement planned for {c.max_seq_len} ({joint.placement()}) does not fit "
        f"{seq_len} tokens on this machine; refused before its forward allocates. Fix: max_seq_len={seq_len} (or "
        f"the longest sequence of the data: the placement is planned for it at attach), or truncate the sequences "
        f"to {c.max_seq_len} tokens (the tokenizer's max_length, or the collator).")


def unit_device_bytes(size: UnitSizes, compute: torch.dtype) -> int:
    """Device bytes of one resident unit: fp32 master, gradient and two moments (16 B per trainable element),
    the compute-dtype copy of its streamed matrices, its frozen flats."""
    copy = size.n_staged * (torch.finfo(compute).bits // 8) if compute != torch.float32 else 0
    frozen = sum(n * torch.empty((), dtype=dtype).element_size() for dtype, n in size.frozen.items())
    return 16 * size.n_train + copy + frozen


def residency(c: MegaTrainConfig, machine: Machine, run: Run, compute: torch.dtype, units: list[UnitSizes] | None,
               notes: list[tuple[str, str]]) -> ResidencyPlan:
    """Which units stay whole on the device: ``resident_units``' count, or under ``"auto"`` the first units in
    forward order while their :func:`unit_device_bytes` fit the GPU budget (``max_gpu_memory``, else the CUDA
    device's memory) less the streamed step's working set (``run.gpu_working_set``, when known)."""
    budget = c.gpu_memory_bytes()
    if budget is None and machine.device.type == "cuda" and torch.cuda.is_available():
        budget = torch.cuda.get_device_properties(machine.device).total_memory
    room = None if budget is None else max(0, budget - (run.gpu_working_set or 0))
    costs = [unit_device_bytes(size, compute) for size in units] if units is not None else None
    fit = None
    if room is not None and costs is not None:
        fit, used = 0, 0
        while fit < len(costs) and used + costs[fit] <= room:
            used += costs[fit]
            fit += 1
    if c.resident_units == "auto":
        placed = 0
        if machine.device.type == "cuda":
            notes.append(("resident auto", f"{fit} of {len(costs)} unit(s) fit {room / 2**30:.2f} GiB; 0 placed"
                          if fit is not None else "no GPU budget known"))
    else:
        placed = c.resident_units if costs is None else min(c.resident_units, len(costs))
        if placed < c.resident_units:
            notes.append(("resident clamped", f"{c.resident_units} asked, {placed} units"))
    return ResidencyPlan(frozenset(range(placed)), fit, room, sum(costs[:placed]) if costs is not None else 0)

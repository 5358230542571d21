"""The two host kernels of a unit's AdamW update, over one snapshot of a param group.

* :func:`torch_update`: torch's ``_fused_adamw_`` (the kernel of ``AdamW(fused=True)``, Trainer's
  default ``adamw_torch_fused``), after ``clip_grad_norm_``'s in-place multiply when clipping:
  bitwise equal to plain training. The caller refreshes the staging copy afterwards.
* :func:`native_update`: ``csrc/host_adamw.cpp`` (see ``native.py``), which does the clip multiply,
  AdamW and the compute-dtype staging copy in one pass over memory, with torch's arithmetic op for
  op; the gradients are left as they are.

Both read the moments through the entry states of ``moment_store.py`` (no branch on the format):
with fp32 moments :func:`torch_update` runs on views of the flats; with compressed ones
(``optimizer_state`` other than fp32) ``fp32(k)`` expands each tensor's moments to an fp32 copy and
``write_back`` compresses them again, m toward zero where the gradient is zero (a tensor-sized fp32
copy at a time). :func:`native_update` hands the group to its layout (``layout.native``): the fp32 flats, or the codes and scales that the
C++ expands, updates and compresses block by block in the same single pass (no fp32 copy).

:class:`TorchKernel` and :class:`NativeKernel` are the two as the per-unit update calls them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..core.layout import Entry


@dataclass
class GroupWork:
    """One param group's share of a unit's update, snapshotted when ``step()`` was called."""

    entries: list[Entry]
    steps: list[torch.Tensor]  # per-parameter step counters (a parameter without a gradient keeps its count)
    params: list[torch.Tensor]
    grads: list[torch.Tensor]  # the gradient tensors themselves: zero_grad() may drop .grad meanwhile
    lr: float | torch.Tensor
    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    maximize: bool
    clip: torch.Tensor | None  # clip_grad_norm_'s coefficient (< 1), or None
    layout: object = None  # the moments' layout (moment_store.Fp32Layout or compressed.CompressedLayout)
    states: list = field(default_factory=list)  # each parameter's moments, bound while the update runs

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


@dataclass
class UnitJob:
    """A step's update of one unit: the snapshot of each param group with a gradient."""

    unit: int
    work: list[GroupWork]

    @property
    def numel(self) -> int:
        return sum(w.numel for w in self.work)


def torch_update(w: GroupWork) -> None:
    exp_avgs = [s.fp32(0).view(p.shape) for s, p in zip(w.states, w.params)]
    exp_avg_sqs = [s.fp32(1).view(p.shape) for s, p in zip(w.states, w.params)]
    torch._foreach_add_(w.steps, 1)
    # bf16 gradients (grad_dtype="bf16") are widened first (exact): an fp32 copy of the group
    grads = [g if g.dtype == torch.float32 else g.float() for g in w.grads]
    if w.clip is not None:
        torch._foreach_mul_(grads, w.clip.to(grads[0].device))  # exactly clip_grad_norm_'s multiply
    torch._fused_adamw_(
        w.params, grads, exp_avgs, exp_avg_sqs, [], w.steps, amsgrad=False, lr=w.lr, beta1=w.beta1,
        beta2=w.beta2, weight_decay=w.weight_decay, eps=w.eps, maximize=w.maximize, grad_scale=None,
        found_inf=None,
    )
    for s, m, v, g in zip(w.states, exp_avgs, exp_avg_sqs, grads):
        s.write_back(m, v, g)


def native_update(lib, w: GroupWork, stages: list[torch.Tensor | None]) -> None:
    """``stages``: each parameter's slice of the staging copy to write (None: none)."""
    from . import native

    torch._foreach_add_(w.steps, 1)
    lr = float(w.lr)
    scalars: dict[str, list[float]] = {k: [] for k in native._HYPER}
    for step in w.steps:
        n = float(step)
        scalars["decay"].append(1 - lr * w.weight_decay if w.weight_decay != 0 else 1.0)
        scalars["lerp"].append(1 - w.beta1)
        scalars["beta2"].append(w.beta2)
        scalars["sq_coef"].append(1 - w.beta2)
        scalars["bc2_sqrt"].append(math.sqrt(1 - w.beta2**n))
        scalars["eps"].append(w.eps)
        scalars["neg_step_size"].append(-(lr / (1 - w.beta1**n)))
    clip = float(w.clip) if w.clip is not None else 1.0
    w.layout.native(lib, w, stages, scalars, clip, torch.get_num_threads())


class TorchKernel:
    """torch's fused AdamW; the staging copy is refreshed after it (``writes_staging`` False)."""

    name = "torch"
    writes_staging = False

    def run(self, job: UnitJob, staging) -> None:
        for w in job.work:
            torch_update(w)


class NativeKernel:
    """``csrc/host_adamw.cpp``: writes the staging copy of what it updates in the same pass."""

    name = "native"
    writes_staging = True

    def __init__(self, lib) -> None:
        self.lib = lib

    def run(self, job: UnitJob, staging) -> None:
        for w in job.work:
            native_update(self.lib, w, [staging.slice(e) for e in w.entries])


def kernel_of(name: str):
    """The kernel ``name`` ("torch" or "native"); the torch one where the native cannot be built here."""
    if name == "native":
        from . import native

        lib = native.host_adamw()  # None (warned) if it cannot be built here
        if lib is not None:
            return NativeKernel(lib)
    return TorchKernel()

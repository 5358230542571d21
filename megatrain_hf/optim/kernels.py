"""The two host kernels of a unit's AdamW update, over one snapshot of a param group.

* :func:`torch_update`: torch's ``_fused_adamw_`` (the kernel of ``AdamW(fused=True)``, Trainer's
  default ``adamw_torch_fused``), after ``clip_grad_norm_``'s in-place multiply when clipping:
  bitwise equal to plain training. The caller refreshes the staging copy afterwards.
* :func:`native_update`: ``csrc/host_adamw.cpp`` (see ``native.py``), which does the clip multiply,
  AdamW and the compute-dtype staging copy in one pass over memory, with torch's arithmetic op for
  op; the gradients are left as they are.

With compressed moments (``optimizer_state`` other than fp32, ``quant.py``): :func:`torch_update`
expands each tensor's moments to fp32, runs the same fused kernel and compresses them again (a
tensor-sized fp32 copy at a time); :func:`native_update` passes the codes and scales to the C++,
which expands, updates and compresses block by block in the same single pass (no fp32 copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.layout import Entry


@dataclass
class GroupWork:
    """One param group's share of a unit's update, snapshotted when ``step()`` was called."""

    entries: list[Entry]
    steps: list[torch.Tensor]  # per-parameter step counters (a parameter without a gradient keeps its count)
    params: list[torch.Tensor]
    grads: list[torch.Tensor]  # the gradient tensors themselves: zero_grad() may drop .grad meanwhile
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    lr: float | torch.Tensor
    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    maximize: bool
    clip: torch.Tensor | None  # clip_grad_norm_'s coefficient (< 1), or None
    compressed: list | None = None  # compressed moments: each parameter's EntryState (exp_avgs unused)
    fmt: object = None  # their quant.Format

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
    exp_avgs, exp_avg_sqs = w.exp_avgs, w.exp_avg_sqs
    if w.compressed is not None:
        exp_avgs = [s.expand(w.fmt, 0).view(p.shape) for s, p in zip(w.compressed, w.params)]
        exp_avg_sqs = [s.expand(w.fmt, 1).view(p.shape) for s, p in zip(w.compressed, w.params)]
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
    if w.compressed is not None:
        for s, m, v, g in zip(w.compressed, exp_avgs, exp_avg_sqs, grads):
            s.assign(w.fmt, 0, m, g == 0)  # no gradient: m rounds toward zero (moment_formats.py)
            s.assign(w.fmt, 1, v)


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
    threads = torch.get_num_threads()
    if w.compressed is not None:
        codes = tuple([s.codes[k] for s in w.compressed] for k in (0, 1))
        scales = tuple([s.scales[k] for s in w.compressed] for k in (0, 1))
        native.adamw_compressed(lib, w.params, w.grads, codes, scales, stages, scalars, w.fmt, clip,
                                bool(w.maximize), threads)
        return
    native.adamw(lib, w.params, w.grads, w.exp_avgs, w.exp_avg_sqs, stages, scalars, clip, bool(w.maximize), threads)

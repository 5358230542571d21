"""Gradients computed straight into their host accumulators, on the CPU path.

When the compute device is the host, autograd's weight gradient is a temporary of the weight's size
that the gradient sink then copies into the accumulator (``core/grads.py``): for an embedding table or
the head's weight (vocab x hidden x 4 B each, 164 MB at 32000 x 1280) a transient of that size above
everything the plan keeps. Where a tensor's gradient is the step's first contribution (its ``.grad``
is None, so the accumulator region holds nothing to keep), the computation writes into the region
itself:

* the chunked loss (``models/chunked_loss.py``) sums the head's chunk gradients into the region: the
  first copied, the next added, the arithmetic of its own fp32 sum (a bf16 chunk gradient is
  converted exactly by the copy, without an fp32 copy of it next to it);
* an ``nn.Embedding``'s weight gradient is zeroed and then summed into the region row by row with
  ``index_add_``, in token order: what ``embedding_dense_backward`` computes on the CPU (zeros, then
  one add per token into its row, in token order), without its temporary.

The region is handed to the sink as the gradient; the sink sees the accumulator itself and copies
nothing (``GradAccumulators.accumulate``). Only on the CPU path (no streams), not for a resident unit
(``core/resident.py``: its gradients take the device path on every device), without data parallelism,
outside a layer-major group, for tensors the unit owns, without tensor hooks, whose accumulator is in
the dtype the gradient is computed in; everything else takes autograd's temporary as before.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from ..core.grads import GradSink, has_tensor_hooks
from ..core.layout import Entry


def landing_regions(grads: GradSink, u: int, trained: list[Entry]) -> dict[str, torch.Tensor]:
    """{entry name: its accumulator region, shaped like the tensor} for the trained entries of unit
    ``u`` whose gradient may be computed in place now (see module docstring); empty off the CPU path."""
    store = grads.store
    if not grads.landing.in_place or not store.ownership.lands_in_place or grads.in_group:
        return {}
    regions, resident = {}, store.resident
    for e in trained:
        if e.owner != u or e.tensor.grad is not None or has_tensor_hooks(e.tensor):
            continue
        if resident is not None and resident.holds(e):  # accumulated on the device (core/resident.py)
            continue
        region = store.accumulators.region(e)
        if region.device.type == "cpu" and region.dtype == torch.float32:
            regions[e.name] = region.view(e.shape)
    return regions


def embedding_weights(module: nn.Module) -> frozenset[str]:
    """Names (relative to ``module``) of the weights of its ``nn.Embedding`` sub-modules."""
    return frozenset(f"{prefix}.weight" if prefix else "weight"
                     for prefix, m in module.named_modules() if isinstance(m, nn.Embedding))


def embeddings_into(leaves: dict[str, torch.Tensor], regions: dict[str, torch.Tensor]):
    """Context for a recompute: ``F.embedding`` calls on one of ``leaves`` (by name) whose name has a
    region compute their weight gradient into it. A no-op context when none has."""
    targets = {id(leaves[name]): (leaves[name], region) for name, region in regions.items() if name in leaves}
    return _EmbeddingLanding(targets) if targets else contextlib.nullcontext()


class _EmbeddingLanding(TorchFunctionMode):
    def __init__(self, targets: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.targets = targets

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            call = _embedding_args(*args, **kwargs)
            target = self.targets.get(id(call["weight"]))
            if (target is not None and target[0] is call["weight"] and call["max_norm"] is None
                    and not call["scale_grad_by_freq"] and not call["sparse"]):
                weight = call["weight"]
                pad = call["padding_idx"]
                if pad is not None and pad < 0:  # as F.embedding normalizes it
                    pad += weight.shape[0]
                return _EmbeddingInto.apply(call["input"], weight, target[1], -1 if pad is None else pad)
        return func(*args, **kwargs)


def _embedding_args(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                    sparse=False) -> dict:
    return {"input": input, "weight": weight, "padding_idx": padding_idx, "max_norm": max_norm,
            "scale_grad_by_freq": scale_grad_by_freq, "sparse": sparse}


class _EmbeddingInto(torch.autograd.Function):
    """``F.embedding(input, weight, padding_idx)`` whose weight gradient is summed into ``region``."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, region: torch.Tensor, pad: int) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.region, ctx.pad, ctx.num_weights = region, pad, weight.shape[0]
        return F.embedding(ids, weight, None if pad < 0 else pad)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        region, pad = ctx.region, ctx.pad
        if grad_out.dtype != region.dtype or grad_out.device != region.device:  # autograd's own, unchanged
            grad = torch.ops.aten.embedding_backward(grad_out, ids, ctx.num_weights, pad, False, False)
            return None, grad, None, None
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        index = ids.reshape(-1)
        if pad >= 0:  # the padding row gets no gradient, as in embedding_dense_backward
            keep = index != pad
            rows, index = rows[keep], index[keep]
        region.zero_()
        region.index_add_(0, index, rows)  # one add per token into its row, in token order
        return None, region, None, None

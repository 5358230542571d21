"""Where a unit's gradients land on the host: its accumulators (composed into ``HostStore``).

Each unit with trainable parameters owns an accumulator laid out like its master flat. With
``grad_dtype=torch.float32`` (the default) it is one fp32 flat, ``grad_host``. With
``torch.bfloat16`` (``MegaTrainConfig(grad_dtype="bf16")``) the part of the bf16-streamed matrices,
``[0, n_staged)``, is a bf16 flat of its own (``grad_low``) and ``grad_host`` holds the rest
(``[n_staged, n_train)``: norms, biases, embeddings, LoRA matrices, in fp32). That is exact when
each of those weights receives one bf16 gradient per optimizer step -- the device computes it in
bf16, and an fp32 accumulator would hold the same values -- so a second contribution in a step, or
an fp32 gradient, raises instead of rounding. The last unit (the head) keeps fp32 accumulators: the
chunked loss sums its weight gradient over chunks in fp32.

A resident unit's gradients (``resident_units``) accumulate on the compute device instead
(``resident.py``); its host accumulator here is not used.

``param.grad`` is a view of the accumulator (torch's ``Tensor.grad_dtype`` lets a bf16 view be the
gradient of an fp32 parameter); ``zero_grad(set_to_none=True)`` drops the view and the next
gradient starts the region afresh.
"""

from __future__ import annotations

import torch

from ..errors import UsageError
from .layout import Entry

BF16_FIX = "Fix: MegaTrainConfig(grad_dtype='fp32') (the default), which accumulates any gradient exactly."


def low_precision_units(n_units: int, grad_dtype: torch.dtype) -> frozenset[int]:
    """The units whose bf16-streamed part gets a ``grad_dtype`` accumulator (all but the head)."""
    return frozenset(range(n_units - 1)) if grad_dtype != torch.float32 else frozenset()


def grad_bytes(n_train: int, n_staged: int, low: bool) -> int:
    """Host bytes of one unit's accumulators (``low``: its staged part in bf16)."""
    return 2 * n_staged + 4 * (n_train - n_staged) if low else 4 * n_train


class GradAccumulators:
    """Each unit's gradient accumulators (``grad_host``, ``grad_low`` of the store's per-unit buffers):
    allocation, ``param.grad`` as views of them, the dtype rule. Composed into ``HostStore``."""

    def __init__(self, store, grad_dtype: torch.dtype) -> None:
        self.store = store
        self.grad_dtype = grad_dtype
        self.low_units = low_precision_units(len(store.entries), grad_dtype)

    def allocate(self, u: int, bufs, n_train: int, n_staged: int) -> None:
        low = u in self.low_units and n_staged > 0
        if low:
            bufs.grad_low = self.store.allocate(n_staged, self.grad_dtype)
            bufs.grad_low.zero_()
        bufs.grad_host = self.store.allocate(n_train - (n_staged if low else 0), torch.float32)
        bufs.grad_host.zero_()

    def low_entries(self) -> list[Entry]:
        return [e for u in self.low_units for e in self.store.owned_trainable(u) if self.is_low(e)]

    def mark_dtypes(self) -> None:
        """Let the bf16 accumulators' views be the gradients of their fp32 parameters."""
        for e in self.low_entries():
            e.tensor.grad_dtype = self.grad_dtype

    def restore_dtypes(self) -> None:
        """Detach: the parameters' gradients are fp32 again (a bf16 one is converted), as plain torch's."""
        for e in self.low_entries():
            grad, e.tensor.grad = e.tensor.grad, None
            e.tensor.grad_dtype = e.tensor.dtype
            if grad is not None:
                e.tensor.grad = grad.float()

    def is_low(self, e: Entry) -> bool:
        """Whether ``e``'s accumulator is the low-precision (bf16) one."""
        bufs = self.store.buffers[e.owner]
        return bufs.grad_low is not None and e.offset < bufs.n_staged

    def region(self, e: Entry) -> torch.Tensor:
        """Entry ``e``'s slice of its owner's gradient accumulator (flat; bf16 where :meth:`is_low`)."""
        bufs = self.store.buffers[e.owner]
        if bufs.grad_low is None:
            return bufs.grad_host[e.offset : e.offset + e.numel]
        if e.offset < bufs.n_staged:
            return bufs.grad_low[e.offset : e.offset + e.numel]
        start = e.offset - bufs.n_staged
        return bufs.grad_host[start : start + e.numel]

    def holds(self, e: Entry) -> bool:
        """Whether ``e``'s ``.grad`` is its accumulator region (not None, not a tensor the user set)."""
        grad = e.tensor.grad
        return grad is not None and grad.data_ptr() == self.region(e).data_ptr()

    def check_single(self, e: Entry, grad: torch.Tensor, name: str) -> None:
        """Raise unless ``grad`` may land in ``e``'s bf16 accumulator exactly (its one bf16 gradient)."""
        if grad.dtype != self.grad_dtype:
            raise UsageError(
                f"megatrain: the gradient of {name} arrived in {grad.dtype}, but its accumulator is "
                f"{self.grad_dtype} (grad_dtype='bf16' holds the one bf16 gradient a bf16 weight gets per step; "
                f"rounding this one would change the result). {BF16_FIX}")
        if e.tensor.grad is not None:
            raise UsageError(
                f"megatrain: {name} received a second gradient in one optimizer step (gradient accumulation, "
                "a module called twice in one forward, or a zero_grad(set_to_none=False) that kept the last "
                "step's), which a bf16 accumulator cannot add exactly. " + BF16_FIX)

    def accumulate(self, entry: Entry, grad: torch.Tensor, name: str = "a weight") -> None:
        """Add ``grad`` (any device/dtype) into the host accumulator of ``entry``.

        The parameter's ``.grad`` is a view of the accumulator; ``zero_grad(set_to_none=True)``
        drops that view, and the next accumulation starts the region afresh.
        """
        param = entry.tensor
        region = self.region(entry)
        if region.dtype != torch.float32:
            self.check_single(entry, grad, name)
        grad_host = grad.detach().reshape(-1)
        if grad_host.device != region.device:
            grad_host = grad_host.to(region.device)
        # copy_/add_ convert a bf16 gradient to fp32 on the fly (no temporary fp32 copy)
        if param.grad is None:
            if not _is_region(grad_host, region):  # else computed in the accumulator (runtime/grads_in_place.py)
                region.copy_(grad_host)
            param.grad = region.view(entry.shape)
        elif param.grad.data_ptr() == region.data_ptr():
            region.add_(grad_host)
        else:  # the user replaced .grad with a tensor of their own
            param.grad.add_(grad.detach().to(param.grad.device, param.grad.dtype).view(entry.shape))


def _is_region(grad: torch.Tensor, region: torch.Tensor) -> bool:
    """Whether ``grad`` is the accumulator region itself (nothing to copy)."""
    return (grad.data_ptr() == region.data_ptr() and grad.dtype == region.dtype and grad.numel() == region.numel()
            and grad.device == region.device)

"""Activation checkpoints kept in pinned host memory between forward and backward.

Each streamed call saves its input (the activation checkpoint the unit is recomputed from). With
``MegaTrainConfig(offload_checkpoints=True)`` that input goes down to a pinned host buffer on a
stream of its own while the next unit computes, and comes back ahead of its backward: when
call ``c`` runs its backward, the checkpoint of the call before it in the same micro-batch (the
next one autograd needs from that micro-batch) starts its upload. GPU memory then no longer grows
with depth or with the micro-batches in flight; host RAM pays for the checkpoints instead.

The copies are exact (same dtype both ways); with ``checkpoint_dtype="bf16"`` the input is rounded
to bf16 on the compute stream first and comes back widened to its dtype (half the bytes, not exact). One stream carries both directions, so a host
buffer handed back to the pool (when its checkpoint object goes, after the backward) is never
overwritten by a later download before the upload from it has run. Buffers are reused across
steps, best fit by size, so that batches padded to different lengths share them; the pool grows
only when more checkpoints are alive than ever before (after checking the RAM, and after
unpinning free buffers too small to serve). The compute stream runs at most ``MAX_PENDING``
copies ahead of the downloads: the inputs waiting for their copy would otherwise pile up on the
GPU when the link is slower than a layer's compute. An input changed in place before its copy
ran is refused, as ``save_for_backward`` refuses it.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from collections import deque
from typing import Callable

import torch

from ..errors import HostMemoryError, UsageError

logger = logging.getLogger(__name__)

MAX_PENDING = 4  # downloads the compute stream may run ahead of


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"


class Checkpoint:
    """One call's saved input while it lives on the host."""

    __slots__ = ("host", "shape", "dtype", "requires_grad", "prev", "owner", "device_copy", "__weakref__")

    def __init__(self, host: torch.Tensor, x: torch.Tensor, prev: "Checkpoint | None", owner=None) -> None:
        self.host: torch.Tensor | None = host  # in x's dtype, or in checkpoint_dtype (bf16: rounded)
        self.shape, self.dtype, self.requires_grad = x.shape, x.dtype, x.requires_grad
        self.prev = prev  # the checkpoint saved before this one in the same micro-batch (any home)
        self.owner = owner  # the pool that holds it: ``owner.prefetch(ckpt)`` starts bringing it back
        self.device_copy: tuple[torch.Tensor, torch.cuda.Event | None] | None = None


def stored_form(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """What a home keeps of the input ``x``: ``x`` itself, or rounded to ``dtype`` (``checkpoint_dtype``;
    floating inputs of a wider dtype only)."""
    x = x.detach()
    if dtype is None or not x.is_floating_point() or x.dtype.itemsize <= dtype.itemsize:
        return x
    return x.to(dtype)


def restored(x: torch.Tensor, ckpt) -> torch.Tensor:
    """A checkpoint back in its input's dtype, with its ``requires_grad``."""
    if x.dtype != ckpt.dtype:
        x = x.to(ckpt.dtype)
    return x.requires_grad_(ckpt.requires_grad) if x.is_floating_point() else x


class CheckpointOffload:
    """A pool of pinned host buffers and the stream that moves checkpoints through them."""

    def __init__(self, allocate: Callable[[int, torch.dtype], torch.Tensor], free: Callable[[torch.Tensor], None],
                 available_bytes: Callable[[], int], headroom_bytes: int, stats, streams=None,
                 dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype  # checkpoint_dtype (None: each input's own)
        self.stats = stats  # the engine's: checkpoint bytes count as link traffic
        self.streams = streams  # CudaStreams / EmulatedStreams, or None: copies on the CPU, in place
        self.stream = streams.new_stream() if streams is not None else None
        self._allocate, self._free_flat = allocate, free
        self._available_bytes = available_bytes
        self._headroom = headroom_bytes
        self._free: dict[torch.dtype, list[tuple[int, int, torch.Tensor]]] = {}  # sorted by size
        self._pending: deque = deque()  # (copied event, input, its version) of downloads in flight
        self.pool_bytes = 0  # host bytes the pool holds (in use or free)
        self.in_use_bytes = 0  # ... held by live checkpoints
        self.peak_in_use_bytes = 0  # the most held at once (the engine reads it after a one-at-a-time step)

    # ------------------------------------------------------------------ pool
    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.setdefault(dtype, [])
        i = bisect.bisect_left(free, (numel, -1))  # the smallest free buffer that is large enough
        if i < len(free):
            return free.pop(i)[2]
        size = dtype.itemsize
        nbytes = numel * size
        if self._available_bytes() - self._headroom < nbytes:
            for _, _, small in free:  # too small for this shape: unpin them and try again
                self._free_flat(small)
                self.pool_bytes -= small.numel() * size
            free.clear()
        available = self._available_bytes()
        if available - self._headroom < nbytes:
            raise HostMemoryError(
                f"megatrain: offloading activation checkpoints needs {_size(nbytes)} more host RAM (the pool "
                f"holds {_size(self.pool_bytes)}; {_size(available)} available, {_size(self._headroom)} kept "
                "free). Fix: fewer micro-batches in flight (a smaller gradient_accumulation_steps, or "
                "max_gpu_memory so that groups are smaller), a shorter sequence or micro-batch, "
                "host_staging=False (2 B/param of host RAM back), or MegaTrainConfig(offload_checkpoints=False)."
            )
        self.pool_bytes += nbytes
        return self._allocate(numel, dtype)

    def _give_back(self, host: torch.Tensor, nbytes: int) -> None:
        bisect.insort(self._free.setdefault(host.dtype, []), (host.numel(), id(host), host))
        self.in_use_bytes -= nbytes

    def _retire(self, force: int = 0) -> None:
        """Forget downloads that ended (the first ``force`` ones: make the compute stream wait for them),
        checking that no input changed in place while its copy was pending."""
        compute = self.streams.current()
        while self._pending and (force > 0 or self._pending[0][0].query()):
            copied, x, version = self._pending.popleft()
            if force > 0:
                compute.wait_event(copied)
                force -= 1
            if x._version != version:
                raise UsageError(
                    "megatrain: a layer's input was modified in place after the layer used it, before its "
                    "activation checkpoint was copied to the host (offload_checkpoints=True); autograd would "
                    "refuse the same with save_for_backward. Do not modify hidden states in place."
                )

    # ------------------------------------------------------------------ checkpoints
    def save(self, x: torch.Tensor, prev: Checkpoint | None) -> Checkpoint:
        """Start copying ``x`` to a pooled host buffer; ``x`` may be freed right after."""
        stored = stored_form(x, self.dtype)
        buffer = self._take(stored.numel(), stored.dtype)
        host = buffer[: x.numel()]
        streams = self.streams
        if streams is not None:
            self._retire(force=max(0, len(self._pending) + 1 - MAX_PENDING))
            self.stream.wait_stream(streams.current())  # x is written on the compute stream
            with streams.on(self.stream):
                host.copy_(stored.reshape(-1), non_blocking=True)
                copied = streams.record(self.stream)
            streams.keep_alive(stored, self.stream)  # the allocator must not reuse x before the copy read it
            self._pending.append((copied, x, x._version))
        else:
            host.copy_(stored.reshape(-1))
        nbytes = host.numel() * host.element_size()
        self.stats.d2h_bytes += nbytes
        self.in_use_bytes += nbytes
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        ckpt = Checkpoint(host, x, prev, self)
        # a checkpoint dropped without a backward (a failed step, a graph freed unused) still
        # returns its buffer: a later download on the same stream waits for the pending one
        weakref.finalize(ckpt, self._give_back, buffer, nbytes)
        return ckpt

    def prefetch(self, ckpt: Checkpoint | None) -> None:
        """Start bringing ``ckpt`` back to the device (no-op if already started or loaded)."""
        if ckpt is None or ckpt.host is None or ckpt.device_copy is not None:
            return
        streams = self.streams
        if streams is not None:
            with streams.on(self.stream):
                dev = streams.empty(ckpt.shape, ckpt.host.dtype)
                dev.view(-1).copy_(ckpt.host, non_blocking=True)
                ready = streams.record(self.stream)
            ckpt.device_copy = (dev, ready)
        else:
            ckpt.device_copy = (ckpt.host.view(ckpt.shape).clone(), None)
        self.stats.h2d_bytes += ckpt.host.numel() * ckpt.host.element_size()

    def load(self, ckpt: Checkpoint) -> torch.Tensor:
        """The checkpoint on the device, usable on the current stream; its host buffer is released."""
        if ckpt.host is None:
            raise UsageError(
                "megatrain: an offloaded activation checkpoint was used by a second backward over the same "
                "graph (retain_graph=True, or torch.autograd.grad before backward); offload_checkpoints "
                "supports one backward per forward"
            )
        if self.streams is not None:
            self._retire()
        self.prefetch(ckpt)
        dev, ready = ckpt.device_copy
        if ready is not None:
            compute = self.streams.current()
            compute.wait_event(ready)
            self.streams.keep_alive(dev, compute)  # allocated on the offload stream, used and freed on compute
        ckpt.device_copy = None
        ckpt.host = None  # the finalizer returns the buffer once the checkpoint object goes
        return restored(dev, ckpt)

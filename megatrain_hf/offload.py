"""Activation checkpoints kept in pinned host memory between forward and backward.

Each streamed call saves its input (the activation checkpoint the unit is recomputed from). With
``MegaTrainConfig(offload_checkpoints=True)`` that input goes down to a pinned host buffer on a
stream of its own while the next unit computes, and comes back ahead of its backward: when
call ``c`` runs its backward, the checkpoint of the call before it in the same micro-batch (the
next one autograd needs from that micro-batch) starts its upload. GPU memory then no longer grows
with depth or with the micro-batches in flight; host RAM pays for the checkpoints instead.

The copies are exact (same dtype both ways). One stream carries both directions, so a host
buffer handed back to the pool after its upload is never overwritten by a later download before
that upload has read it. Buffers are reused across steps (a pool by size); the pool grows only
when a step keeps more checkpoints alive than any step before, and then checks the RAM first.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from typing import Callable

import torch

logger = logging.getLogger(__name__)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"


class Checkpoint:
    """One call's saved input while it lives on the host."""

    __slots__ = ("host", "shape", "dtype", "requires_grad", "prev", "device_copy", "__weakref__")

    def __init__(self, host: torch.Tensor, x: torch.Tensor, prev: "Checkpoint | None") -> None:
        self.host: torch.Tensor | None = host
        self.shape, self.dtype, self.requires_grad = x.shape, x.dtype, x.requires_grad
        self.prev = prev  # the checkpoint saved before this one in the same micro-batch
        self.device_copy: tuple[torch.Tensor, torch.cuda.Event | None] | None = None


class CheckpointOffload:
    """A pool of pinned host buffers and the stream that moves checkpoints through them."""

    def __init__(self, device: torch.device, allocate: Callable[[int, torch.dtype], torch.Tensor],
                 available_bytes: Callable[[], int], headroom_bytes: int, stats) -> None:
        self.device = device
        self.stats = stats  # the engine's: checkpoint bytes count as link traffic
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._allocate = allocate
        self._available_bytes = available_bytes
        self._headroom = headroom_bytes
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self.pool_bytes = 0  # host bytes the pool holds (in use or free)

    # ------------------------------------------------------------------ pool
    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free[(numel, dtype)]
        if free:
            return free.pop()
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        available = self._available_bytes()
        if available - self._headroom < nbytes:
            raise MemoryError(
                f"megatrain: offloading activation checkpoints needs {_size(nbytes)} more host RAM (the pool "
                f"holds {_size(self.pool_bytes)}; {_size(available)} available, {_size(self._headroom)} kept "
                "free). Fix: fewer micro-batches in flight (a smaller gradient_accumulation_steps, or "
                "max_gpu_memory so that groups are smaller), a shorter sequence or micro-batch, "
                "host_staging=False (2 B/param of host RAM back), or MegaTrainConfig(offload_checkpoints=False)."
            )
        self.pool_bytes += nbytes
        return self._allocate(numel, dtype)

    def _give_back(self, host: torch.Tensor) -> None:
        self._free[(host.numel(), host.dtype)].append(host)

    # ------------------------------------------------------------------ checkpoints
    def save(self, x: torch.Tensor, prev: Checkpoint | None) -> Checkpoint:
        """Start copying ``x`` to a pooled host buffer; ``x`` may be freed right after."""
        host = self._take(x.numel(), x.dtype)
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(compute)  # x is written on the compute stream
            with torch.cuda.stream(self.stream):
                host.copy_(x.detach().reshape(-1), non_blocking=True)
            x.record_stream(self.stream)  # the allocator must not reuse x before the copy read it
        else:
            host.copy_(x.detach().reshape(-1))
        self.stats.d2h_bytes += host.numel() * host.element_size()
        ckpt = Checkpoint(host, x, prev)
        # a checkpoint dropped without a backward (a failed step, a graph freed unused) still
        # returns its buffer: a later download on the same stream waits for the pending one
        weakref.finalize(ckpt, self._give_back, host)
        return ckpt

    def prefetch(self, ckpt: Checkpoint | None) -> None:
        """Start bringing ``ckpt`` back to the device (no-op if already started or loaded)."""
        if ckpt is None or ckpt.host is None or ckpt.device_copy is not None:
            return
        if self.cuda:
            with torch.cuda.stream(self.stream):
                dev = torch.empty(ckpt.shape, dtype=ckpt.dtype, device=self.device)
                dev.view(-1).copy_(ckpt.host, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.stream)
            ckpt.device_copy = (dev, ready)
        else:
            ckpt.device_copy = (ckpt.host.view(ckpt.shape).clone(), None)
        self.stats.h2d_bytes += ckpt.host.numel() * ckpt.host.element_size()

    def load(self, ckpt: Checkpoint) -> torch.Tensor:
        """The checkpoint on the device, usable on the current stream; its host buffer is released."""
        if ckpt.host is None:
            raise RuntimeError("megatrain: an offloaded activation checkpoint was loaded twice (backward ran twice "
                               "over the same graph; retain_graph=True is not supported with offload_checkpoints)")
        self.prefetch(ckpt)
        dev, ready = ckpt.device_copy
        if ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(ready)
            dev.record_stream(compute)  # allocated on the offload stream, used and freed on compute
        ckpt.device_copy = None
        ckpt.host = None  # the finalizer returns the buffer once the checkpoint object goes
        return dev.requires_grad_(ckpt.requires_grad) if dev.is_floating_point() else dev

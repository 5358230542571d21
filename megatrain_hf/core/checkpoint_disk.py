"""Activation checkpoints on the disk tier: a file under ``offload_dir`` between forward and backward.

With ``MegaTrainConfig(offload_checkpoints="disk")`` (or ``"auto"``/``True`` with ``offload_dir`` when the
host pool runs out of RAM: ``runtime/activation_inputs.py``'s ``HostHome`` spills there) a unit's
checkpoint goes to a host staging buffer -- on the offload stream, from the device, as the pinned pool
does -- and a writer thread puts it in this run's file (``core/disk_io.py``: ``O_DIRECT`` where the
filesystem takes it) while the next units compute. In the backward, when a call's checkpoint is loaded,
the one before it in the same micro-batch is read back ahead (prefetch one call ahead), so the read
overlaps the backward of the call in between.

One worker thread runs the writes and reads in the order they were asked, so a read never overtakes the
write of the same checkpoint, and a region of the file given back (its checkpoint object gone) is only
written again after every request before it. The host RAM the tier takes is ``STAGING_SLOTS`` staging
buffers of the largest checkpoint (the one being written, the one read ahead, the one being loaded),
whatever the depth; file regions are reused across steps (best fit by size). Bytes come back unchanged
(``checkpoint_dtype="bf16"``: rounded before the write, widened after the read, as the host pool does).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import logging
import os
import threading
import weakref
from collections import deque
from typing import Callable

import torch

from ..errors import DiskSpaceError, UsageError
from .activation_offload import Checkpoint, restored, stored_form
from .disk_io import ALIGN, DiskIO, align_up, aligned_empty, create_run_dir, remove_run_dir

logger = logging.getLogger(__name__)

STAGING_SLOTS = 3
"""Host staging buffers of the tier: one checkpoint being written, one read ahead, one being loaded."""

FILE_NAME = "unit-checkpoints.state"  # (``unit-*.state``: removed with the run directory if a run dies)

DISK_HEADROOM_BYTES = 1 << 30


def _cleanup(io: DiskIO, worker: concurrent.futures.Executor, run_dir: str) -> None:
    worker.shutdown(wait=True)
    io.shutdown()
    remove_run_dir(run_dir, [FILE_NAME])


class DiskCheckpoint(Checkpoint):
    """One call's saved input while it lives in the file: ``host`` is its file region ``(offset, nbytes)``."""

    __slots__ = ("stored", "read")

    def __init__(self, region: tuple[int, int], stored: torch.Tensor, x: torch.Tensor, prev, owner) -> None:
        super().__init__(region, x, prev, owner)
        self.stored = stored.dtype  # the dtype in the file
        self.read: concurrent.futures.Future | None = None  # the read back in flight: its staging buffer


class DiskCheckpoints:
    """The checkpoint file of one engine and the thread that moves checkpoints through it."""

    def __init__(self, offload_dir: str, stats, streams=None, pin: Callable[[int], torch.Tensor] | None = None,
                 dtype: torch.dtype | None = None, io: DiskIO | None = None) -> None:
        self.stats, self.streams, self.dtype = stats, streams, dtype
        self.stream = streams.new_stream() if streams is not None else None
        self._pin = pin  # nbytes -> a page-locked, ALIGN-aligned uint8 buffer (CUDA); None: aligned_empty
        self.run_dir = create_run_dir(offload_dir)
        self.io = io if io is not None else DiskIO(threads=4)
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-ckpt")
        self._finalizer = weakref.finalize(self, _cleanup, self.io, self._worker, self.run_dir)
        self.fd = self.io.create(os.path.join(self.run_dir, FILE_NAME), 0)
        self.file_bytes = 0
        self._regions: list[tuple[int, int]] = []  # free (nbytes, offset), sorted
        self._buffers: deque[torch.Tensor] = deque()  # free staging buffers
        self._uploads: deque = deque()  # (event, staging buffer) of uploads to the device in flight
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self.pool_bytes = 0  # host RAM of the staging buffers
        self.peak_in_use_bytes = 0  # host bytes held per checkpoint: none (the budget's host fit reads it)
        self.bytes_written = self.bytes_read = 0

    def close(self) -> None:
        """Wait for the requests in flight, then remove the run directory with the file (idempotent)."""
        if self._finalizer.alive:
            self._finalizer()

    # ------------------------------------------------------------------ staging buffers and file regions
    def _buffer(self, nbytes: int, wait: bool = True) -> torch.Tensor:
        """A free staging buffer of at least ``nbytes``. A write (``wait``) waits for one while
        ``STAGING_SLOTS`` are in use; a read ahead never waits (one per micro-batch in flight: a buffer
        comes back only when the compute thread loads its checkpoint)."""
        span = align_up(nbytes)
        if wait:  # (the compute thread: the only one that touches the uploads)
            self._retire_uploads(block=False)
        with self._freed:
            while wait and not self._buffers and self.pool_bytes >= STAGING_SLOTS * span:
                if self._uploads:
                    self._freed.release()
                    try:
                        self._retire_uploads(block=True)
                    finally:
                        self._freed.acquire()
                    continue
                self._freed.wait()
            if self._buffers and self._buffers[0].numel() >= span:
                return self._buffers.popleft()
            if self._buffers:  # too small for this checkpoint: replace it
                self.pool_bytes -= self._buffers.popleft().numel()
        buffer = self._pin(span) if self._pin is not None else aligned_empty(span)
        with self._lock:
            self.pool_bytes += buffer.numel()
        return buffer

    def _retire_uploads(self, block: bool) -> None:
        """Staging buffers whose upload to the device ran are free again (``block``: wait for the oldest)."""
        while self._uploads and (block or self._uploads[0][0].query()):
            event, buffer = self._uploads.popleft()
            event.synchronize()
            self._give_back_buffer(buffer)
            block = False

    def _give_back_buffer(self, buffer: torch.Tensor) -> None:
        with self._freed:
            self._buffers.append(buffer)
            self._freed.notify()

    def _region(self, nbytes: int) -> tuple[int, int]:
        span = align_up(nbytes)
        with self._lock:
            i = bisect.bisect_left(self._regions, (span, -1))
            if i < len(self._regions) and self._regions[i][0] == span:
                return self._regions.pop(i)
            offset, self.file_bytes = self.file_bytes, self.file_bytes + span
        free = os.statvfs(self.run_dir)
        if free.f_bavail * free.f_frsize < span + DISK_HEADROOM_BYTES:
            with self._lock:
                self.file_bytes -= span if self.file_bytes == offset + span else 0
            raise DiskSpaceError(
                f"megatrain: an activation checkpoint of {span / 2**30:.2f} GiB does not fit the disk tier "
                f"({self.run_dir}: {free.f_bavail * free.f_frsize / 2**30:.2f} GiB free, the checkpoint file holds "
                f"{self.file_bytes / 2**30:.2f} GiB). Fix: free space there or another offload_dir, "
                "checkpoint_dtype='bf16' (half the bytes), a larger checkpoint_interval, or a shorter sequence.")
        return span, offset

    def _give_back_region(self, region: tuple[int, int]) -> None:
        with self._lock:
            bisect.insort(self._regions, region)

    # ------------------------------------------------------------------ checkpoints
    def save(self, x: torch.Tensor, prev: Checkpoint | None) -> DiskCheckpoint:
        """Copy ``x`` to a staging buffer (on the offload stream) and queue its write; ``x`` may go after."""
        stored = stored_form(x, self.dtype)
        nbytes = stored.numel() * stored.element_size()
        span, offset = self._region(nbytes)
        buffer = self._buffer(nbytes)
        view = buffer[:nbytes].view(stored.dtype)
        copied = None
        streams = self.streams
        if streams is not None:
            self.stream.wait_stream(streams.current())
            with streams.on(self.stream):
                view.copy_(stored.reshape(-1), non_blocking=True)
                copied = streams.record(self.stream)
            streams.keep_alive(stored, self.stream)
        else:
            view.copy_(stored.reshape(-1))
        ckpt = DiskCheckpoint((offset, span), stored, x, prev, self)
        self._worker.submit(self._write, buffer, span, offset, copied)
        self.stats.d2h_bytes += nbytes
        self.bytes_written += span
        weakref.finalize(ckpt, self._give_back_region, (span, offset))
        return ckpt

    def _write(self, buffer: torch.Tensor, span: int, offset: int, copied) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            self.io.write(self.fd, buffer[:span], offset).wait()
        finally:
            self._give_back_buffer(buffer)

    def _read(self, span: int, offset: int) -> torch.Tensor:
        buffer = self._buffer(span, wait=False)
        try:
            self.io.read(self.fd, buffer[:span], offset).wait()
        except BaseException:
            self._give_back_buffer(buffer)
            raise
        return buffer

    def prefetch(self, ckpt: Checkpoint | None) -> None:
        """Queue reading ``ckpt`` back (no-op if already queued or loaded)."""
        if ckpt is None or ckpt.host is None or ckpt.read is not None:
            return
        offset, span = ckpt.host
        ckpt.read = self._worker.submit(self._read, span, offset)

    def load(self, ckpt: DiskCheckpoint) -> torch.Tensor:
        """The checkpoint on the device, usable on the current stream (raises the write's or read's error)."""
        if ckpt.host is None:
            raise UsageError(
                "megatrain: an activation checkpoint on the disk tier was used by a second backward over the same "
                "graph (retain_graph=True, or torch.autograd.grad before backward); offload_checkpoints supports "
                "one backward per forward")
        self.prefetch(ckpt)
        buffer = ckpt.read.result()
        ckpt.read, ckpt.host = None, None
        numel = 1
        for n in ckpt.shape:
            numel *= n
        nbytes = numel * ckpt.stored.itemsize
        self.stats.h2d_bytes += nbytes
        self.bytes_read += align_up(nbytes, ALIGN)
        host = buffer[:nbytes].view(ckpt.stored).view(ckpt.shape)
        streams = self.streams
        if streams is None:
            dev = host.clone()
            self._give_back_buffer(buffer)
            return restored(dev, ckpt)
        with streams.on(self.stream):
            dev = streams.empty(ckpt.shape, ckpt.stored)
            dev.copy_(host, non_blocking=True)
            ready = streams.record(self.stream)
        compute = streams.current()
        compute.wait_event(ready)
        streams.keep_alive(dev, compute)
        self._uploads.append((ready, buffer))  # the buffer is free once the upload ran
        return restored(dev, ckpt)

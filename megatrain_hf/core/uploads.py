"""How the streamer's reads of host flats reach the compute: inline (the CPU) or over a copy stream.

The streamer (``streamer.py``) issues a unit's upload as one *batch* of copies, one per host flat
the unit reads, and later waits for the batch before the compute reads it.

* :class:`InlineUploads` (no streams: the compute device is the host): the compute reads the host
  flats themselves (a flat read in another dtype, fp32 masters as bf16 without a staging copy, is
  converted); nothing is waited for. What the CPU computations free goes back to the OS: large
  blocks are mapped, and glibc's heap is trimmed once per ``TRIM_EVERY_BYTES`` of units read.
* :class:`StreamUploads` (CUDA, or ``EmulatedStreams`` in tests): each flat is one DMA from pinned
  memory on the copy stream into a device flat (rounded to the wire dtype there when the host
  sends fp32 masters), recorded by one event; the compute stream waits on it, and a wait that
  stalls is timed by two events (the exposed H2D time).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import torch

from . import host_pages


class _Batch:
    """The copies of one upload; ``ready``: the event after the last (None: nothing to wait for)."""

    def __init__(self, copy) -> None:
        self.copy = copy
        self.ready: Any = None


class InlineUploads:
    """The CPU path (see module docstring)."""

    prefetches = False  # an upload is the host flat itself: nothing to issue ahead

    def __init__(self, stats) -> None:
        self.stats = stats
        self._untrimmed = 0  # bytes of units computed on the host since the heap was last trimmed
        host_pages.mmap_large()  # large temporaries (gradients, activations) go back to the OS when freed,
        host_pages.trim()  # and what filling the store left in the heap goes before the optimizer's state

    @contextlib.contextmanager
    def batch(self):
        batch = _Batch(self._read)
        yield batch
        if self._untrimmed >= host_pages.TRIM_EVERY_BYTES:  # what the computations freed goes back
            host_pages.trim()
            self._untrimmed = 0

    def _read(self, host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        self._untrimmed += host.numel() * host.element_size()
        return host if host.dtype == dtype else host.to(dtype)

    def wait(self, batch_ready, flats) -> None:
        """The compute may read the upload's ``flats`` (ready at once, inline)."""

    def drain(self) -> None:
        """No upload issued so far still reads a host flat (none ever does, inline)."""

    def exposed_wait_s(self) -> float:
        return 0.0


class StreamUploads(InlineUploads):
    """Uploads on a copy stream (see module docstring)."""

    prefetches = True

    def __init__(self, stats, streams) -> None:
        self.stats = stats
        self.streams = streams
        self.copy_stream = streams.new_stream()
        self._stalls: collections.deque = collections.deque()  # (event before, event after) around waits
        self._stalled_s = 0.0  # stall time of pairs already folded (completed)

    @contextlib.contextmanager
    def batch(self):
        streams = self.streams
        batch = _Batch(self._copy)
        with streams.on(self.copy_stream):
            yield batch
            batch.ready = streams.record(self.copy_stream)

    def _copy(self, host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        dev = self.streams.empty(host.shape, host.dtype)
        # pinned source + non_blocking: a DMA on the copy stream, overlapping compute
        dev.copy_(host, non_blocking=True)
        self.stats.h2d_bytes += host.numel() * host.element_size()
        return dev if dev.dtype == dtype else dev.to(dtype)  # no host staging copy: round the fp32 masters here

    def wait(self, ready, flats) -> None:
        """The compute stream reads the upload only once it landed; a stall is timed with two events."""
        streams = self.streams
        compute = streams.current()
        if ready.query():
            compute.wait_event(ready)  # (already complete: no stall)
        else:
            self.stats.fetches_not_ready += 1
            before = streams.record(compute, timing=True)
            compute.wait_event(ready)
            after = streams.record(compute, timing=True)
            self._stalls.append((before, after))
            self._fold_stalls()
        for dev in flats:
            streams.keep_alive(dev, compute)  # allocated on the copy stream, freed after compute

    def drain(self) -> None:
        self.copy_stream.synchronize()

    def exposed_wait_s(self) -> float:
        """Seconds the compute stream waited for uploads since the last call (exposed H2D time).

        Measured by events around each wait whose upload had not landed when it was queued; read
        when the work is done (the metrics read it at log time, after the step).
        """
        stalls, self._stalls = self._stalls, collections.deque()
        total, self._stalled_s = self._stalled_s, 0.0
        for before, after in stalls:
            after.synchronize()
            total += before.elapsed_time(after) / 1e3
        return total

    def _fold_stalls(self, keep: int = 256) -> None:
        """Sum completed pairs so the list stays short when nobody reads the metric (own loops, eval)."""
        while self._stalls and (len(self._stalls) > keep or self._stalls[0][1].query()):
            before, after = self._stalls.popleft()
            after.synchronize()  # a no-op when query() said done; otherwise only past the cap
            self._stalled_s += before.elapsed_time(after) / 1e3

"""How a unit's device gradients reach its host accumulators: inline (the CPU) or over the grad stream.

``GradSink`` (``grads.py``) decides *what* a unit sends (merged duplicates and tied weights, the
micro-batches' sums of a layer-major group, the synchronous path of hooked parameters); a landing
moves it. Both record each unit's norms in the sink's ``NormBook`` and tell the ownership
(``ownership.py``) when a unit's gradients landed, so that under data parallelism they are summed
into the owner's.

* :class:`InlineLanding` (no streams: the compute device is the host) accumulates at once, in the
  training thread.
* :class:`StreamLanding` (CUDA, or ``EmulatedStreams`` in tests) queues the transfers on a grad
  stream: a tensor's first contribution of the step is copied straight into its pinned
  accumulator; a later one takes the *GPU round trip* (the accumulator goes up the link, the
  gradient is added to it there, and the sum comes back down: the same fp32 addition the host
  would do, bit for bit, at no host CPU time). The per-tensor norms of what lands are computed on
  the device when the send covers the whole unit. A worker thread waits for each unit's copies,
  then reports it landed. At most ``MAX_PENDING_SENDS`` units are in flight (back-pressure).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from ..errors import BackgroundWorkerError
from .layout import Entry
from .norms import NormBook
from .workers import start_worker

logger = logging.getLogger(__name__)

MAX_PENDING_SENDS = 3
"""Units whose gradient transfers may be queued on the grad stream at once. Each keeps its device
gradients alive until its copies end; without a bound the queue grows by a unit's gradients per
layer of backward whenever the link is slower than the backward (see docs/log.md)."""

Sums = list[tuple[Entry, torch.Tensor]]  # (entry, its gradient or fp32 sum on the device, flat)


class InlineLanding:
    """The CPU path: gradients accumulate into the host flats in the training thread."""

    in_place = True  # a computation may write a gradient into its accumulator (runtime/grads_in_place.py)

    def __init__(self, store, stats, norms: NormBook) -> None:
        self.store, self.stats, self.norms = store, stats, norms

    def send(self, u: int, merged: Sums, want_norm: bool, timed: bool = True) -> Sums | None:
        """Land unit ``u``'s gradients (owned by ``u``); return the sums sent down (None: inline)."""
        accumulators = self.store.accumulators
        self.store.ownership.land(u, merged, lambda e, g: accumulators.accumulate(e, g, self.store.entry_name(u, e)))
        if want_norm:
            self.norms.refresh(u)
        else:
            self.norms.forget(u)
        return None

    def wait(self, at_most: int = 0) -> None:
        """Block until at most ``at_most`` units are still landing (nothing is, inline)."""

    def raise_error(self) -> None:
        """Re-raise a failure of the landing (none can happen outside the training thread, inline)."""

    def close(self) -> None:
        """Stop the landing's worker (none, inline)."""


class StreamLanding(InlineLanding):
    """Gradients down the grad stream, landed by a worker thread (see module docstring)."""

    in_place = False

    def __init__(self, store, stats, norms: NormBook, streams, host_threads: int = 1) -> None:
        super().__init__(store, stats, norms)
        self.streams = streams
        self.stream = streams.new_stream()
        self._error: BaseException | None = None
        self._pending = 0
        self._cond = threading.Condition()
        self._jobs: queue.Queue = queue.Queue()
        self._worker = start_worker(self, self._jobs, "_process", host_threads, "megatrain-grads")

    def close(self) -> None:
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=60)
            self._worker = None

    def __del__(self) -> None:
        jobs = getattr(self, "_jobs", None)
        if jobs is not None:
            jobs.put(None)

    def send(self, u: int, merged: Sums, want_norm: bool, timed: bool = True) -> Sums | None:
        accumulators = self.store.accumulators
        fresh, added, replaced = [], [], False
        for e, g in merged:
            if accumulators.is_low(e):  # a bf16 accumulator takes the step's one bf16 gradient only
                accumulators.check_single(e, g, self.store.entry_name(u, e))
            if e.tensor.grad is None:  # the step's first contribution: straight into the accumulator
                fresh.append((e, g))
            elif accumulators.holds(e):  # a later one: summed on the device
                added.append((e, g))
            else:  # the user replaced .grad with a tensor of their own: add into it, synchronously
                accumulators.accumulate(e, g)
                replaced = True
        # The device knows the whole of each accumulator once every tensor of the unit holding a
        # gradient is in this send; then its norms (fp32, as of the fp32 .grad that plain training
        # clips) come from the device, else the worker reads the host accumulators.
        sent_ids = {id(e) for e, _ in fresh + added}
        owned = self.store.owned_trainable(u)
        whole = not replaced and all(e.tensor.grad is None or id(e) in sent_ids for e in owned)
        device_norms = want_norm and whole and bool(sent_ids)
        waited = time.perf_counter()
        self.wait(MAX_PENDING_SENDS - 1)  # back-pressure: the compute waits for the link
        if timed:  # (the sink's wait() times its own flush)
            self.stats.grad_wait_s += time.perf_counter() - waited
        try:
            events, norms_host, sums = self._copy_down(fresh, added, device_norms)
        except BaseException:
            # e.g. out of memory in a cast after some copies were queued: they read `merged`, which
            # must outlive them, and the accumulators they write must be final before anyone reads
            self.stream.synchronize()
            raise
        # .grad points at the accumulator now, in this thread: the next send of this unit (another
        # micro-batch, a flushed group sum) must add to what this one queued, not copy over it;
        # the accumulator is read only after wait(), once the copies landed
        for e, _ in fresh:
            e.tensor.grad = accumulators.region(e).view(e.shape)
        key = self.norms.key(u)  # what the norms describe: a later change of .grad invalidates them
        with self._cond:
            self._pending += 1
        self.norms.forget(u)
        # merged (device gradients from the compute stream, among them sums made here, read by the
        # grad stream) stays referenced until the worker saw the copies end: the caching allocator
        # must not hand their memory to the compute stream first. What _copy_down allocated on the
        # grad stream is freed at once: only later work on that same stream can reuse it.
        self._jobs.put((u, key, events, merged, norms_host if device_norms else want_norm))
        return None if replaced else sums

    def _copy_down(self, fresh: Sums, added: Sums, device_norms: bool):
        """Queue one unit's transfers on the grad stream: ``fresh`` gradients down into the
        accumulators; for ``added`` ones the accumulator up, the gradient added to it, the sum down.
        Returns the (start, done) events, the pinned norms (or None) and the sums sent down."""
        streams, accumulators = self.streams, self.store.accumulators
        self.stream.wait_stream(streams.current())  # the gradients are ready there
        norms_host = None
        with streams.on(self.stream):
            start = streams.record(self.stream, timing=True)  # when the grad stream begins this unit
            sums = []
            if added:
                acc = streams.empty((sum(e.numel for e, _ in added),), torch.float32)
                offset = 0
                for e, g in added:
                    part = acc[offset : offset + e.numel]
                    offset += e.numel
                    part.copy_(accumulators.region(e), non_blocking=True)
                    part.add_(g.reshape(-1))  # fp32 += (bf16 | fp32): the host's fp32 add, on the device
                    sums.append((e, part))
                self.stats.h2d_bytes += acc.numel() * 4
                self.stats.grad_stream_bytes += acc.numel() * 4
            low = {}  # bf16 accumulators: the bf16 gradient itself goes down (the fp32 cast is for the norms)
            for e, g in fresh:
                if accumulators.is_low(e):
                    low[id(e)] = g.reshape(-1)
                sums.append((e, g.reshape(-1).float()))  # the cast runs on the device for free
            for e, total in sums:
                region = accumulators.region(e)
                region.copy_(low.get(id(e), total), non_blocking=True)
                self.stats.d2h_bytes += e.numel * region.element_size()
                self.stats.grad_stream_bytes += e.numel * region.element_size()
            if device_norms:
                norms = torch.stack(torch._foreach_norm([t for _, t in sums], 2))
                norms_host = streams.pinned(norms.shape, torch.float32)
                norms_host.copy_(norms, non_blocking=True)
            done = streams.record(self.stream, timing=True)
        return (start, done), norms_host, sums

    def _process(self, job) -> None:
        """(worker) A unit's copies ended: it landed; record its norms."""
        u, key, (start, done), _merged, want_norm = job
        try:
            done.synchronize()
            self.stats.grad_stream_busy_s += start.elapsed_time(done) / 1e3  # its effective link rate
            self.store.ownership.grads_landed(u)  # data parallelism: summed into the owner's accumulator
            if isinstance(want_norm, torch.Tensor):  # computed on the device, as of the send (key)
                self.norms.record(u, key, list(want_norm.unbind()))
            elif want_norm:  # from the host accumulators; valid only if no later send changed them
                self.norms.record(u, key, self.norms.compute(u)[1])
        except BaseException as exc:  # surfaced in the training thread by raise_error()
            logger.exception("gradient accumulation of unit %d failed", u)
            self._error = exc
        finally:
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def wait(self, at_most: int = 0) -> None:
        with self._cond:
            while self._pending > at_most:
                self._cond.wait(timeout=1.0)
                if self._worker is not None and not self._worker.is_alive():
                    raise BackgroundWorkerError("megatrain gradient worker died")

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise BackgroundWorkerError(f"megatrain gradient accumulation failed: {error!r}") from error

"""EXPERIMENTAL: the GPU takes a share of HostAdamW's update (``MegaTrainConfig(device_update=True)``).

Nothing in the default path depends on this module: the engine builds :class:`KeepingGradSink`
(a listener of its gradient sink) and the Trainer integration :class:`DeviceShareAdamW` only when
the option is on. It plugs into HostAdamW through its public ``scheduler=`` hook
(``update_worker.py``) and runs each unit through the same per-unit update (``UnitUpdater``) with
the device as its kernel; it overrides nothing of HostAdamW.

* :class:`DeviceShareScheduler` runs a second worker that updates units on the compute device while
  the host worker updates the others. ``step()`` assigns the units in forward order, each to the
  worker that would finish it first at the rates both reached in the last step (list
  scheduling), so the next forward trails both; each worker runs its own units in order, then
  takes the other's from the end. A unit's masters and moments go up in pieces of
  ``DEVICE_UPDATE_CHUNK`` elements, torch's fused AdamW runs there (on CUDA its CUDA kernel: same
  formula, last-bit differences from the host kernel), and masters, moments and the bf16 copy
  come back down on a second stream while the next piece goes up.
* :class:`KeepingGradSink` keeps, for the units the last assignment gave the device, the fp32
  gradient sums the engine's gradient sink sends down (a listener of its sends), valid while the unit's ``.grad`` keeps the identity and version it
  had then (a callback's in-place edit makes the device read the host's gradient instead), so
  those units' gradients need not go up the link again.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading

import torch

from ..core.grads import GradSink, Sums
from ..core.workers import start_worker
from .host_adamw import HostAdamW
from .kernels import UnitJob
from .update_worker import JobBoard, UnitUpdater

KEEP_DEVICE_FRACTION = 0.1
"""At most this fraction of the device's memory holds gradients kept for its share (the rest of
its units' gradients go up the link again)."""
DEVICE_SHARE_START = 0.35
"""The device's share of the update rate in the first step (later: measured)."""
DEVICE_UPDATE_CHUNK = 1 << 25
"""Elements per piece sent up (32 M: ~0.6 GB of device memory with their gradients, moments and
bf16 copy), so a large unit (an untied lm_head) never needs all its state on the device."""


class KeepingGradSink:
    """Keeps, on the device, the gradient sums a ``GradSink`` sends down for the units in
    ``keep_on_device`` (it listens to the sink's sends: ``GradSink.send_listeners``)."""

    def __init__(self, sink: GradSink) -> None:
        self.sink = sink
        self.keep_on_device: frozenset[int] = frozenset()
        self._kept: dict[int, tuple[tuple, dict[int, torch.Tensor]]] = {}  # unit -> (grad key, {offset: flat})
        self.stale_device_grads = 0  # kept copies found stale when taken (a gradient changed since)
        sink.send_listeners.append(self._on_send)

    def _on_send(self, u: int, before: tuple, sums: Sums | None, merged: Sums) -> None:
        """The sink sent unit ``u``'s gradients (``before``: its grad key until then; ``sums``: what went
        down, None when some gradient took the synchronous path)."""
        if u not in self.keep_on_device:
            return
        if self.sink.streams is None:  # the "device" is the CPU: copies of the accumulated sums
            sums = [(e, e.tensor.grad.detach().reshape(-1).clone()) for e, _ in merged]
        if sums is None:  # a gradient took the synchronous path: the sums are not all of .grad
            self._kept.pop(u, None)
            return
        old_key, held = self._kept.get(u, (None, {}))
        held = dict(held) if old_key == before else {}
        held.update({e.offset: t for e, t in sums})  # the later sums win
        self._kept[u] = (self.sink.grad_key(u), held)

    def take_device_grads(self) -> dict[int, dict[int, torch.Tensor]]:
        """The kept device gradients that still equal the host ``.grad`` (unit -> {offset: flat}), once:
        the keeper forgets them all. Call after backward's gradients landed (``wait()``)."""
        kept, self._kept = self._kept, {}
        valid = {u: held for u, (key, held) in kept.items() if key == self.sink.grad_key(u)}
        self.stale_device_grads += len(kept) - len(valid)
        return valid

    def drop_device_grads(self) -> None:
        """Keep nothing on the device any more (the optimizer skipped a step, was closed or replaced)."""
        self.keep_on_device = frozenset()
        self._kept = {}


class DeviceShareScheduler:
    """HostAdamW's scheduler (``HostAdamW(scheduler=...)``, ``update_worker.py``) that shares a step's
    units between the host worker and a device worker (see module docstring)."""

    def __init__(self, updater: UnitUpdater, gates, threads: int, device: torch.device,
                 grad_sink: KeepingGradSink | None = None, stats=None) -> None:
        self.updater, self.device = updater, device
        self.board = JobBoard(gates)
        self.device_share = DEVICE_SHARE_START  # fraction of a step's elements given to the device
        self._rates: dict[str, list[float]] = {"host": [0, 0.0], "device": [0, 0.0]}  # elements, seconds
        self._grad_sink = grad_sink  # None under a GPU budget: nothing is kept on the device
        self._stats = stats  # an EngineStats: the link bytes of the device's share are counted there
        self._link_bytes = (0, 0)  # ... as they accumulate (h2d, d2h), handed over at the next dispatch
        self._stats_lock = threading.Lock()
        self._device_numel = 0
        self.kept_grad_units = 0  # device updates that read gradients the sink kept on the device
        self._kept: dict[int, dict[int, torch.Tensor]] = {}  # this step's kept gradients, per unit
        cuda = device.type == "cuda"
        self._up_stream = torch.cuda.Stream(device) if cuda else None  # state up, the update
        self._down_stream = torch.cuda.Stream(device) if cuda else None  # state down, beside the next piece up
        self._queue: collections.deque[UnitJob] = collections.deque()
        self._device_queue: collections.deque[UnitJob] = collections.deque()
        self._wake: queue.Queue = queue.Queue()
        self._device_wake: queue.Queue = queue.Queue()
        self._worker = start_worker(self, self._wake, "_drain", threads, "megatrain-adamw")
        self._device_worker = start_worker(self, self._device_wake, "_drain_device", torch.get_num_threads(),
                                           "megatrain-adamw-device")  # (torch's thread count is per process)

    # ------------------------------------------------------------------ planning
    def dispatch(self, jobs: list[UnitJob]) -> None:
        if self._stats is not None:  # what the device's share moved in the last update (its pieces all landed)
            with self._stats_lock:
                (h2d, d2h), self._link_bytes = self._link_bytes, (0, 0)
            self._stats.update_h2d_bytes += h2d
            self._stats.update_d2h_bytes += d2h
        kept = self._grad_sink.take_device_grads() if self._grad_sink is not None else {}
        device_jobs, host_jobs = self._assign(jobs)
        # the host's jobs drop their kept gradients, except the last two, which the device may take
        may_run_on_device = {j.unit for j in device_jobs} | {j.unit for j in host_jobs[-2:]}
        self._kept = {u: held for u, held in kept.items() if u in may_run_on_device}
        if self._grad_sink is not None:  # the next step's split will be much the same: keep those gradients
            self._grad_sink.keep_on_device = self._keep_set(device_jobs)
        self.board.begin(jobs, self._worker)
        with self.board.cond:
            self._device_queue.extend(device_jobs)
            self._queue.extend(host_jobs)
        self._wake.put(True)
        self._device_wake.put(True)

    def _assign(self, jobs: list[UnitJob]) -> tuple[list[UnitJob], list[UnitJob]]:
        """Split the step's jobs between the device worker and the host worker, in order: each job
        goes to the worker that would finish it first at the rates the two reached in the last step
        (elements per second), so the two finish together and units complete near forward order,
        which the next forward follows. Returns (device jobs, host jobs)."""
        # (the workers are idle: step() synchronized, so _rates is not being written)
        (host_n, host_s), (dev_n, dev_s) = self._rates["host"], self._rates["device"]
        if host_n and dev_n and host_s > 0 and dev_s > 0:
            host_rate, dev_rate = host_n / host_s, dev_n / dev_s
            self.device_share = min(0.95, max(0.05, dev_rate / (host_rate + dev_rate)))
        self._rates = {"host": [0, 0.0], "device": [0, 0.0]}
        device, host = [], []
        device_free = host_free = 0.0  # when each would be done with what it has, in time at unit rate
        for job in jobs:
            device_done = device_free + job.numel / self.device_share
            host_done = host_free + job.numel / (1.0 - self.device_share)
            if device_done < host_done:
                device.append(job)
                device_free = device_done
            else:
                host.append(job)
                host_free = host_done
        return device, host

    def _keep_set(self, device_jobs: list[UnitJob]) -> frozenset[int]:
        """Units whose gradients the sink keeps on the device for the next step: the device's, first
        units first (their gradients come last in backward and go first in the update, so they
        live shortest), up to ``KEEP_DEVICE_FRACTION`` of the device's memory."""
        if self.device.type == "cuda":
            limit = KEEP_DEVICE_FRACTION * torch.cuda.get_device_properties(self.device).total_memory
        else:
            limit = float("inf")
        keep, size = [], 0
        for job in device_jobs:
            size += 4 * job.numel
            if size > limit:
                break
            keep.append(job.unit)
        return frozenset(keep)

    def skipped(self) -> None:
        if self._grad_sink is not None:
            self._grad_sink.take_device_grads()  # this step's copies: not needed, freed

    # ------------------------------------------------------------------ workers
    def _drain(self, _wake) -> None:
        self._drain_lists(self._queue, self._device_queue, on_device=False)

    def _drain_device(self, _wake) -> None:
        self._drain_lists(self._device_queue, self._queue, on_device=True)

    def _drain_lists(self, own: collections.deque, other: collections.deque, on_device: bool) -> None:
        """This worker's own list in order, then the other worker's from its last job backwards (the
        units the next forward needs last), until none is left."""
        while True:
            with self.board.cond:
                if own:
                    job = own.popleft()
                elif other:
                    job = other.pop()
                else:
                    return
            self._run(job, on_device=on_device)

    def _run(self, job: UnitJob, on_device: bool = False) -> None:
        """Run one job on this thread (the device's share or the host's) and account for its time."""
        kept = self._kept.pop(job.unit, None)
        if on_device:
            elapsed = self.board.run(job, lambda j: self.updater.update(j, _OnDevice(self, kept)), "update_device")
        else:
            elapsed = self.board.run(job, self.updater.update)
        with self._stats_lock:
            if on_device:  # runs beside the host's updates: its time is not the host's
                self._device_numel += job.numel
            else:
                self.board.account(job.numel, elapsed)
            rate = self._rates["device" if on_device else "host"]
            rate[0] += job.numel
            rate[1] += elapsed

    def take_update_stats(self) -> tuple[float, int]:
        return self.board.take_update_stats()

    def take_device_numel(self) -> int:
        """Elements updated on the compute device since the last call."""
        with self._stats_lock:
            out, self._device_numel = self._device_numel, 0
        return out

    def _update_on_device(self, job: UnitJob, kept: dict[int, torch.Tensor] | None) -> None:
        """Unit ``job.unit``'s update on the compute device, in pieces (AdamW is elementwise). The
        clip scale applies to the device's gradients only (``param.grad`` is left as it is)."""
        pieces: collections.deque = collections.deque()  # pieces whose state is on its way down
        try:
            for w in job.work:
                torch._foreach_add_(w.steps, 1)
                hyper = dict(lr=w.lr, beta1=w.beta1, beta2=w.beta2, weight_decay=w.weight_decay, eps=w.eps,
                             maximize=w.maximize)
                batch, size = [], 0
                for step, p, g, s, e in zip(w.steps, w.params, w.grads, w.states, w.entries):
                    on_dev = kept is not None and e.offset in kept
                    flats = [t.detach().reshape(-1) for t in (p, kept[e.offset] if on_dev else g, s.fp32(0), s.fp32(1))]
                    stage = self.updater.store.staging.slice(e)
                    for lo in range(0, e.numel, DEVICE_UPDATE_CHUNK):
                        hi = min(lo + DEVICE_UPDATE_CHUNK, e.numel)
                        if batch and size + hi - lo > DEVICE_UPDATE_CHUNK:
                            self._run_piece(batch, hyper, w.clip, pieces)
                            batch, size = [], 0
                        batch.append(_Piece(step, *(f[lo:hi] for f in flats), on_dev,
                                            stage[lo:hi] if stage is not None else None))
                        size += hi - lo
                if batch:
                    self._run_piece(batch, hyper, w.clip, pieces)
        finally:
            for stream in (self._up_stream, self._down_stream):  # the host flats hold the result before
                if stream is not None:                           # the unit is marked ready
                    done = torch.cuda.Event(blocking=True)
                    done.record(stream)
                    done.synchronize()

    def _run_piece(self, batch: list["_Piece"], hyper: dict, clip, pieces: collections.deque) -> None:
        cuda = self._up_stream is not None
        device = self.device

        def up(tensors):
            return [t.to(device, non_blocking=True) if cuda else t.clone() for t in tensors]

        with torch.cuda.stream(self._up_stream) if cuda else contextlib.nullcontext():
            dp, dm, dv = up([b.param for b in batch]), up([b.exp_avg for b in batch]), up([b.exp_avg_sq for b in batch])
            dg = [b.grad if b.grad_on_device else up([b.grad])[0] for b in batch]
            if clip is not None:
                torch._foreach_mul_(dg, clip.to(dg[0].device))
            torch._fused_adamw_(dp, dg, dm, dv, [], up([b.step for b in batch]), amsgrad=False, grad_scale=None,
                                found_inf=None, **hyper)
            if not cuda:
                for b, p, m, v in zip(batch, dp, dm, dv):
                    b.param.copy_(p), b.exp_avg.copy_(m), b.exp_avg_sq.copy_(v)
                    if b.stage is not None:
                        b.stage.copy_(p.to(b.stage.dtype))
                return
            for g, b in zip(dg, batch):
                if b.grad_on_device:  # allocated by the gradient sink's streams, read here
                    g.record_stream(self._up_stream)
            updated = torch.cuda.Event()
            updated.record(self._up_stream)
        self._down_stream.wait_event(updated)
        with torch.cuda.stream(self._down_stream):
            for b, p, m, v in zip(batch, dp, dm, dv):
                for host, dev in ((b.param, p), (b.exp_avg, m), (b.exp_avg_sq, v)):
                    host.copy_(dev, non_blocking=True)
                    dev.record_stream(self._down_stream)  # allocated on the up stream, read here
                if b.stage is not None:
                    b.stage.copy_(p.to(b.stage.dtype), non_blocking=True)
            landed = torch.cuda.Event(blocking=True)  # waited for below: sleep, do not spin a core
            landed.record(self._down_stream)
        numel = sum(b.param.numel() for b in batch)
        sent_grads = sum(b.grad.numel() for b in batch if not b.grad_on_device)
        staged = sum(b.stage.numel() * b.stage.element_size() for b in batch if b.stage is not None)
        with self._stats_lock:
            h2d, d2h = self._link_bytes
            self._link_bytes = (h2d + 12 * numel + 4 * sent_grads, d2h + 12 * numel + staged)
        pieces.append(landed)
        while len(pieces) > 2:  # at most three pieces' state on the device at once
            pieces.popleft().synchronize()

    # ------------------------------------------------------------------ lifetime
    def wait(self) -> None:
        self.board.wait(self.alive)

    def alive(self) -> bool:
        return self._worker.is_alive() and self._device_worker.is_alive()

    def close(self) -> None:
        if self._grad_sink is not None:
            self._grad_sink.drop_device_grads()
        for worker, wake in ((self._worker, self._wake), (self._device_worker, self._device_wake)):
            if worker.is_alive():
                wake.put(None)
                worker.join(timeout=60)

    def __del__(self) -> None:
        for wake in (getattr(self, "_wake", None), getattr(self, "_device_wake", None)):
            if wake is not None:
                wake.put(None)


class _OnDevice:
    """The device's share as the per-unit update's kernel: it writes the staging copy of what it updates."""

    writes_staging = True

    def __init__(self, scheduler: DeviceShareScheduler, kept: dict[int, torch.Tensor] | None) -> None:
        self.scheduler, self.kept = scheduler, kept

    def run(self, job: UnitJob, staging) -> None:
        self.scheduler._update_on_device(job, self.kept)
        if self.kept:
            with self.scheduler._stats_lock:
                self.scheduler.kept_grad_units += 1


class DeviceShareAdamW(HostAdamW):
    """HostAdamW whose update is shared between the host and the compute device: a
    :class:`DeviceShareScheduler` through the public ``scheduler=`` hook, nothing else changed."""

    def __init__(self, *args, grad_sink: KeepingGradSink | None = None, stats=None, **kwargs) -> None:
        device = kwargs.get("device") or torch.device("cpu")
        super().__init__(*args, scheduler=lambda updater, gates, threads: DeviceShareScheduler(
            updater, gates, threads, device, grad_sink, stats), **kwargs)

    device_share = property(lambda self: self.scheduler.device_share,
                            doc="The fraction of a step's elements the last split gave the device.")
    kept_grad_units = property(lambda self: self.scheduler.kept_grad_units,
                               doc="Device updates that read gradients the sink kept on the device.")


class _Piece:
    """A slice of one parameter's update state (flat views into the host flats, or a kept device gradient)."""

    __slots__ = ("step", "param", "grad", "exp_avg", "exp_avg_sq", "grad_on_device", "stage")

    def __init__(self, step, param, grad, exp_avg, exp_avg_sq, grad_on_device, stage) -> None:
        self.step, self.param, self.grad, self.exp_avg, self.exp_avg_sq = step, param, grad, exp_avg, exp_avg_sq
        self.grad_on_device, self.stage = grad_on_device, stage

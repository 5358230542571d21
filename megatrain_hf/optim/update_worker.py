"""HostAdamW's per-unit update and the worker that runs a step's updates in the background.

* :class:`UnitUpdater`: one unit's update. Its moments are bound (``moment_store.MomentStore.bound``:
  RAM views, or a disk-tier slot), the kernel runs over each param group (``kernels.TorchKernel`` /
  ``NativeKernel``), the unit is marked dirty and its compute-dtype staging copy refreshed. It reads
  the same whatever the moment format, the tier, the ranks or the device: those are the strategies'.
* :class:`JobBoard`: the step's jobs in flight, the readiness gates (``core/readiness.py``) and the
  update statistics; what every scheduler shares.
* :class:`HostWorker`: the default scheduler, one host thread running the jobs in forward order
  (unit 0 first) and reading the disk tier ahead of them. A scheduler is the public hook through
  which the update is spread otherwise (``device_update.DeviceShareScheduler``); it has
  ``dispatch(jobs)``, ``wait()``, ``alive()``, ``skipped()``, ``take_update_stats()`` and ``close()``, and
  optionally ``export()`` / ``imported(u)`` where it keeps state outside the host flats (``resident_update.py``).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from ..errors import BackgroundWorkerError
from ..core.workers import start_worker
from .kernels import UnitJob

logger = logging.getLogger(__name__)


class UnitUpdater:
    """The update of one unit: ``store``'s flats, ``moments``' states, ``kernel``'s arithmetic."""

    def __init__(self, store, moments, kernel) -> None:
        self.store, self.moments, self.kernel = store, moments, kernel

    def update(self, job: UnitJob, kernel=None) -> None:
        """Update ``job``'s unit with ``kernel`` (default: the host kernel; any object with ``run(job,
        staging)`` and ``writes_staging``), then refresh its staging copy unless the kernel wrote it."""
        kernel = kernel or self.kernel
        u, staging = job.unit, self.store.staging
        staging_was_fresh = staging.fresh(u)
        with self.moments.bound(job) as master:
            kernel.run(job, staging)
            self.store.mark_dirty(u)
            if kernel.writes_staging and staging_was_fresh:
                staging.written(u)  # the kernel wrote the copy of every master it changed
            else:
                staging.stage(u, master)  # the compute-dtype copy, while the masters are warm in cache


class JobBoard:
    """A step's jobs in flight: their readiness gates, the count of those not done, the time they took."""

    def __init__(self, gates) -> None:
        self.gates = gates
        self.cond = threading.Condition()
        self.pending = 0
        self._stats_lock = threading.Lock()
        self._update_s, self._updated_numel = 0.0, 0

    def begin(self, jobs: list[UnitJob], worker: threading.Thread) -> None:
        """Mark the jobs' units busy (the next forward's fetch of each waits for its update)."""
        for job in jobs:
            self.gates.begin_update(job.unit, worker)
        with self.cond:
            self.pending += len(jobs)

    def run(self, job: UnitJob, update: Callable[[UnitJob], None], label: str = "update") -> float:
        """Run ``update(job)`` on this thread and mark its unit ready (with its error, if it failed);
        returns the seconds it took."""
        self.gates.claim_update(job.unit, threading.current_thread())
        error = None
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"megatrain.{label}[{job.unit}]"):
                update(job)
        except BaseException as exc:  # surfaced in the training thread by the next wait
            logger.exception("HostAdamW update of unit %d failed", job.unit)
            error = exc
        finally:
            elapsed = time.perf_counter() - start
            self.gates.end_update(job.unit, error)
            with self.cond:
                self.pending -= 1
                self.cond.notify_all()
        return elapsed

    def account(self, numel: int, seconds: float) -> None:
        with self._stats_lock:
            self._update_s += seconds
            self._updated_numel += numel

    def take_update_stats(self) -> tuple[float, int]:
        with self._stats_lock:
            out = self._update_s, self._updated_numel
            self._update_s, self._updated_numel = 0.0, 0
        return out

    def wait(self, alive: Callable[[], bool]) -> None:
        """Wait until no job is pending; raise if a worker ``alive`` says is gone died meanwhile."""
        with self.cond:
            while self.pending:
                self.cond.wait(timeout=1.0)
                if not alive():
                    raise BackgroundWorkerError("HostAdamW worker thread died")


class HostWorker:
    """The default scheduler: one host thread updates a step's units in order, unit 0 first."""

    def __init__(self, updater: UnitUpdater, gates, threads: int) -> None:
        self.updater = updater
        self.board = JobBoard(gates)
        self._queue: collections.deque[UnitJob] = collections.deque()
        self._wake: queue.Queue = queue.Queue()
        self._worker = start_worker(self, self._wake, "_drain", threads, "megatrain-adamw")

    def dispatch(self, jobs: list[UnitJob]) -> None:
        """Mark the step's units busy and hand them to the host worker, unit 0 first."""
        self.board.begin(jobs, self._worker)
        with self.board.cond:
            self._queue.extend(jobs)
        self._wake.put(True)

    def _drain(self, _wake) -> None:
        """(host worker) Run the queued jobs in order, the disk tier reading the next ones ahead."""
        moments = self.updater.moments
        while True:
            with self.board.cond:
                if not self._queue:
                    return
                job = self._queue.popleft()
                upcoming = [j.unit for j in self._queue]
            moments.prefetch(job.unit, upcoming)
            self.board.account(job.numel, self.board.run(job, self.update))

    def update(self, job: UnitJob) -> None:
        """(host worker) One unit's update (``resident_update.ResidentWorker`` runs its resident units elsewhere)."""
        self.updater.update(job)

    def wait(self) -> None:
        self.board.wait(self.alive)

    def alive(self) -> bool:
        return self._worker.is_alive()

    def skipped(self) -> None:
        """A step that updates nothing."""

    def export(self) -> None:
        """The host flats must hold the whole state now (a ``state_dict``, a save): nothing lives elsewhere."""

    def imported(self, u: int | None = None) -> None:
        """The host moments of unit ``u`` (all if None) were written by a load: nothing to copy elsewhere."""

    def take_update_stats(self) -> tuple[float, int]:
        return self.board.take_update_stats()

    def close(self) -> None:
        if self._worker.is_alive():
            self._wake.put(None)
            self._worker.join(timeout=60)

    def __del__(self) -> None:
        wake = getattr(self, "_wake", None)
        if wake is not None:
            wake.put(None)

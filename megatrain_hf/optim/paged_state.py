"""The disk tier of the optimizer state: each unit's state tensors in a file, paged through a window.

A unit's optimizer state is whatever contiguous tensors the optimizer holds for it (HostAdamW:
``exp_avg`` and ``exp_avg_sq``, fp32 flats laid out like the unit's master flat, or with
``optimizer_state`` "bf16" / "8bit" / "4bit" the compressed moments' codes and scales). They are paged as
raw bytes, so any representation works: one file per unit in this run's directory, each tensor at
an :data:`~megatrain_hf.core.disk_io.ALIGN`-aligned offset. RAM holds ``window`` *slots* (each the
size of the largest unit's state); the update order is known in advance (forward order), so
:meth:`PagedState.prefetch` reads exactly the next units while one updates, and
:meth:`PagedState.release` writes the updated unit back behind it. A slot is reused once its
write-back is done; a unit still in a slot is served from it without a read.

Errors: a failed read raises from :meth:`acquire`; a failed write-back from the next
:meth:`acquire` (every call polls the writes in flight) or from :meth:`flush`, and every later
call raises it again (the file no longer holds the state: restart from the last checkpoint).
The run directory and its files are removed by :meth:`close`, at garbage collection and at exit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from dataclasses import dataclass, field

import torch

from ..errors import IncompatibleOptionsError, MegatrainConfigError
from ..core.disk_io import ALIGN, DONE, DiskIO, Pending, align_up, create_run_dir, remove_run_dir
from .disk_engines import open_disk_io

logger = logging.getLogger(__name__)

DEFAULT_WINDOW = 4
"""Slots in RAM: the unit updating, one written back behind it, two read ahead."""

MASTER = "master"
"""The state tensor holding a unit's fp32 masters ``[:n_staged]`` (``offload_state="all"``), first in its
file (offset 0); the parameters alias a mapping of it (:meth:`PagedState.map`, ``core/mapped_masters.py``)."""


@dataclass
class _Slot:
    buffer: torch.Tensor
    unit: int | None = None
    read: Pending = DONE
    write: Pending = DONE
    in_use: bool = False


@dataclass
class _UnitFile:
    name: str
    fd: int
    nbytes: int
    tensors: dict[str, tuple[int, int, torch.dtype]] = field(default_factory=dict)  # name -> (offset, numel, dtype)


def _cleanup(io: DiskIO, run_dir: str, names: list[str]) -> None:
    io.shutdown()
    remove_run_dir(run_dir, names)


class PagedState:
    """Per-unit state tensors on disk under ``offload_dir``; at most ``window`` units in RAM at once."""

    def __init__(self, offload_dir: str, specs: dict[int, dict[str, tuple[int, torch.dtype]]],
                 window: int = DEFAULT_WINDOW, io: DiskIO | None = None, disk_io: str = "threads") -> None:
        if window < 2:
            raise MegatrainConfigError(
                f"PagedState window={window}: must be >= 2 (one unit updating, one written back)")
        layouts = {}
        for u, spec in specs.items():
            tensors, offset = {}, 0
            for key, (numel, dtype) in spec.items():
                tensors[key] = (offset, numel, dtype)
                offset += align_up(numel * dtype.itemsize)
            layouts[u] = (tensors, offset)
        slot_bytes = max([nbytes for _, nbytes in layouts.values()] + [ALIGN])
        self.specs, self.window, self.disk_io_name = specs, window, disk_io  # (what an optimizer adopting it checks)
        self.run_dir = create_run_dir(offload_dir)
        try:  # the engine (disk_engines.CHOICES) unless one is given
            self.io = io if io is not None else open_disk_io(disk_io, self.run_dir, window * slot_bytes)
        except BaseException:
            remove_run_dir(self.run_dir, [])
            raise
        self._files: dict[int, _UnitFile] = {}
        names: list[str] = []  # the files this run created (the only ones removed)
        self._finalizer = weakref.finalize(self, _cleanup, self.io, self.run_dir, names)
        for u, (tensors, nbytes) in layouts.items():
            name = f"unit-{u:05d}.state"
            names.append(name)
            fd = self.io.create(f"{self.run_dir}/{name}", nbytes)
            self._files[u] = _UnitFile(name, fd, nbytes, tensors)
        self._slots = [_Slot(self.io.empty(slot_bytes)) for _ in range(window)]
        self.ahead = window - 2  # units read ahead of the one updating (one slot is left for the write-back)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.bytes_read = self.bytes_written = 0
        self._taken = (0, 0)
        logger.info("megatrain: optimizer state on disk in %s (%.2f GiB; %d RAM slots, %.2f GiB)", self.run_dir,
                    self.disk_bytes() / 2**30, window, self.ram_bytes() / 2**30)

    @property
    def units(self):
        """The units paged here (a view of the files' keys: cheap membership tests)."""
        return self._files.keys()

    def take_io_stats(self) -> tuple[int, int]:
        """Bytes read and written since the last call."""
        with self._lock:
            out = self.bytes_read - self._taken[0], self.bytes_written - self._taken[1]
            self._taken = (self.bytes_read, self.bytes_written)
        return out

    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self._files.values())

    def ram_bytes(self) -> int:
        return sum(s.buffer.numel() for s in self._slots)

    # ------------------------------------------------------------------ paging
    def prefetch(self, units: list[int]) -> None:
        """Start reading ``units`` (in this order) into free slots; stop at the first that finds none.
        Never raises: a failed write-back stops it, and the next :meth:`acquire` raises that failure."""
        with self._lock:
            for slot in self._slots:
                if slot.write.done():
                    self._wait(slot.write)
            if self._error is not None:
                return
            for u in units:
                try:
                    if self._slot_of(u) is None and not self._start_read(u, keep=units, block=False):
                        return
                except BaseException:
                    if self._error is None:
                        raise
                    return  # a write-back failed meanwhile: kept in self._error, raised by acquire

    def acquire(self, u: int) -> dict[str, torch.Tensor]:
        """Unit ``u``'s state tensors, resident (read now if no prefetch brought them); views of a slot."""
        with self._lock:
            self._poll()
            slot = self._slot_of(u)
            if slot is None:
                slot = self._start_read(u, keep=[u], block=True)
            slot.in_use = True
        try:
            slot.read.wait()
            slot.write.wait()  # its previous write-back must not read bytes we are about to change
        except BaseException as exc:
            with self._lock:
                slot.in_use, slot.unit, slot.read, slot.write = False, None, DONE, DONE
                self._error = self._error or exc
            raise
        return self._views(u, slot)

    def release(self, u: int, dirty: bool) -> None:
        """Done with unit ``u``'s tensors; ``dirty``: they changed, write them back (in the background)."""
        with self._lock:
            slot = self._slot_of(u)
            slot.in_use = False
            if dirty:
                f = self._files[u]
                slot.write = self.io.write(f.fd, slot.buffer[: f.nbytes], 0)
                self.bytes_written += f.nbytes

    @contextlib.contextmanager
    def resident(self, u: int, write: bool):
        """Unit ``u``'s tensors while the block runs; ``write``: written back after it."""
        flats = self.acquire(u)
        try:
            yield flats
        finally:
            self.release(u, dirty=write)

    @contextlib.contextmanager
    def state(self, u: int, write: bool):
        """Unit ``u``'s optimizer state tensors (not its master) while the block runs, read from the file
        (not from a slot kept from before: the master may have changed through its mapping since)."""
        self.forget([u])
        with self.resident(u, write) as flats:
            yield {k: v for k, v in flats.items() if k != MASTER}

    def map(self, u: int, key: str) -> torch.Tensor:
        """Tensor ``key`` of unit ``u``'s file as a shared mapping of the file (reads and writes go to it
        through the page cache; valid while mapped, even once the file is removed)."""
        import numpy as np

        offset, numel, dtype = self._files[u].tensors[key]
        path = f"{self.run_dir}/{self._files[u].name}"
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        return torch.from_numpy(np.memmap(path, dtype=np_dtype, mode="r+", offset=offset, shape=(numel,)))

    def forget(self, units) -> None:
        """Drop the slots' copies of ``units`` (not in use), once their reads and write-backs are done, so
        that the next :meth:`acquire` reads the file (where a mapping's writes land)."""
        with self._lock:
            for slot in self._slots:
                if slot.unit in units and not slot.in_use:
                    self._wait(slot.read)
                    self._wait(slot.write)
                    slot.unit, slot.read, slot.write = None, DONE, DONE
            self._raise()

    def flush(self) -> None:
        """Wait for every write-back; raise the first that failed."""
        for slot in self._slots:
            self._wait(slot.write)
        self._raise()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Wait for the writes, then remove the run directory with its files (idempotent)."""
        try:
            for slot in self._slots:
                try:
                    slot.write.wait()
                except OSError:
                    pass
            for f in self._files.values():
                self.io.close(f.fd)
            self._files.clear()
        finally:
            self._finalizer()

    # ------------------------------------------------------------------ internals
    def _views(self, u: int, slot: _Slot) -> dict[str, torch.Tensor]:
        out = {}
        for key, (offset, numel, dtype) in self._files[u].tensors.items():
            out[key] = slot.buffer[offset : offset + numel * dtype.itemsize].view(dtype)
        return out

    def _slot_of(self, u: int) -> _Slot | None:
        for slot in self._slots:
            if slot.unit == u:
                return slot
        return None

    def _start_read(self, u: int, keep: list[int], block: bool) -> _Slot | None:
        """(locked) Read ``u`` into a slot that is not in use and holds no unit of ``keep``."""
        while True:
            free = [s for s in self._slots if not s.in_use and s.unit not in keep]
            ready = [s for s in free if s.write.done() and s.read.done()]
            if ready or (block and free):
                slot = (ready or free)[0]
                self._wait(slot.write)
                self._raise()
                f = self._files[u]
                slot.unit, slot.write = u, DONE
                slot.read = self.io.read(f.fd, slot.buffer[: f.nbytes], 0)
                self.bytes_read += f.nbytes
                return slot
            if not block:
                return None
            raise RuntimeError(f"PagedState: no free slot for unit {u} (all {len(self._slots)} in use)")

    def _wait(self, pending: Pending) -> None:
        try:
            pending.wait()
        except BaseException as exc:
            self._error = self._error or exc

    def _poll(self) -> None:
        for slot in self._slots:
            if slot.write.done():
                self._wait(slot.write)
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


def master_units(store, units, offload_masters) -> list[int]:
    """The units of ``units`` (paged) whose staged masters go to disk too: ``offload_masters`` True (all of
    them) or a collection of units; those without staged masters (embedding, norms, LoRA) keep theirs in RAM.
    Refused where the store has no staging copy for the device to stream instead of the masters (a
    ``HostAdamW(offload_masters=...)`` built by hand; the engine's plan refuses such options before)."""
    if not offload_masters:
        return []
    if not store.staging.enabled:
        raise IncompatibleOptionsError(
            "megatrain: the fp32 masters on disk (offload_state='all', offload_masters) need the bf16 staging copy, "
            "which the device streams instead of the masters; this store has none (fp32 compute, or "
            "host_staging=False, streams the masters themselves). Fix: bf16 compute (bf16=True / compute_dtype="
            "'bf16') with host_staging=True or 'auto', or offload_state='moments'.")
    if store.ownership.world_size > 1:  # megatrain_hf/plan.py refuses offload_state='all' with data parallelism
        raise RuntimeError("megatrain: masters on disk requested of a store sharded over ranks (the owners "
                           "broadcast their masters from RAM); build HostAdamW through the engine's plan")
    return [u for u in sorted(units) if (offload_masters is True or u in offload_masters) and store.buffers[u].n_staged]


def move_masters(pager: PagedState, store, units: list[int]) -> None:
    """The staged masters of ``units`` into their files (``MASTER``), then the parameters onto a mapping of
    them and their RAM flat freed (``core/mapped_masters.py``), a unit at a time."""
    from ..core.mapped_masters import page_masters

    for u in units:
        store.staging.stage(u)  # from the RAM flat now: a stale copy would be refreshed from the mapping (a read of it)
        with pager.resident(u, write=True) as flats:
            flats[MASTER].copy_(store.staged_master(u))
        pager.flush()  # written before the mapping is read
        page_masters(store, u, pager.map(u, MASTER), weakref.WeakMethod(pager.flush))

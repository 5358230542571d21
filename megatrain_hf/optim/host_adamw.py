"""HostAdamW: AdamW on the host store's flats, unit by unit, in a background thread.

Same math as ``torch.optim.AdamW(fused=True)`` (the Trainer's default ``adamw_torch_fused``): the
same kernel runs on the same tensors, so results are bitwise equal (``kernel="native"``: one pass
over memory with torch's arithmetic op for op, see ``kernels.py``). What differs is where the
state lives: ``exp_avg`` / ``exp_avg_sq`` are one contiguous fp32 flat per unit, laid out like the
unit's master flat, so the update runs unit by unit (unit 0 first) and the state is saved and
loaded per unit. ``state=`` other than ``"fp32"`` keeps them compressed instead (bf16, or 8-/4-bit
blockwise codes with per-block scales: ``quant.py``, ``compressed.py``), expanded only inside the
update. ``step()`` snapshots hyper-parameters and gradients and returns; the next
forward's fetch of unit ``u`` waits for unit ``u``'s update only (``core/readiness.py``).

NOTE: it subclasses ``torch.optim.Optimizer`` so that HF's LR schedulers, ``zero_grad`` and
``state_dict`` work unchanged; its ``state_dict`` has the layout of ``torch.optim.AdamW``'s.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections import defaultdict

import torch

from ..errors import AttachedModelError, BackgroundWorkerError, MegatrainConfigError, UsageError
from ..core.layout import Entry, Kind
from ..core.readiness import zero_grad_after
from ..core.store import HostStore, unfrozen_error
from ..core.workers import start_worker
from .compressed import CompressedMoments
from .disk_engines import CHOICES as DISK_IO_CHOICES
from .kernels import GroupWork, UnitJob, native_update, torch_update
from .moment_formats import format_of
from .state_io import AdamWStateIO

logger = logging.getLogger(__name__)

_ADAMW_KEYS = frozenset(
    {"params", "lr", "betas", "eps", "weight_decay", "maximize", "amsgrad", "foreach", "fused", "capturable",
     "differentiable", "decoupled_weight_decay"}
)


class HostAdamW(AdamWStateIO, torch.optim.Optimizer):
    marks_store_dirty = True  # tells the engine's global step hook not to re-stage everything

    def __init__(
        self,
        params,
        store: HostStore,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        maximize: bool = False,
        host_threads: int | None = None,
        kernel: str = "torch",
        device: torch.device | None = None,
        state: str = "fp32",
        offload_dir: str | None = None, offload_window: int | None = None, offload_units=None,
        offload_masters=False,
        disk_io: str = "threads",
    ) -> None:
        if not 0.0 <= eps:
            raise MegatrainConfigError(f"HostAdamW eps={eps}: must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise MegatrainConfigError(f"HostAdamW betas={betas}: each must be in [0, 1)")
        if weight_decay < 0.0:
            raise MegatrainConfigError(f"HostAdamW weight_decay={weight_decay}: must be >= 0")
        if kernel not in ("torch", "native"):
            raise MegatrainConfigError(f"HostAdamW kernel={kernel!r}; allowed: 'torch' or 'native'")
        if disk_io not in DISK_IO_CHOICES:
            raise MegatrainConfigError(
                f"HostAdamW disk_io={disk_io!r}; allowed: {', '.join(map(repr, DISK_IO_CHOICES))}")
        self.store = store
        self.format = format_of(state)  # refuses an unknown format, naming the allowed ones
        self.offload_dir, self.offload_window, self._pager = offload_dir, offload_window, None  # _pager: PagedState
        self._tier = None  # the engine's AttachTier when _pager is its files
        self.disk_io = disk_io  # the tier's I/O engine: optim/disk_engines.py CHOICES
        self._offload_units = None if offload_units is None else frozenset(offload_units)  # None: all units
        # the paged units whose staged fp32 masters are in their files too (True: all; offload_state="all")
        self._offload_masters = offload_masters if isinstance(offload_masters, bool) else frozenset(offload_masters)
        self.master_units: list[int] = []  # (set by _build_state)
        self.device = device if device is not None else torch.device("cpu")  # where the uploads run
        self._native = None
        if kernel == "native":
            from . import native

            self._native = native.host_adamw()  # None (warned) if it cannot be built here
        self.kernel = "native" if self._native is not None else "torch"
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)
        self._build_state()
        self._clip: torch.Tensor | None = None
        self._skip_next = False
        self.skipped_steps = 0  # updates skipped through skip_next_step() (non-finite gradients)
        # time spent in unit updates and the elements they updated (read and reset by take_update_stats)
        self._stats_lock = threading.Lock()
        self._update_s, self._updated_numel = 0.0, 0
        self._cond = threading.Condition()
        self._pending = 0
        self._queue: collections.deque[UnitJob] = collections.deque()
        self._wake: queue.Queue = queue.Queue()
        self._worker = start_worker(self, self._wake, "_drain", host_threads or torch.get_num_threads(),
                                    "megatrain-adamw")

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, store: HostStore, **kwargs) -> "HostAdamW":
        """A HostAdamW with ``optimizer``'s param groups and hyper-parameters (a fresh AdamW)."""
        groups = []
        for g in optimizer.param_groups:
            groups.append(
                {k: g[k] for k in ("params", "lr", "betas", "eps", "weight_decay", "maximize") if k in g}
                | {k: v for k, v in g.items() if k not in _ADAMW_KEYS}
            )
        # defaults too: some schedulers read them (polynomial decay reads defaults["lr"])
        defaults = {k: optimizer.defaults[k] for k in ("lr", "betas", "eps", "weight_decay", "maximize")}
        return cls(groups, store, **defaults, **kwargs)

    @property
    def units(self) -> list[int]:
        """The units this optimizer updates (those holding its parameters), in update order."""
        return list(self._plan)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_plan", None) is not None:
            raise UsageError("HostAdamW does not accept new parameter groups after construction")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ state
    def _build_state(self) -> None:
        plan: dict[int, dict[int, list[Entry]]] = defaultdict(lambda: defaultdict(list))
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                home = self.store.home_of(p)
                if home is not None and home[1].kind is Kind.FROZEN:
                    raise unfrozen_error(self.store.names[home[0]], home[1].name)
                if home is None or home[1].kind is not Kind.TRAINABLE:
                    raise AttachedModelError(
                        f"HostAdamW got a parameter (shape {tuple(p.shape)}) that the megatrain host store "
                        "does not hold as trainable; pass the parameters of the attached model."
                    )
                plan[home[0]][gi].append(home[1])
        # under data parallelism every rank knows all units, and holds the state of its own only
        self.all_units = sorted(plan)
        self._plan = {u: dict(groups) for u, groups in sorted(plan.items()) if self.store.owns(u)}
        self._exp_avg: dict[int, torch.Tensor] = {}
        self._exp_avg_sq: dict[int, torch.Tensor] = {}
        paged = frozenset() if self.offload_dir is None else frozenset(
            u for u in self._plan if self._offload_units is None or u in self._offload_units)  # on disk
        self.moments: CompressedMoments | None = None  # the compressed moments (None: fp32 flats)
        if self.format.mode != "fp32":  # a paged unit's codes and scales live in the disk tier's slots
            self.moments = CompressedMoments(
                self.format, {u: [e for entries in groups.values() for e in entries] for u, groups in self._plan.items()},
                {u: self.store.n_train(u) for u in self._plan}, self.store.allocate, paged)
        # one step counter per parameter, as torch's AdamW: a parameter without a gradient in a
        # step keeps its count (and its bias correction)
        self._steps: dict[tuple[int, int], list[torch.Tensor]] = {}
        specs = {u: self.state_spec(u) for u in self._plan}
        if self.offload_dir is None and self.store.master_files is not None:
            logger.warning("megatrain: the masters of this model are on disk (offload_state='all'), but this HostAdamW "
                           "has no offload_dir: the update reads and writes them through their mapping. Fix: pass "
                           "offload_dir= and offload_masters= as the engine's config has them.")
        if self.offload_dir is not None:
            from .tier_files import tier_layout
            from .paged_state import DEFAULT_WINDOW, PagedState, master_units, move_masters

            masters = master_units(self.store, paged, self._offload_masters)
            layout = tier_layout({u: specs[u] for u in paged}, {u: self.store.n_staged(u) for u in masters})
            window = self.offload_window or DEFAULT_WINDOW
            tier = self.store.master_files  # the files the engine made at attach, the masters already in them
            self._pager = tier.adopt(self, layout, window, self.disk_io) if tier is not None else None
            self._tier = tier if self._pager is not None else None
            if self._pager is None:
                self._pager = PagedState(self.offload_dir, layout, window, disk_io=self.disk_io)
                move_masters(self._pager, self.store, masters)  # (from RAM, or from the attach tier's mapping)
            self.master_units = masters
        for u, groups in self._plan.items():
            if self.moments is None and not self._paged(u):
                self._exp_avg[u] = self.store.allocate(specs[u]["exp_avg"][0], torch.float32).zero_()
                self._exp_avg_sq[u] = self.store.allocate(specs[u]["exp_avg_sq"][0], torch.float32).zero_()
            for gi, entries in groups.items():
                self._steps[(u, gi)] = [torch.zeros((), dtype=torch.float32) for _ in entries]
        self._build_state_views()

    def set_clip_coef(self, coef: torch.Tensor | None) -> None:
        """Multiply the gradients by ``coef`` (< 1: clipping) in the next update, unit by unit,
        exactly as ``torch.nn.utils.clip_grad_norm_`` multiplies them (bitwise-equal results)."""
        self._clip = None if coef is None or float(coef) >= 1.0 else coef.detach().to(torch.float32).cpu()

    def skip_next_step(self) -> None:
        """Make the next ``step()`` a no-op: masters, moments and step counts stay as they are.

        The Trainer integration calls it when the global gradient norm is inf/nan, so that one bad
        batch cannot turn the weights into nan (plain ``torch.optim.AdamW`` would apply it).
        """
        self._skip_next = True

    @torch.no_grad()
    def step(self, closure=None):
        """Snapshot hyper-parameters and gradients now; update unit by unit in the background.

        Returns at once: unit 0 is updated first, and the engine's next fetch of a unit waits for
        that unit only, so the update overlaps the next forward.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        if self.master_units:  # masters written through their mapping since are in the files, not in a slot
            self._pager.forget(self.master_units)
        self.store.ownership.finish_grads(self.store)  # (data parallelism: the owners' sums become means)
        clip, self._clip = self._clip, None
        if self._skip_next:
            self._skip_next = False
            self.skipped_steps += 1
            self._skipped()
            return loss
        if not self._workers_alive():
            self._skipped()
            raise BackgroundWorkerError(
                "HostAdamW worker thread is not running (the optimizer was closed, or the thread ended); "
                "build a new optimizer or restart from the last checkpoint"
            )
        self.store.ownership.step_started(self.store.gates, self.all_units)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no upload still reads a staging flat the update rewrites
        jobs = []  # snapshot everything first: a failure here leaves no unit marked busy
        for u, groups in self._plan.items():
            work = [w for w in (self._snapshot(u, gi, entries, clip) for gi, entries in groups.items()) if w is not None]
            if work:
                jobs.append(UnitJob(u, work))
        self._dispatch(jobs)
        return loss

    def _snapshot(self, u: int, gi: int, entries: list[Entry], clip: torch.Tensor | None) -> GroupWork | None:
        group = self.param_groups[gi]
        updated = [e for e in entries if e.tensor.grad is not None]
        if not updated:
            return None
        states = [self.state[e.tensor] for e in updated]
        lr = group["lr"]
        compressed = None  # fp32; compressed: the entries' states (a paged unit's: bound by paged_in, _bind)
        if self.moments is not None:
            compressed = [] if self._paged(u) else [self.moments.of(u, e) for e in updated]
        return GroupWork(
            entries=updated,
            steps=[s["step"] for s in states],
            params=[e.tensor for e in updated],
            grads=[e.tensor.grad for e in updated],
            exp_avgs=[s["exp_avg"] for s in states] if compressed is None and "exp_avg" in states[0] else [],
            exp_avg_sqs=[s["exp_avg_sq"] for s in states] if compressed is None and "exp_avg" in states[0] else [],
            lr=lr.clone() if isinstance(lr, torch.Tensor) else lr,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            clip=clip,
            compressed=compressed,
            fmt=self.format,
        )

    def _skipped(self) -> None:
        """A step that updates nothing (a subclass frees what it prepared for it)."""

    def _dispatch(self, jobs: list[UnitJob]) -> None:
        """Mark the step's units busy and hand them to the host worker, unit 0 first."""
        for job in jobs:
            self.store.gates.begin_update(job.unit, self._worker)
        with self._cond:
            self._pending += len(jobs)
            self._queue.extend(jobs)
        self._wake.put(True)

    def _drain(self, _wake) -> None:
        """(host worker) Run the queued jobs in order."""
        while True:
            with self._cond:
                if not self._queue:
                    return
                job = self._queue.popleft()
                ahead = [j.unit for j in self._queue if self._paged(j.unit)][: self._pager.ahead if self._pager else 0]
            if self._paged(job.unit) or ahead:
                self._pager.prefetch([job.unit] * self._paged(job.unit) + ahead)  # exact: the order is known
            self._run(job)

    def _run(self, job: UnitJob, on_device: bool = False) -> None:
        """Run one job on this thread and mark its unit ready (with its error, if it failed)."""
        self.store.gates.claim_update(job.unit, threading.current_thread())
        error = None
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"megatrain.update{'_device' if on_device else ''}[{job.unit}]"):
                self._update(job, on_device)
        except BaseException as exc:  # surfaced in the training thread by the next wait
            logger.exception("HostAdamW update of unit %d failed", job.unit)
            error = exc
        finally:
            self._account(job, on_device, time.perf_counter() - start)
            self.store.gates.end_update(job.unit, error)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def _update(self, job: UnitJob, on_device: bool) -> None:
        # with the disk tier the moments' views are in a slot while the update runs
        bind = None if self.moments is None else self._bind
        with self._pager.paged_in(job, bind) if self._paged(job.unit) else contextlib.nullcontext() as master:
            self._update_resident(job, master)

    disk_tier = property(lambda self: self._pager, doc="The PagedState of the moments on disk (None: all in RAM).")

    def _paged(self, u: int) -> bool:
        return self._pager is not None and u in self._pager.units

    def _bind(self, u: int, tensors: dict[str, torch.Tensor], work: GroupWork) -> None:
        """(paged compressed unit) Point ``work`` at its entries' states over the slot's ``tensors``."""
        states = self.moments.views(u, tensors)
        work.compressed = [states[id(e.tensor)] for e in work.entries]

    def _update_resident(self, job: UnitJob, master: torch.Tensor | None = None) -> None:
        """``master``: the unit's staged masters when they are on disk (the slot's copy the update changes)."""
        u = job.unit
        staging_was_fresh = self.store.staging.fresh(u)
        for w in job.work:
            if self._native is not None:
                native_update(self._native, w, [self.store.staging.slice(e) for e in w.entries])
            else:
                torch_update(w)
        self.store.mark_dirty(u)
        if self._native is not None and staging_was_fresh:
            self.store.staging.written(u)  # the kernel wrote the copy of every master it changed
        else:
            self.store.staging.stage(u, master)  # the compute-dtype copy, while the masters are warm in cache

    def _account(self, job: UnitJob, on_device: bool, elapsed: float) -> None:
        with self._stats_lock:
            self._update_s += elapsed
            self._updated_numel += job.numel

    def take_update_stats(self) -> tuple[float, int]:
        """Seconds spent updating units on the host and the elements updated, since the last call."""
        with self._stats_lock:
            out = self._update_s, self._updated_numel
            self._update_s, self._updated_numel = 0.0, 0
        return out

    # ------------------------------------------------------------------ lifetime
    def _workers_alive(self) -> bool:
        return self._worker.is_alive()

    def synchronize(self) -> None:
        """Wait for the background update of the last ``step()``; re-raise its failure."""
        with self._cond:
            while self._pending:
                self._cond.wait(timeout=1.0)
                if not self._workers_alive():
                    raise BackgroundWorkerError("HostAdamW worker thread died")
        self.store.gates.raise_error()
        if self._pager is not None:
            self._pager.flush()  # the write-backs too: the files then hold the step's state

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grad_after(self.synchronize, super().zero_grad, set_to_none)

    def close(self) -> None:
        """Stop the worker thread (after finishing pending updates)."""
        try:
            if self._worker.is_alive():
                self.synchronize()
                self._wake.put(None)
                self._worker.join(timeout=60)
        finally:
            if self._tier is not None:
                self._tier.release(self)  # the engine's files: they hold the masters
            elif self._pager is not None:
                self._pager.close()  # removes the run's directory

    def __del__(self) -> None:
        wake = getattr(self, "_wake", None)
        if wake is not None:
            wake.put(None)


def convertible(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a plain AdamW that HostAdamW reproduces exactly."""
    if type(optimizer) is not torch.optim.AdamW:
        return False
    return all(not g.get("amsgrad", False) and not g.get("differentiable", False) for g in optimizer.param_groups)

"""HostAdamW: AdamW on the host store's flats, unit by unit, in a background thread.

Same math as ``torch.optim.AdamW(fused=True)`` (the Trainer's default ``adamw_torch_fused``): the
same kernel runs on the same tensors, so results are bitwise equal (``kernel="native"``: one pass
over memory with torch's arithmetic op for op, see ``kernels.py``). What differs is where the
state lives: ``exp_avg`` / ``exp_avg_sq`` are one contiguous fp32 flat per unit, laid out like the
unit's master flat, so the update runs unit by unit (unit 0 first) and the state is saved and
loaded per unit. ``state=`` other than ``"fp32"`` keeps them compressed instead (bf16, or 8-/4-bit
blockwise codes with per-block scales: ``moment_formats.py``, ``compressed.py``), expanded only inside the
update. ``step()`` snapshots hyper-parameters and gradients and returns; the next
forward's fetch of unit ``u`` waits for unit ``u``'s update only (``core/readiness.py``).

Composed of three parts: this facade (a ``torch.optim.Optimizer``: groups, hyper-parameters, step
counters, snapshots, ``state_dict``), a :class:`~.moment_store.MomentStore` (the moments' format and
where each unit's live: RAM or the disk tier) and a scheduler running the per-unit update
(:class:`~.update_worker.HostWorker` over :class:`~.update_worker.UnitUpdater`; ``scheduler=`` is the
public hook another schedule plugs into, e.g. ``device_update.py``).

NOTE: it subclasses ``torch.optim.Optimizer`` so that HF's LR schedulers, ``zero_grad`` and
``state_dict`` work unchanged; its ``state_dict`` has the layout of ``torch.optim.AdamW``'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable

import torch

from ..errors import AttachedModelError, BackgroundWorkerError, MegatrainConfigError, UsageError
from ..core.layout import Entry, Kind
from ..core.readiness import zero_grad_after
from ..core.store import HostStore, unfrozen_error
from .disk_engines import CHOICES as DISK_IO_CHOICES
from .kernels import GroupWork, UnitJob, kernel_of
from .moment_formats import format_of
from .moment_store import NO_STATE, MomentStore, NoTier, layout_of
from .update_worker import HostWorker, UnitUpdater

logger = logging.getLogger(__name__)

_ADAMW_KEYS = frozenset(
    {"params", "lr", "betas", "eps", "weight_decay", "maximize", "amsgrad", "foreach", "fused", "capturable",
     "differentiable", "decoupled_weight_decay"}
)


class HostAdamW(torch.optim.Optimizer):
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
        scheduler: Callable[[UnitUpdater, object, int], object] | None = None,
    ) -> None:
        """``scheduler(updater, gates, threads)``: builds what runs the per-unit updates (default
        :class:`~.update_worker.HostWorker`; see ``update_worker.py`` for what it provides)."""
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
        self.device = device if device is not None else torch.device("cpu")  # where the uploads run
        # no upload may still read a staging flat the update rewrites (CUDA: copies in flight)
        device = self.device  # (not self: no reference cycle keeps a dropped optimizer's worker alive)
        self._uploads_done = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else _nothing
        self._kernel = kernel_of(kernel)
        self.kernel = self._kernel.name
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        self._plan: dict[int, dict[int, list[Entry]]] | None = None
        super().__init__(params, defaults)
        self._build_state(offload_dir, offload_window, offload_units, offload_masters, disk_io)
        self._clip: torch.Tensor | None = None
        self._skip_next = False
        self.skipped_steps = 0  # updates skipped through skip_next_step() (non-finite gradients)
        self.updater = UnitUpdater(store, self.moments, self._kernel)
        if store.resident is not None:  # units kept on the device (core/resident.py): updated there
            if scheduler is not None:
                raise UsageError("HostAdamW: this model keeps units resident on the device (resident_units), whose "
                                 "update runs in megatrain's resident scheduler; scheduler= cannot replace it. Fix: "
                                 "leave scheduler unset, or attach with resident_units=0.")
            from .resident_update import ResidentWorker

            scheduler = ResidentWorker.factory(store.resident)
        self.scheduler = (scheduler or HostWorker)(self.updater, store.gates, host_threads or torch.get_num_threads())

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

    @classmethod
    def from_plan(cls, optimizer: torch.optim.Optimizer, store: HostStore, plan, device: torch.device,
                  **kwargs) -> "HostAdamW":
        """:meth:`from_optimizer` with the plan's optimizer section (``plan.OptimizerPlan``, a layer above:
        moment format, kernel, threads); the
        disk tier is the store's (the files the engine made at attach from the plan's disk section)."""
        return cls.from_optimizer(optimizer, store, host_threads=plan.threads, kernel=plan.kernel, device=device,
                                  state=plan.moments.mode, **kwargs)

    @property
    def units(self) -> list[int]:
        """The units this optimizer updates (those holding its parameters), in update order."""
        return list(self._plan)

    def groups_of(self, u: int) -> dict[int, list[Entry]]:
        """Unit ``u``'s entries this optimizer updates, by param group index."""
        return self._plan[u]

    def step_counters(self, u: int, gi: int) -> list[torch.Tensor]:
        """The step counts of unit ``u``'s entries of param group ``gi`` (as :meth:`groups_of` orders them)."""
        return self._steps[(u, gi)]

    def add_param_group(self, param_group: dict) -> None:
        if self._plan is not None:
            raise UsageError("HostAdamW does not accept new parameter groups after construction")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ state
    def _build_state(self, offload_dir, offload_window, offload_units, offload_masters, disk_io) -> None:
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
        layout = layout_of(self.format, {u: [e for es in groups.values() for e in es] for u, groups in self._plan.items()},
                           {u: self.store.n_train(u) for u in self._plan})
        tier = NoTier()
        files = self.store.tier_files  # the disk tier the engine's plan made at attach
        if offload_dir is None and files is not None:  # this optimizer pages it too: none built on the store misses it
            options = files.options()
            offload_dir, offload_units, offload_masters = (options[k] for k in ("offload_dir", "offload_units",
                                                                                 "offload_masters"))
            offload_window, disk_io = options["offload_window"], options["disk_io"]
        if offload_dir is not None:
            from .tier_files import open_tier

            paged = frozenset(u for u in self._plan if offload_units is None or u in offload_units)  # on disk
            # the paged units whose staged fp32 masters are in their files too (True: all; offload_state="all")
            masters = offload_masters if isinstance(offload_masters, bool) else frozenset(offload_masters)
            tier = open_tier(self, self.store, layout, paged, masters, offload_dir, offload_window, disk_io)
        self.moments = MomentStore(layout, list(self._plan), self.store.allocate, tier)
        # one step counter per parameter, as torch's AdamW: a parameter without a gradient in a
        # step keeps its count (and its bias correction)
        self._steps: dict[tuple[int, int], list[torch.Tensor]] = {
            (u, gi): [torch.zeros((), dtype=torch.float32) for _ in entries]
            for u, groups in self._plan.items() for gi, entries in groups.items()}
        self._build_state_views()

    def _build_state_views(self) -> None:
        """``self.state[p]``: its step counter, and views of its moments where they stay (fp32 in RAM)."""
        for u, groups in self._plan.items():
            persistent = self.moments.persistent(u)
            for gi, entries in groups.items():
                for e, step in zip(entries, self._steps[(u, gi)]):
                    self.state[e.tensor] = {"step": step} | persistent.get(id(e.tensor), NO_STATE).views(e.shape)

    disk_tier = property(lambda self: self.moments.pager, doc="The PagedState of the moments on disk (None: all in RAM).")
    master_units = property(lambda self: self.moments.master_units,
                            doc="The units whose staged fp32 masters are in the disk tier's files.")

    def state_spec(self, u: int) -> dict[str, tuple[int, torch.dtype]]:
        """Unit ``u``'s contiguous state tensors: name -> (elements, dtype); the disk tier pages these as bytes."""
        return self.moments.spec(u)

    @contextlib.contextmanager
    def unit_state(self, u: int, write: bool = False):
        """Unit ``u``'s state tensors, resident while the block runs (no update running: after :meth:`synchronize`);
        ``write=True``: what the block changed is kept (written back when the state is on disk)."""
        with self.moments.unit_state(u, write) as tensors:
            yield tensors
        if write:
            self._scheduler_hook("imported", u)

    def state_dict(self):
        """torch AdamW's layout; compressed moments are expanded to fp32 copies, moments on disk read into RAM
        (either way a full fp32 copy; fp32 moments in RAM are views of the flats)."""
        self.synchronize()
        out = super().state_dict()
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for u, groups in self._plan.items():
            with self.moments.exported(u) as moments:
                for entries in groups.values():
                    for e in entries:
                        m, v = moments[id(e.tensor)]
                        i = index[id(e.tensor)]  # a new dict: torch's holds self.state[p] itself
                        out["state"][i] = out["state"][i] | {"exp_avg": m.view(e.shape), "exp_avg_sq": v.view(e.shape)}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy a saved state into the moments, tensor by tensor, from any device.

        torch's ``load_state_dict`` first builds new tensors for the whole state on the
        parameters' device: a second full copy of the moments (8 bytes/param) in host RAM.
        """
        self.synchronize()
        saved = state_dict["state"]
        # torch validates the groups (sizes, hooks) and maps the saved ids to parameters by position
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        loaded = {p: saved[i] for i, p in zip(ids, params) if i in saved}
        self._build_state_views()
        for u, groups in self._plan.items():
            with self.moments.assigned(u) as states:  # in RAM, or in a slot written back after
                for gi, entries in groups.items():
                    for e, step in zip(entries, self._steps[(u, gi)]):
                        src = loaded.get(e.tensor, {})
                        step.fill_(float(src["step"]) if "step" in src else 0.0)
                        for k, key in enumerate(("exp_avg", "exp_avg_sq")):
                            # no saved state: a fresh start, as torch's AdamW would make
                            value = src[key].reshape(e.shape) if key in src else torch.zeros(e.shape)
                            states[id(e.tensor)].assign(k, value)
        self._scheduler_hook("imported", None)

    # ------------------------------------------------------------------ the step
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
        self._finish_update()
        self.moments.before_step()
        self.store.ownership.finish_grads(self.store)  # (data parallelism: the owners' sums become means)
        clip, self._clip = self._clip, None
        if self._skip_next:
            self._skip_next = False
            self.skipped_steps += 1
            self.scheduler.skipped()
            return loss
        if not self.scheduler.alive():
            self.scheduler.skipped()
            raise BackgroundWorkerError(
                "HostAdamW worker thread is not running (the optimizer was closed, or the thread ended); "
                "build a new optimizer or restart from the last checkpoint"
            )
        self.store.ownership.step_started(self.store.gates, self.all_units)
        self._uploads_done()
        jobs = []  # snapshot everything first: a failure here leaves no unit marked busy
        for u, groups in self._plan.items():
            work = [w for w in (self._snapshot(gi, entries, clip) for gi, entries in groups.items()) if w is not None]
            if work:
                jobs.append(UnitJob(u, work))
        self.scheduler.dispatch(jobs)
        return loss

    def _snapshot(self, gi: int, entries: list[Entry], clip: torch.Tensor | None) -> GroupWork | None:
        group = self.param_groups[gi]
        resident = self.store.resident  # a resident unit's gradients are on the device, its .grad None
        grads = [resident.gradient(e) if resident is not None and resident.holds(e) else e.tensor.grad
                 for e in entries]
        updated = [e for e, g in zip(entries, grads) if g is not None]
        if not updated:
            return None
        lr = group["lr"]
        return GroupWork(
            entries=updated,
            steps=[self.state[e.tensor]["step"] for e in updated],
            params=[e.tensor for e in updated],
            grads=[g for g in grads if g is not None],
            lr=lr.clone() if isinstance(lr, torch.Tensor) else lr,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            clip=clip,
            layout=self.moments.layout,
        )

    def take_update_stats(self) -> tuple[float, int]:
        """Seconds spent updating units on the host and the elements updated, since the last call."""
        return self.scheduler.take_update_stats()

    def take_device_numel(self) -> int | None:
        """Elements updated on the compute device since the last call (``device_update``'s share, resident
        units); None when the scheduler updates nothing there."""
        take = getattr(self.scheduler, "take_device_numel", None)
        return take() if take is not None else None

    # ------------------------------------------------------------------ lifetime
    def synchronize(self) -> None:
        """Wait for the background update of the last ``step()``; re-raise its failure. The host flats then
        hold the whole state (resident units' is copied down)."""
        self._finish_update()
        self._scheduler_hook("export")

    def _scheduler_hook(self, name: str, *args) -> None:
        """A scheduler's optional ``export()`` / ``imported(u)`` (state kept elsewhere than the host flats)."""
        hook = getattr(self.scheduler, name, None)
        if hook is not None:
            hook(*args)

    def _finish_update(self) -> None:
        self.scheduler.wait()
        self.store.gates.raise_error()
        self.moments.flush()  # the disk tier's write-backs too: the files then hold the step's state

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grad_after(self._finish_update, super().zero_grad, set_to_none)
        if self.store.resident is not None:  # the resident units' gradients, on the device
            self.store.resident.zero_grad(set_to_none, frozenset(id(p) for g in self.param_groups for p in g["params"]))

    def close(self) -> None:
        """Stop the worker thread (after finishing pending updates)."""
        try:
            if self.scheduler.alive():
                self.synchronize()
            self.scheduler.close()
        finally:
            self.moments.close()  # the disk tier: its files removed, or the engine's released


def _nothing() -> None:
    pass


def convertible(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a plain AdamW that HostAdamW reproduces exactly."""
    if type(optimizer) is not torch.optim.AdamW:
        return False
    return all(not g.get("amsgrad", False) and not g.get("differentiable", False) for g in optimizer.param_groups)

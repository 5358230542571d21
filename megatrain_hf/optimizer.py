"""HostAdamW: AdamW on the host store's flats with torch's fused CPU kernel.

Same math as ``torch.optim.AdamW(fused=True)`` (the Trainer's default ``adamw_torch_fused``):
the same kernel runs on the same tensors, so results are bitwise equal. What differs is where
the state lives: ``exp_avg`` / ``exp_avg_sq`` are one contiguous fp32 flat per unit, laid out
like the unit's master flat, so that the update can run unit by unit (layer 0 first) and the
state can be saved and loaded per unit. After a unit is updated its compute-dtype staging copy
is refreshed while the masters are still warm in cache.

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

from .store import Entry, HostStore
from .workers import start_worker

logger = logging.getLogger(__name__)


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
        asynchronous: bool = True,
        exact_clipping: bool = True,
        host_threads: int | None = None,
        kernel: str = "torch",
        device_update: bool = False,
        grad_sink=None,
        stats=None,
    ) -> None:
        if not 0.0 <= eps:
            raise ValueError(f"HostAdamW eps={eps}: must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"HostAdamW betas={betas}: each must be in [0, 1)")
        if weight_decay < 0.0:
            raise ValueError(f"HostAdamW weight_decay={weight_decay}: must be >= 0")
        self.store = store
        self.asynchronous = asynchronous
        host_threads = host_threads or torch.get_num_threads()
        self.exact_clipping = exact_clipping
        if kernel not in ("torch", "native"):
            raise ValueError(f"HostAdamW kernel={kernel!r}; allowed: 'torch' or 'native'")
        self._native = None
        if kernel == "native":
            from . import native

            self._native = native.host_adamw()  # None (warned) if it cannot be built here
        self.kernel = "native" if self._native is not None else "torch"
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)
        self._build_state()
        self._grad_scale: tuple | None = None
        self._skip_next = False
        self.skipped_steps = 0  # updates skipped through skip_next_step() (non-finite gradients)
        # time spent in unit updates and the elements they updated (read and reset by take_update_stats)
        self._update_stats_lock = threading.Lock()
        self._update_s, self._updated_numel = 0.0, 0
        self._device_numel = 0  # ... of them updated on the compute device (device_update)
        self.kept_grad_units = 0  # device updates that read gradients the sink kept on the device
        # device_update: a second worker updates a share of a step's units on the store's compute
        # device while the host worker updates the rest, both in forward order (the next forward
        # follows them), the split set by the two workers' measured rates (elements per second of
        # each, last step); a worker done with its own units takes the other's last ones.
        self.device_update = bool(device_update) and asynchronous
        self.device_share = DEVICE_SHARE_START  # fraction of a step's elements given to the device
        self._rates: dict[str, list[float]] = {"host": [0, 0.0], "device": [0, 0.0]}  # elements, seconds
        self._grad_sink = grad_sink if self.device_update else None  # keeps the device's units' gradients
        self._stats = stats  # an EngineStats: the link bytes of the device's share are counted there
        self._link_bytes = (0, 0)  # ... as they accumulate (h2d, d2h), handed over at the next step()
        self._device_stream = self._device_down = None
        if self.device_update and store.device.type == "cuda":
            self._device_stream = torch.cuda.Stream(store.device)  # state up, the update
            self._device_down = torch.cuda.Stream(store.device)  # state down, beside the next piece going up
        self._device_worker = None
        if asynchronous:
            self._jobs: queue.Queue = queue.Queue()
            self._cond = threading.Condition()
            self._pending = 0
            self._worker = start_worker(self, self._jobs, "_serve_one", host_threads, "megatrain-adamw")
            self._host_list: collections.deque = collections.deque()  # a step's jobs for the host worker
            self._device_list: collections.deque = collections.deque()  # ... and for the device worker
            if self.device_update:
                self._device_jobs: queue.Queue = queue.Queue()
                self._device_worker = start_worker(self, self._device_jobs, "_drain_device", host_threads,
                                                   "megatrain-adamw-device")  # (torch's thread count is per process)

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

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_plan", None) is not None:
            raise RuntimeError("HostAdamW does not accept new parameter groups after construction")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ state
    def _build_state(self) -> None:
        plan: dict[int, dict[int, list[Entry]]] = defaultdict(lambda: defaultdict(list))
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                home = self.store.home_of(p)
                if home is None or home[1].kind != "trainable":
                    raise ValueError(
                        f"HostAdamW got a parameter (shape {tuple(p.shape)}) that the megatrain host store "
                        "does not hold as trainable; pass the parameters of the attached model."
                    )
                plan[home[0]][gi].append(home[1])
        self._plan = {u: dict(groups) for u, groups in sorted(plan.items())}
        self._exp_avg: dict[int, torch.Tensor] = {}
        self._exp_avg_sq: dict[int, torch.Tensor] = {}
        # one step counter per parameter, as torch's AdamW: a parameter without a gradient in a
        # step keeps its count (and its bias correction)
        self._steps: dict[tuple[int, int], list[torch.Tensor]] = {}
        for u, groups in self._plan.items():
            numel = self.store.buffers[u].master_host.numel()
            self._exp_avg[u] = self.store.allocate(numel, torch.float32).zero_()
            self._exp_avg_sq[u] = self.store.allocate(numel, torch.float32).zero_()
            for gi, entries in groups.items():
                self._steps[(u, gi)] = [torch.zeros((), dtype=torch.float32) for _ in entries]
        self._build_state_views()

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy a saved state into the host flats, tensor by tensor, from any device.

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
            for gi, entries in groups.items():
                for e, step in zip(entries, self._steps[(u, gi)]):
                    src = loaded.get(e.tensor, {})
                    step.fill_(float(src["step"]) if "step" in src else 0.0)
                    for key in ("exp_avg", "exp_avg_sq"):
                        if key in src:
                            self.state[e.tensor][key].copy_(src[key].reshape(e.shape))
                        else:  # no saved state: a fresh start, as torch's AdamW would make
                            self.state[e.tensor][key].zero_()

    def _build_state_views(self) -> None:
        for u, groups in self._plan.items():
            for gi, entries in groups.items():
                for e, step in zip(entries, self._steps[(u, gi)]):
                    self.state[e.tensor] = {
                        "step": step,
                        "exp_avg": self._exp_avg[u][e.offset : e.offset + e.numel].view(e.shape),
                        "exp_avg_sq": self._exp_avg_sq[u][e.offset : e.offset + e.numel].view(e.shape),
                    }

    # ------------------------------------------------------------------ update
    def set_clip_coef(self, coef: torch.Tensor | None) -> None:
        """Scale the gradients by ``coef`` (< 1: clipping) in the next update, unit by unit.

        ``exact_clipping`` multiplies the gradients first, exactly as
        ``torch.nn.utils.clip_grad_norm_`` does (bitwise-equal results); otherwise the fused
        kernel divides by ``1 / coef`` on the fly, saving one pass over the gradients at the
        price of a last-bit difference.
        """
        if coef is None or float(coef) >= 1.0:
            self._grad_scale = None
        elif self.exact_clipping or self._native is not None:  # native: the multiply is free
            self._grad_scale = ("mul", coef.detach().to(torch.float32).cpu())
        else:
            self._grad_scale = ("div", torch.reciprocal(coef.detach().to(torch.float32).cpu()))

    def skip_next_step(self) -> None:
        """Make the next ``step()`` a no-op: masters, moments and step counts stay as they are.

        The Trainer integration calls it when the global gradient norm is inf/nan, so that one bad
        batch cannot turn the weights into nan (plain ``torch.optim.AdamW`` would apply it).
        """
        self._skip_next = True

    @torch.no_grad()
    def step(self, closure=None):
        """Snapshot hyper-parameters and gradients now, update unit by unit in the background.

        Returns at once when ``asynchronous``: unit 0 is updated first, and the engine's next
        fetch of a unit waits for that unit only, so the update overlaps the next forward.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        grad_scale, self._grad_scale = getattr(self, "_grad_scale", None), None
        if self._skip_next:
            self._skip_next = False
            self.skipped_steps += 1
            if self._grad_sink is not None:
                self._grad_sink.take_device_grads()  # this step's copies: not needed, freed
            return loss
        if self.asynchronous and not self._workers_alive():
            if self._grad_sink is not None:
                self._grad_sink.drop_device_grads()
            raise RuntimeError(
                "HostAdamW worker thread is not running (the optimizer was closed, or the thread ended); "
                "build a new optimizer or restart from the last checkpoint"
            )
        if self.store.device.type == "cuda":
            # no upload still reads a staging buffer, and the gradients kept on the device (made on
            # the grad and compute streams) are complete before the device stream reads them
            torch.cuda.synchronize(self.store.device)
        if self._stats is not None:  # what the device's share moved in the last update (its pieces all landed)
            with self._update_stats_lock:
                (h2d, d2h), self._link_bytes = self._link_bytes, (0, 0)
            self._stats.update_h2d_bytes += h2d
            self._stats.update_d2h_bytes += d2h
        kept = self._grad_sink.take_device_grads() if self._grad_sink is not None else {}
        jobs = []  # snapshot and plan everything first: a failure here leaves no unit marked busy
        for u, groups in self._plan.items():
            work = [self._snapshot(u, gi, entries, grad_scale) for gi, entries in groups.items()]
            work = [w for w in work if w is not None]
            if work:
                jobs.append((u, work, kept.pop(u, None)))
        del kept  # gradients kept for units without an update now: freed
        device_jobs, host_jobs = self._assign(jobs) if self.device_update else ([], jobs)
        if self.device_update:
            # the host's jobs drop their kept gradients, except the last two, which the device may take
            host_jobs = [(u, w, k if i >= len(host_jobs) - 2 else None) for i, (u, w, k) in enumerate(host_jobs)]
        if self._grad_sink is not None:  # the next step's split will be much the same: keep those gradients
            self._grad_sink.keep_on_device = self._keep_set(device_jobs)
        worker = self._worker if self.asynchronous else None
        for u, *_ in jobs:
            self.store.begin_update(u, worker)
        if not self.asynchronous:
            for job in jobs:
                self._run_job(job)
            self.store.raise_error()
            return loss
        with self._cond:
            self._pending += len(jobs)
            self._device_list.extend(device_jobs)
            self._host_list.extend(host_jobs)
        self._jobs.put(_DRAIN)  # each worker: its own units in order, then the other's from the last
        if self._device_worker is not None:
            self._device_jobs.put(_DRAIN)
        return loss

    def _keep_set(self, device_jobs: list) -> frozenset[int]:
        """Units whose gradients the sink keeps on the device for the next step: the device's, first
        units first (their gradients come last in backward and go first in the update, so they
        live shortest), up to ``KEEP_DEVICE_FRACTION`` of the device's memory."""
        if self.store.device.type == "cuda":
            limit = KEEP_DEVICE_FRACTION * torch.cuda.get_device_properties(self.store.device).total_memory
        else:
            limit = float("inf")
        keep, size = [], 0
        for u, work, _ in device_jobs:
            size += 4 * _numel(work)
            if size > limit:
                break
            keep.append(u)
        return frozenset(keep)

    def _assign(self, jobs: list) -> tuple[list, list]:
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
            size = _numel(job[1])
            device_done = device_free + size / self.device_share
            host_done = host_free + size / (1.0 - self.device_share)
            if device_done < host_done:
                device.append(job)
                device_free = device_done
            else:
                host.append(job)
                host_free = host_done
        return device, host

    def _snapshot(self, u: int, gi: int, entries: list[Entry], grad_scale) -> tuple | None:
        group = self.param_groups[gi]
        params, grads, exp_avgs, exp_avg_sqs, steps, updated = [], [], [], [], [], []
        for e in entries:
            p = e.tensor
            if p.grad is None:
                continue
            updated.append(e)
            state = self.state[p]
            steps.append(state["step"])
            params.append(p)
            grads.append(p.grad)  # the tensor itself: zero_grad() may drop p.grad meanwhile
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
        if not params:
            return None
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        hyper = dict(
            lr=lr.clone() if isinstance(lr, torch.Tensor) else lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )
        return steps, params, grads, exp_avgs, exp_avg_sqs, hyper, grad_scale, updated

    def take_update_stats(self) -> tuple[float, int]:
        """Seconds spent updating units and the elements updated since the last call."""
        with self._update_stats_lock:
            out = self._update_s, self._updated_numel
            self._update_s, self._updated_numel = 0.0, 0
        return out

    def take_device_numel(self) -> int:
        """Elements updated on the compute device (``device_update``) since the last call."""
        with self._update_stats_lock:
            out, self._device_numel = self._device_numel, 0
        return out

    def _run_job(self, job, on_device: bool = False) -> None:
        u, work, kept = job
        error = None
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"megatrain.update{'_device' if on_device else ''}[{u}]"):
                if on_device:
                    self._run_on_device(u, work, kept)
                elif self._native is not None:
                    self._run_native(u, work)
                else:
                    for steps, params, grads, exp_avgs, exp_avg_sqs, hyper, grad_scale, _ in work:
                        torch._foreach_add_(steps, 1)
                        torch._fused_adamw_(
                            params, grads, exp_avgs, exp_avg_sqs, [], steps,
                            amsgrad=False, grad_scale=_apply_clip(grads, grad_scale), found_inf=None, **hyper,
                        )
                    self.store.mark_dirty(u)
                    self.store.stage(u)  # the compute-dtype copy, while the masters are warm
        except BaseException as exc:  # surfaced in the training thread by the next wait
            logger.exception("HostAdamW update of unit %d failed", u)
            error = exc
        finally:
            numel = _numel(work)
            elapsed = time.perf_counter() - start
            with self._update_stats_lock:
                if on_device:  # runs beside the host's updates: its time is not the host's
                    self._device_numel += numel
                else:
                    self._update_s += elapsed
                    self._updated_numel += numel
                rate = self._rates["device" if on_device else "host"]
                rate[0] += numel
                rate[1] += elapsed
            self.store.end_update(u, error)

    def _run_native(self, u: int, work: list) -> None:
        """The update with the native kernel: clip multiply, AdamW and the staging copy in one pass."""
        import math

        from . import native

        staging_was_fresh = self.store.staging_fresh(u)
        staging = self.store.buffers[u].staging_host
        for steps, params, grads, exp_avgs, exp_avg_sqs, hyper, grad_scale, entries in work:
            torch._foreach_add_(steps, 1)
            lr = float(hyper["lr"])
            beta1, beta2, wd, eps = hyper["beta1"], hyper["beta2"], hyper["weight_decay"], hyper["eps"]
            scalars: dict[str, list[float]] = {k: [] for k in ("decay", "lerp", "beta2", "sq_coef", "bc2_sqrt", "eps",
                                                                "neg_step_size")}
            for step in steps:
                n = float(step)
                scalars["decay"].append(1 - lr * wd if wd != 0 else 1.0)
                scalars["lerp"].append(1 - beta1)
                scalars["beta2"].append(beta2)
                scalars["sq_coef"].append(1 - beta2)
                scalars["bc2_sqrt"].append(math.sqrt(1 - beta2**n))
                scalars["eps"].append(eps)
                scalars["neg_step_size"].append(-(lr / (1 - beta1**n)))
            stages = [_stage_of(staging, e) for e in entries]
            clip = float(grad_scale[1]) if grad_scale is not None else 1.0
            native.adamw(self._native, params, grads, exp_avgs, exp_avg_sqs, stages, scalars, clip,
                         bool(hyper["maximize"]), torch.get_num_threads())
        self._updated(u, staging_was_fresh)

    def _updated(self, u: int, staging_was_fresh: bool) -> None:
        """Unit ``u``'s masters changed, by an update that also wrote the compute-dtype copy of every
        master it changed: that copy is fresh if it was before, else it is refreshed now."""
        self.store.mark_dirty(u)
        if staging_was_fresh:
            self.store.staging_written(u)
        else:
            self.store.stage(u)

    def _serve_one(self, token) -> None:
        self._drain(on_device=False)

    def _drain_device(self, token) -> None:
        self._drain(on_device=True)

    def _drain(self, on_device: bool, take_others: bool = True) -> None:
        """Run the step's jobs: this worker's own list in order, then (``take_others``) the other
        worker's from its last job backwards (the units the next forward needs last), until none is left."""
        own, other = (self._device_list, self._host_list) if on_device else (self._host_list, self._device_list)
        while True:
            with self._cond:
                if own:
                    job = own.popleft()
                elif other and take_others:
                    job = other.pop()
                else:
                    return
            self.store.claim_update(job[0], threading.current_thread())
            try:
                self._run_job(job, on_device=on_device)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _run_on_device(self, u: int, work: list, kept: dict[int, torch.Tensor] | None = None) -> None:
        """The update of unit ``u`` on the compute device, in pieces of at most ``DEVICE_UPDATE_CHUNK``
        elements (AdamW is elementwise): masters and moments go up (the gradients too, unless the
        gradient sink kept them on the device: ``kept``, offset -> flat fp32 sum), torch's fused AdamW
        runs there (on CUDA its CUDA kernel: same formula, last-bit differences from the host
        kernel), masters, moments and the compute-dtype copy come back down on a second stream while
        the next piece goes up. The clip scale applies to the device's gradients only (as with the
        native kernel, ``param.grad`` is left as it is)."""
        device = self.store.device
        cuda = device.type == "cuda"
        staging_was_fresh = self.store.staging_fresh(u)
        staging = self.store.buffers[u].staging_host
        up_stream, down_stream = self._device_stream, self._device_down
        queued: collections.deque = collections.deque()  # pieces whose state is on its way down

        def up(tensors):
            return [t.to(device, non_blocking=True) if cuda else t.clone() for t in tensors]

        def run(batch, hyper, grad_scale):
            steps = [b[0] for b in batch]
            hp, hg, hm, hv = ([b[i] for b in batch] for i in range(1, 5))
            with torch.cuda.stream(up_stream) if cuda else contextlib.nullcontext():
                dp, dm, dv = up(hp), up(hm), up(hv)
                dg = [g if on_dev else up([g])[0] for g, on_dev in zip(hg, (b[5] for b in batch))]
                divide_by = _apply_clip(dg, grad_scale)
                torch._fused_adamw_(dp, dg, dm, dv, [], up(steps), amsgrad=False, grad_scale=divide_by,
                                    found_inf=None, **hyper)
                if not cuda:
                    for host, dev in zip([*hp, *hm, *hv], [*dp, *dm, *dv]):
                        host.copy_(dev)
                    for b, dev in zip(batch, dp):
                        if b[6] is not None:
                            b[6].copy_(dev.to(b[6].dtype))
                    return
                for g, on_dev in zip(dg, (b[5] for b in batch)):
                    if on_dev:  # allocated by the gradient sink's streams, read here
                        g.record_stream(up_stream)
                updated = torch.cuda.Event()
                updated.record(up_stream)
            down_stream.wait_event(updated)
            with torch.cuda.stream(down_stream):
                for host, dev in zip([*hp, *hm, *hv], [*dp, *dm, *dv]):
                    host.copy_(dev, non_blocking=True)
                    dev.record_stream(down_stream)  # allocated on the up stream, read here
                for b, dev in zip(batch, dp):
                    if b[6] is not None:
                        b[6].copy_(dev.to(b[6].dtype), non_blocking=True)
                landed = torch.cuda.Event(blocking=True)  # waited for below: sleep, do not spin a core
                landed.record(down_stream)
            numel = sum(p.numel() for p in hp)
            sent_grads = sum(g.numel() for g, b in zip(hg, batch) if not b[5])
            staged = sum(b[6].numel() * b[6].element_size() for b in batch if b[6] is not None)
            with self._update_stats_lock:
                h2d, d2h = self._link_bytes
                self._link_bytes = (h2d + 12 * numel + 4 * sent_grads, d2h + 12 * numel + staged)
            queued.append(landed)
            while len(queued) > 2:  # at most three pieces' state on the device at once
                queued.popleft().synchronize()

        try:
            for steps, params, grads, exp_avgs, exp_avg_sqs, hyper, grad_scale, entries in work:
                torch._foreach_add_(steps, 1)
                batch, size = [], 0
                for step, p, g, m, v, e in zip(steps, params, grads, exp_avgs, exp_avg_sqs, entries):
                    on_dev = kept is not None and e.offset in kept
                    flats = [t.detach().reshape(-1) for t in (p, kept[e.offset] if on_dev else g, m, v)]
                    stage = _stage_of(staging, e)
                    for lo in range(0, e.numel, DEVICE_UPDATE_CHUNK):
                        hi = min(lo + DEVICE_UPDATE_CHUNK, e.numel)
                        if batch and size + hi - lo > DEVICE_UPDATE_CHUNK:
                            run(batch, hyper, grad_scale)
                            batch, size = [], 0
                        batch.append((step, *(f[lo:hi] for f in flats), on_dev,
                                      stage[lo:hi] if stage is not None else None))
                        size += hi - lo
                if batch:
                    run(batch, hyper, grad_scale)
        finally:
            if cuda:  # the host flats hold the result (or nothing is still writing them) before the unit is ready
                for stream in (up_stream, down_stream):
                    done = torch.cuda.Event(blocking=True)
                    done.record(stream)
                    done.synchronize()
        if kept:
            with self._update_stats_lock:
                self.kept_grad_units += 1
        self._updated(u, staging_was_fresh)

    def __del__(self) -> None:
        for name in ("_jobs", "_device_jobs"):
            jobs = getattr(self, name, None)
            if jobs is not None:
                jobs.put(None)

    def _workers_alive(self) -> bool:
        return self._worker.is_alive() and (self._device_worker is None or self._device_worker.is_alive())

    def synchronize(self) -> None:
        """Wait for the background update of the last ``step()``; re-raise its failure."""
        if self.asynchronous:
            with self._cond:
                while self._pending:
                    self._cond.wait(timeout=1.0)
                    if not self._workers_alive():
                        raise RuntimeError("HostAdamW worker thread died")
        self.store.raise_error()

    def state_dict(self):
        self.synchronize()
        return super().state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:
            self.synchronize()  # the running update reads these gradient buffers in place
        super().zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Stop the worker thread (after finishing pending updates)."""
        if self._grad_sink is not None:
            self._grad_sink.drop_device_grads()
        if self.asynchronous and self._worker.is_alive():
            self.synchronize()
            self._jobs.put(None)
            self._worker.join(timeout=60)
        if self._device_worker is not None and self._device_worker.is_alive():
            self._device_jobs.put(None)
            self._device_worker.join(timeout=60)


def _stage_of(staging: torch.Tensor | None, e: Entry) -> torch.Tensor | None:
    """Entry ``e``'s slice of its unit's compute-dtype staging copy (None: no copy, or sent in fp32)."""
    return staging[e.offset : e.offset + e.numel] if staging is not None and e.wire != torch.float32 else None


def _numel(work: list) -> int:
    """Elements a unit's job updates (its snapshots' parameters)."""
    return sum(p.numel() for w in work for p in w[1])


def _apply_clip(grads: list[torch.Tensor], grad_scale) -> torch.Tensor | None:
    """The clip coefficient of a step on ``grads``: ``("mul", c)`` multiplies them in place (exact
    clipping, as ``clip_grad_norm_``); ``("div", d)`` is returned for the fused kernel to divide by."""
    if grad_scale is None:
        return None
    how, value = grad_scale
    value = value.to(grads[0].device) if grads else value
    if how == "mul":
        torch._foreach_mul_(grads, value)
        return None
    return value


_DRAIN = object()  # "run the step's jobs"
KEEP_DEVICE_FRACTION = 0.1
"""device_update: at most this fraction of the device's memory holds gradients kept for its share
(the rest of its units' gradients go up the link again)."""
DEVICE_SHARE_START = 0.35
"""device_update: the device's share of the update rate in the first step (later: measured)."""
DEVICE_UPDATE_CHUNK = 1 << 25
"""device_update: elements per piece sent up (32 M: ~0.6 GB of GPU memory with their gradients,
moments and bf16 copy), so a large unit (an untied lm_head) never needs all its state on the GPU."""

_ADAMW_KEYS = frozenset(
    {"params", "lr", "betas", "eps", "weight_decay", "maximize", "amsgrad", "foreach", "fused", "capturable",
     "differentiable", "decoupled_weight_decay"}
)


def convertible(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a plain AdamW that HostAdamW reproduces exactly."""
    if type(optimizer) is not torch.optim.AdamW:
        return False
    return all(not g.get("amsgrad", False) and not g.get("differentiable", False) for g in optimizer.param_groups)

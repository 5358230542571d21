"""Gradient sink: a unit's device gradients into the fp32 host accumulators, off the critical path.

On CUDA, ``submit`` copies the unit's gradients (as fp32) to the host on the grad stream,
overlapping the backward of the next unit: straight into the unit's pinned fp32 ``grad_host``
when this is the step's first contribution, else into one of a few pinned *slabs* that a worker
thread adds into ``grad_host``. The worker also points ``param.grad`` at the accumulators and, on
the last micro-batch of an optimizer step, records the per-tensor gradient norms so that the
global norm is known when backward ends. The slab pool bounds the pinned memory and provides
back-pressure. ``wait()`` is queued at the end of every backward pass, so when
``loss.backward()`` returns, every ``param.grad`` is complete, as in plain PyTorch.

In a layer-major group (:mod:`megatrain_hf.layer_major`) the micro-batches' gradients of a unit
are first summed on the device in fp32 and sent once, when the unit's last backward call of the
group has run.

On the CPU the same work runs inline.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterable

import torch

from .store import Entry, HostStore
from .workers import start_worker

logger = logging.getLogger(__name__)

GRAD_SLABS = 3
"""Pinned fp32 slabs a CUDA gradient pipeline allocates (the memory plan counts them)."""


def slab_numel(unit_numels: Iterable[int]) -> int:
    """Elements of one gradient slab: the largest unit's trainable elements. A slab mirrors a
    unit's master layout (matrices, then fp32 vectors / embedding), so any unit's gradients land
    at their own offsets."""
    return max(unit_numels, default=0)


class GradSink:
    def __init__(self, store: HostStore, device: torch.device, stats, num_slabs: int = GRAD_SLABS,
                 host_threads: int = 1) -> None:
        self.host_threads = host_threads
        self.store = store
        self.device = device
        self.stats = stats
        self.final_microbatch: Callable[[], bool] = lambda: True  # set by integrations (GA hint)
        self.norms: list[tuple | None] = [None] * len(store.entries)  # (grad key, per-tensor norms)
        self._foreign: dict[int, list] = {}  # owner unit -> tied-weight gradients waiting for it
        self._pending_calls: list[int] | None = None  # layer-major group: backward calls still to come
        self._held: dict[int, dict] = {}  # layer-major group: owner -> {offset: (entry, fp32 device sum)}
        # units whose backward can add into an owner's gradients (itself; lm_head for a tied embedding)
        self._contributors: list[set[int]] = [set() for _ in store.entries]
        for u, unit_entries in enumerate(store.entries):
            for e in unit_entries:
                if e.kind == "trainable":
                    self._contributors[e.owner].add(u)
        self._error: BaseException | None = None
        self._pending = 0
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        if device.type == "cuda":
            self._start_cuda(num_slabs)

    # ------------------------------------------------------------------ setup
    def _start_cuda(self, num_slabs: int) -> None:
        self.stream = torch.cuda.Stream(self.device)
        numel = slab_numel(b.master_host.numel() for b in self.store.buffers if b.master_host is not None)
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(num_slabs):
            # fp32 even for bf16 gradients: the cast runs on the GPU for free, and the host add is
            # then fp32 += fp32 (measured on the H200 host: fp32 += bf16 runs at 1.5 Gelem/s, a
            # bottleneck; see docs/log.md)
            self._free.put(self.store.allocate(numel, torch.float32))
        self._jobs: queue.Queue = queue.Queue()
        self._worker = start_worker(self, self._jobs, "_process", self.host_threads, "megatrain-grads")

    def close(self) -> None:
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=60)
            self._worker = None

    # ------------------------------------------------------------------ layer-major groups
    def begin_group(self) -> None:
        """A layer-major group starts: gradients are summed on the device, sent once per unit."""
        self._pending_calls = [0] * len(self.store.entries)
        self._held = {}

    def count_call(self, u: int) -> None:
        """The group's forward made one more call of unit ``u`` whose backward will submit."""
        self._pending_calls[u] += 1

    def end_group(self) -> None:
        self.drop_held()
        self._pending_calls = None

    def drop_held(self) -> None:
        """Forget device sums of a group whose backward failed (nothing of it reaches the host)."""
        self._held = {}

    def _hold(self, u: int, entries: list[Entry], grads: list[torch.Tensor | None]) -> None:
        """Group mode: add unit ``u``'s gradients into fp32 device sums; send an owner's when complete.

        The sums are per owner unit, so a tied weight's contributions from another unit (lm_head ->
        embedding) join the owner's sum. An owner is sent when no call that contributes to it is
        still to run its backward.
        """
        self._pending_calls[u] -= 1
        owners = set()
        for e, g in zip(entries, grads):
            if g is None:
                continue
            owners.add(e.owner)
            held = self._held.setdefault(e.owner, {})
            if e.offset in held:
                held[e.offset][1].add_(g)  # fp32 += bf16 converts on the fly, exactly
            else:
                held[e.offset] = (e, g.detach().to(torch.float32, copy=True))
        for owner in sorted(owners):
            if all(self._pending_calls[c] <= 0 for c in self._contributors[owner]):
                self._send(owner, list(self._held.pop(owner).values()), want_norm=True)

    def _flush_held(self) -> None:
        """End of a group's backward: send sums whose calls did not all run backward."""
        held, self._held = self._held, {}
        for owner in sorted(held):
            self._send(owner, list(held[owner].values()), want_norm=True)

    # ------------------------------------------------------------------ submit
    def submit(self, u: int, entries: list[Entry], grads: list[torch.Tensor | None]) -> None:
        """Accumulate unit ``u``'s weight gradients (aligned with ``entries``) into the host."""
        self.raise_error()
        if self._pending_calls is not None:
            self._hold(u, entries, grads)
            return
        local, foreign = [], []
        for e, g in zip(entries, grads):
            if g is not None:
                (local if e.owner == u else foreign).append((e, g))
        for e, g in foreign:
            # A tied weight held by another unit (lm_head -> embedding): keep this contribution on
            # the device and add it to the owner's own gradient when the owner's backward submits,
            # which is what autograd does for a shared parameter (one sum, then one accumulation).
            self._foreign.setdefault(e.owner, []).append((e, g))
        pending = self._foreign.pop(u, [])
        if pending:
            local = self._merge_foreign(local, pending)
        self._send(u, local, want_norm=self.final_microbatch())

    def _send(self, u: int, local: list[tuple[Entry, torch.Tensor]], want_norm: bool) -> None:
        """Unit ``u``'s gradients (owned by ``u``) into its host accumulators."""
        if self._worker is None:
            for e, g in local:
                self.store.accumulate_grad(e, g)
            self.norms[u] = self._unit_norms(u) if want_norm else None
            return
        # First contribution of this step for every tensor: copy straight into the (pinned) host
        # accumulators; otherwise into a slab, added on the host by the worker.
        direct = all(e.tensor.grad is None for e in self.store.entries[u] if e.owner == u and e.kind == "trainable")
        slab = None if direct else self._take_slab()
        grad_host = self.store.buffers[u].grad_host
        norms_host = norms = None
        if direct and want_norm and local:
            # These are the step's whole gradients: their norms (fp32, as of the fp32 .grad that
            # plain training clips) come from the GPU, and the host never reads them again.
            norms = torch.stack(torch._foreach_norm([g for _, g in local], 2, dtype=torch.float32))
            norms_host = torch.empty(norms.shape, dtype=torch.float32, pin_memory=True)
        try:
            start, done = self._copy_down(local, direct, slab, grad_host, norms_host, norms)
        except BaseException:
            if slab is not None:  # e.g. out of memory in the fp32 cast: the pool must not shrink
                self.stream.synchronize()
                self._free.put(slab)
            raise
        with self._cond:
            self._pending += 1
        self.norms[u] = None
        # local (and norms) stay referenced until the worker saw the copies end: the caching
        # allocator must not hand their memory to the compute stream while the grad stream reads it
        self._jobs.put((u, slab, (start, done), local, (norms_host, norms) if norms_host is not None else want_norm))

    def _copy_down(self, local, direct: bool, slab, grad_host, norms_host, norms):
        """Queue the device-to-host copies of one unit on the grad stream; (start, done) events."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # grads are ready there
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)  # when the grad stream begins this unit's copies
            for e, g in local:
                dst = (grad_host if direct else slab)[e.offset : e.offset + e.numel]
                dst.copy_(g.reshape(-1).float(), non_blocking=True)
                self.stats.d2h_bytes += e.numel * 4
            if norms_host is not None:
                norms_host.copy_(norms, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        return start, done

    @staticmethod
    def _merge_foreign(local: list, pending: list) -> list:
        merged = list(local)
        for e, g in pending:
            for i, (le, lg) in enumerate(merged):
                if le.tensor is e.tensor:
                    merged[i] = (le, g.to(lg.dtype) + lg)
                    break
            else:
                merged.append((e, g))
        return merged

    def flush_foreign(self) -> None:
        """Accumulate tied-weight contributions whose owner did not run in this backward."""
        pending, self._foreign = self._foreign, {}
        for owner, items in pending.items():
            for e, g in items:
                self._count(g)
                self.store.accumulate_grad(e, g)
            self.norms[owner] = None

    def _count(self, g: torch.Tensor) -> None:
        if g.device.type != "cpu":
            self.stats.d2h_bytes += g.numel() * g.element_size()

    def _take_slab(self) -> torch.Tensor:
        while True:
            try:
                return self._free.get(timeout=1.0)
            except queue.Empty:
                self.raise_error()
                if self._worker is None or not self._worker.is_alive():
                    raise RuntimeError("megatrain gradient worker is not running") from None

    def __del__(self) -> None:
        jobs = getattr(self, "_jobs", None)
        if jobs is not None:
            jobs.put(None)

    # ------------------------------------------------------------------ worker
    def _process(self, job) -> None:
        u, slab, (start, done), local, want_norm = job
        try:
            done.synchronize()
            self.stats.d2h_busy_s += start.elapsed_time(done) / 1e3  # grad stream busy: effective D2H rate
            grad_host = self.store.buffers[u].grad_host
            for e, _ in local:
                if slab is None:  # copied straight into the accumulator: point .grad at it
                    e.tensor.grad = grad_host[e.offset : e.offset + e.numel].view(e.shape)
                    continue
                self.store.accumulate_grad(e, slab[e.offset : e.offset + e.numel])
            if isinstance(want_norm, tuple):  # computed on the GPU, in local's order
                self.norms[u] = (self._grad_key(u), list(want_norm[0].unbind()))
            elif want_norm:
                self.norms[u] = self._unit_norms(u)
        except BaseException as exc:  # surfaced in the training thread by raise_error()
            logger.exception("gradient accumulation of unit %d failed", u)
            self._error = exc
        finally:
            if slab is not None:
                self._free.put(slab)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    # ------------------------------------------------------------------ results
    def wait(self) -> None:
        """Block until every submitted gradient is in the host accumulators."""
        if self._held:
            self._flush_held()
        if self._foreign:
            self.flush_foreign()
        with self._cond:
            while self._pending:
                self._cond.wait(timeout=1.0)
                if self._worker is not None and not self._worker.is_alive():
                    raise RuntimeError("megatrain gradient worker died")
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"megatrain gradient accumulation failed: {error!r}") from error

    def _grad_key(self, u: int) -> tuple:
        """Identity and version of unit ``u``'s gradients: a cached norm is valid while it holds."""
        grads = [e.tensor.grad for e in self.store.entries[u] if e.owner == u and e.kind == "trainable"]
        return tuple((id(g), g._version) if g is not None else None for g in grads)

    def _unit_norms(self, u: int) -> tuple[tuple, list[torch.Tensor]]:
        grads = [e.tensor.grad for e in self.store.entries[u] if e.owner == u and e.kind == "trainable"]
        present = [g for g in grads if g is not None]
        return self._grad_key(u), (list(torch._foreach_norm(present)) if present else [])

    def global_norm(self) -> torch.Tensor:
        """L2 norm over all host gradients, like ``torch.nn.utils.clip_grad_norm_`` computes it."""
        self.wait()
        norms: list[torch.Tensor] = []
        for u in range(len(self.norms)):
            # recompute when the gradients changed since (a training_step override edited them)
            if self.norms[u] is None or self.norms[u][0] != self._grad_key(u):
                self.norms[u] = self._unit_norms(u)
            norms.extend(self.norms[u][1])
        if not norms:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def reset_norms(self) -> None:
        self.norms = [None] * len(self.norms)



"""Gradient sink: a unit's device gradients into the fp32 host accumulators, off the critical path.

On CUDA, ``submit`` sends the unit's gradients (as fp32) to the host on the grad stream,
overlapping the backward of the next unit. A tensor's first contribution of the optimizer step is
copied straight into its pinned fp32 accumulator (``grad_host``). A later one is added on the
GPU: the accumulator goes up the link, the gradient is added to it there, and the sum comes back
down into ``grad_host`` (the same fp32 addition the host would do, bit for bit, but no host CPU
time and no host memory pass: on the H200 host, adding 6.7 B gradients per micro-batch group on
the CPU, with their norms, took ~2 s a group and capped accumulation at half speed). The
per-tensor norms of what lands in the accumulators are computed on the GPU too, so the global
norm is known when backward ends. A worker thread waits for each unit's copies, points
``param.grad`` at the accumulators and records the norms. ``wait()`` is queued at the end of
every backward pass, so when ``loss.backward()`` returns, every ``param.grad`` is complete, as in
plain PyTorch.

In a layer-major group (:mod:`megatrain_hf.layer_major`) the micro-batches' gradients of a unit
are first summed on the device in fp32 and sent once, when the unit's last backward call of the
group has run.

On the CPU the same work runs inline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import torch

from .store import Entry, HostStore
from .workers import start_worker

logger = logging.getLogger(__name__)

MAX_PENDING_SENDS = 3
"""Units whose gradient transfers may be queued on the grad stream at once. Each keeps its device
gradients alive until its copies end; on the H200, a 7B layer's round trip (accumulator up, sum
down) takes about as long as its backward, and without a bound the queue grew to 20 GiB of GPU
memory by the end of backward (a 24 GiB budget then fit one micro-batch where it fit two)."""


class GradSink:
    def __init__(self, store: HostStore, device: torch.device, stats, host_threads: int = 1) -> None:
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
        # device_update: units whose gradients also stay on the device after their send, so that
        # the device's share of the update need not bring them back up (set by HostAdamW)
        self.keep_on_device: frozenset[int] = frozenset()
        self._kept: dict[int, tuple[tuple, dict[int, torch.Tensor]]] = {}  # unit -> (grad key, {offset: flat})
        self.stale_device_grads = 0  # kept copies found stale when taken (a gradient changed since)
        self._error: BaseException | None = None
        self._pending = 0
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        if device.type == "cuda":
            self._start_cuda()

    # ------------------------------------------------------------------ setup
    def _start_cuda(self) -> None:
        self.stream = torch.cuda.Stream(self.device)
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
            self._send(owner, list(held[owner].values()), want_norm=True, timed=False)

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

    def _send(self, u: int, local: list[tuple[Entry, torch.Tensor]], want_norm: bool, timed: bool = True) -> None:
        """Unit ``u``'s gradients (owned by ``u``) into its host accumulators."""
        before = self._grad_key(u) if u in self.keep_on_device else None  # what kept copies describe
        if self._worker is None:
            for e, g in local:
                self.store.accumulate_grad(e, g)
            self.norms[u] = self._unit_norms(u) if want_norm else None
            if u in self.keep_on_device:  # the "device" is the CPU: a copy of the accumulated sums
                self._keep(u, [(e, e.tensor.grad.detach().reshape(-1).clone()) for e, _ in local], before,
                           self._grad_key(u))
            return
        grad_host = self.store.buffers[u].grad_host
        fresh, added, sent = [], [], []
        merged = self._merge_duplicates(local)
        for e, g in merged:
            grad = e.tensor.grad
            if grad is None:  # the step's first contribution: straight into the accumulator
                fresh.append((e, g))
            elif grad.data_ptr() == grad_host[e.offset :].data_ptr():  # a later one: summed on the GPU
                added.append((e, g))
            else:  # the user replaced .grad with a tensor of their own: add into it, synchronously
                self.store.accumulate_grad(e, g)
                before = None  # and no device copy of this unit's gradients is kept
                continue
            sent.append(e)
        # The GPU knows the whole of each accumulator once every tensor of the unit holding a
        # gradient is in this send; then its norms (fp32, as of the fp32 .grad that plain training
        # clips) come from the GPU, else the worker reads the host accumulators.
        sent_ids = {id(e) for e in sent}
        owned = (e for e in self.store.entries[u] if e.owner == u and e.kind == "trainable")
        whole = len(sent) == len(merged) and all(e.tensor.grad is None or id(e) in sent_ids for e in owned)
        gpu_norms = want_norm and whole and bool(sent)
        waited = time.perf_counter()
        self._wait_pending(MAX_PENDING_SENDS - 1)  # back-pressure: the compute waits for the link
        if timed:  # (wait() times its own flush)
            self.stats.grad_wait_s += time.perf_counter() - waited
        try:
            start, done, norms_host, sums = self._copy_down(fresh, added, grad_host, gpu_norms)
        except BaseException:
            # e.g. out of memory in a cast after some copies were queued: they read `merged`, which
            # must outlive them, and the accumulators they write must be final before anyone reads
            self.stream.synchronize()
            raise
        # .grad points at the accumulator now, in this thread: the next send of this unit (another
        # micro-batch, a flushed group sum) must add to what this one queued, not copy over it;
        # the accumulator is read only after wait(), once the copies landed
        for e, _ in fresh:
            e.tensor.grad = grad_host[e.offset : e.offset + e.numel].view(e.shape)
        key = self._grad_key(u)  # what the norms describe: a later change of .grad invalidates them
        if u in self.keep_on_device:
            if before is None:
                self._kept.pop(u, None)
            else:
                self._keep(u, sums, before, key)
        with self._cond:
            self._pending += 1
        self.norms[u] = None
        # merged (device gradients from the compute stream, among them sums made here, read by the
        # grad stream) stays referenced until the worker saw the copies end: the caching allocator
        # must not hand their memory to the compute stream first. What _copy_down allocated on the
        # grad stream is freed at once: only later work on that same stream can reuse it.
        self._jobs.put((u, key, (start, done), merged, norms_host if gpu_norms else want_norm))

    @staticmethod
    def _merge_duplicates(local: list[tuple[Entry, torch.Tensor]]) -> list[tuple[Entry, torch.Tensor]]:
        """One (entry, gradient) per accumulator region: a tensor listed twice in a unit gets the sum
        of its gradients, as autograd gives a parameter used twice."""
        by_offset: dict[int, int] = {}
        merged: list[tuple[Entry, torch.Tensor]] = []
        for e, g in local:
            i = by_offset.get(e.offset)
            if i is None:
                by_offset[e.offset] = len(merged)
                merged.append((e, g))
            else:
                merged[i] = (merged[i][0], merged[i][1].float() + g.float())
        return merged

    def _copy_down(self, fresh, added, grad_host, gpu_norms: bool):
        """Queue one unit's transfers on the grad stream: ``fresh`` gradients down into the
        accumulators; for ``added`` ones the accumulator up, the gradient added to it, the sum down.
        Returns the (start, done) events and the pinned norms (or None)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # grads are ready there
        norms_host = None
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)  # when the grad stream begins this unit's transfers
            sums = []
            if added:
                acc = torch.empty(sum(e.numel for e, _ in added), dtype=torch.float32, device=self.device)
                offset = 0
                for e, g in added:
                    part = acc[offset : offset + e.numel]
                    offset += e.numel
                    part.copy_(grad_host[e.offset : e.offset + e.numel], non_blocking=True)
                    part.add_(g.reshape(-1))  # fp32 += (bf16 | fp32): the host's fp32 add, on the GPU
                    sums.append((e, part))
                self.stats.h2d_bytes += acc.numel() * 4
                self.stats.grad_stream_bytes += acc.numel() * 4
            for e, g in fresh:
                sums.append((e, g.reshape(-1).float()))  # the cast runs on the GPU for free
            for e, total in sums:
                grad_host[e.offset : e.offset + e.numel].copy_(total, non_blocking=True)
                self.stats.d2h_bytes += e.numel * 4
                self.stats.grad_stream_bytes += e.numel * 4
            if gpu_norms:
                norms = torch.stack(torch._foreach_norm([t for _, t in sums], 2))
                norms_host = torch.empty(norms.shape, dtype=torch.float32, pin_memory=True)
                norms_host.copy_(norms, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        return start, done, norms_host, sums

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

    def __del__(self) -> None:
        jobs = getattr(self, "_jobs", None)
        if jobs is not None:
            jobs.put(None)

    # ------------------------------------------------------------------ worker
    def _process(self, job) -> None:
        u, key, (start, done), _keep, want_norm = job
        try:
            done.synchronize()
            self.stats.grad_stream_busy_s += start.elapsed_time(done) / 1e3  # its effective link rate
            if isinstance(want_norm, torch.Tensor):  # computed on the GPU, as of the send (key)
                self.norms[u] = (key, list(want_norm.unbind()))
            elif want_norm:  # from the host accumulators; valid only if no later send changed them
                self.norms[u] = (key, self._unit_norms(u)[1])
        except BaseException as exc:  # surfaced in the training thread by raise_error()
            logger.exception("gradient accumulation of unit %d failed", u)
            self._error = exc
        finally:
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    # ------------------------------------------------------------------ results
    def wait(self) -> None:
        """Block until every submitted gradient is in the host accumulators."""
        if self._held:
            self._flush_held()
        if self._foreign:
            self._wait_pending(0)  # the owner's own send may still be landing in the same accumulator
            self.flush_foreign()
        self._wait_pending(0)
        self.raise_error()

    def _wait_pending(self, at_most: int) -> None:
        """Block until at most ``at_most`` submitted units are still being transferred."""
        with self._cond:
            while self._pending > at_most:
                self._cond.wait(timeout=1.0)
                if self._worker is not None and not self._worker.is_alive():
                    raise RuntimeError("megatrain gradient worker died")

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

    # ------------------------------------------------------------------ device copies (device_update)
    def _keep(self, u: int, sums: list[tuple[Entry, torch.Tensor]], before: tuple, key: tuple) -> None:
        """Keep unit ``u``'s summed gradients (flat fp32, as sent down) on the device, valid while the
        unit's ``.grad`` keeps ``key`` (a later send, an edit or a replaced ``.grad`` changes it).
        Copies kept by an earlier send of the unit join them only if they still described its
        ``.grad`` just before this send (``before``): a unit sent twice in a step."""
        old_key, held = self._kept.get(u, (None, {}))
        held = dict(held) if old_key == before else {}
        held.update({e.offset: t for e, t in sums})  # the later sums win
        self._kept[u] = (key, held)

    def take_device_grads(self) -> dict[int, dict[int, torch.Tensor]]:
        """The kept device gradients that still equal the host ``.grad`` (unit -> {offset: flat}), once:
        the sink forgets them all. Call after backward's gradients landed (``wait()``)."""
        kept, self._kept = self._kept, {}
        valid = {u: held for u, (key, held) in kept.items() if key == self._grad_key(u)}
        self.stale_device_grads += len(kept) - len(valid)
        return valid

    def drop_device_grads(self) -> None:
        """Keep nothing on the device any more, and free what is kept (the optimizer that collected
        them skipped a step, was closed or replaced)."""
        self.keep_on_device = frozenset()
        self._kept = {}

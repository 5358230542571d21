"""Gradient sink: a unit's device gradients into the host accumulators, off the critical path.

With streams (CUDA), ``submit`` sends the unit's gradients (as fp32; bf16 into a bf16 accumulator,
``grad_home.py``) to the host on the grad stream, overlapping the backward of the next unit. A
tensor's first contribution of the step is copied straight into its pinned accumulator. A later one takes the
*GPU round trip*: the accumulator goes up the link, the gradient is added to it there, and the sum
comes back down (the same fp32 addition the host would do, bit for bit, at no host CPU time). The
per-tensor norms of what lands in the accumulators are computed on the device too, so the global
norm is known when backward ends. A worker thread waits for each unit's copies, points
``param.grad`` at the accumulators and records the norms. ``wait()`` runs at the end of every
backward pass, so when ``loss.backward()`` returns every ``param.grad`` is complete, as in plain
PyTorch. Without streams (the CPU) the same work runs inline.

In a layer-major group (``runtime/layer_major.py``) the micro-batches' gradients of a unit are
first summed on the device in fp32 and sent once, when the unit's last backward call of the group
has run.

Tensor hooks on parameters (``p.register_hook``, ``register_post_accumulate_grad_hook``) run as
autograd runs them: on the parameter's whole gradient of the backward pass (fp32, on the
parameter's device: the host), in registration order, before it is accumulated; the
post-accumulate hooks after. Those parameters take the synchronous host path.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import torch

from ..errors import BackgroundWorkerError
from .layout import Entry, Kind
from .store import HostStore
from .workers import start_worker

logger = logging.getLogger(__name__)

MAX_PENDING_SENDS = 3
"""Units whose gradient transfers may be queued on the grad stream at once. Each keeps its device
gradients alive until its copies end; without a bound the queue grows by a unit's gradients per
layer of backward whenever the link is slower than the backward (see docs/log.md)."""

Sums = list[tuple[Entry, torch.Tensor]]  # (entry, its fp32 gradient sum on the device, flat)


def has_tensor_hooks(param: torch.Tensor) -> bool:
    return bool(param._backward_hooks) or bool(getattr(param, "_post_accumulate_grad_hooks", None))


class GradSink:
    def __init__(self, store: HostStore, stats, streams=None, host_threads: int = 1) -> None:
        self.host_threads = host_threads
        self.store = store
        self.stats = stats
        self.streams = streams
        self.final_microbatch: Callable[[], bool] = lambda: True  # whether norms are wanted (Engine sets it)
        self.norms: list[tuple | None] = [None] * len(store.entries)  # (grad key, per-tensor norms)
        self._foreign: dict[int, list] = {}  # owner unit -> tied-weight gradients waiting for it
        self._pending_calls: list[int] | None = None  # layer-major group: backward calls still to come
        self._held: dict[int, dict] = {}  # layer-major group: owner -> {offset: (entry, fp32 device sum)}
        # units whose backward can add into an owner's gradients (itself; lm_head for a tied embedding)
        self._contributors: list[set[int]] = [set() for _ in store.entries]
        for u in range(len(store.entries)):
            for e in store.entries_of(u, Kind.TRAINABLE):
                self._contributors[e.owner].add(u)
        self._error: BaseException | None = None
        self._pending = 0
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        if streams is not None:
            self.stream = streams.new_stream()
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

    # ------------------------------------------------------------------ layer-major groups
    def begin_group(self) -> None:
        """A layer-major group starts: gradients are summed on the device, sent once per unit."""
        self._pending_calls = [0] * len(self.store.entries)
        self._held = {}

    @property
    def in_group(self) -> bool:
        return self._pending_calls is not None

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
            local = _merge_foreign(local, pending)
        self._send(u, local, want_norm=self.final_microbatch())

    def _send(self, u: int, local: Sums, want_norm: bool, timed: bool = True) -> Sums | None:
        """Unit ``u``'s gradients (owned by ``u``) into its host accumulators.

        Returns the device sums sent down (None when some gradient took the synchronous path, so
        the sums do not describe all of ``.grad``; or without streams)."""
        merged = _merge_duplicates(local)
        hooked = [(e, g) for e, g in merged if has_tensor_hooks(e.tensor)]
        if hooked:
            merged = [(e, g) for e, g in merged if not has_tensor_hooks(e.tensor)]
            for e, g in hooked:
                self._accumulate_hooked(e, g)
        if self.streams is None:
            if u in self.store.remote:  # data parallelism, a unit another rank owns: sent as computed
                self.store.grads_landed(u, {e.offset: g for e, g in merged})
                return None
            for e, g in merged:
                self.store.accumulate_grad(e, g, self.store.entry_name(u, e))
            self.store.grads_landed(u)  # data parallelism: summed into the owner's accumulator
            self.norms[u] = self._unit_norms(u) if want_norm else None
            return None
        fresh, added, replaced = [], [], False
        for e, g in merged:
            if self.store.low_grad(e):  # a bf16 accumulator takes the step's one bf16 gradient only
                self.store.check_single(e, g, self.store.entry_name(u, e))
            if e.tensor.grad is None:  # the step's first contribution: straight into the accumulator
                fresh.append((e, g))
            elif self.store.holds_grad(e):  # a later one: summed on the device
                added.append((e, g))
            else:  # the user replaced .grad with a tensor of their own: add into it, synchronously
                self.store.accumulate_grad(e, g)
                replaced = True
        sent = [e for e, _ in fresh + added]
        # The device knows the whole of each accumulator once every tensor of the unit holding a
        # gradient is in this send; then its norms (fp32, as of the fp32 .grad that plain training
        # clips) come from the device, else the worker reads the host accumulators.
        sent_ids = {id(e) for e in sent}
        owned = self.store.owned_trainable(u)
        whole = not replaced and not hooked and all(e.tensor.grad is None or id(e) in sent_ids for e in owned)
        device_norms = want_norm and whole and bool(sent)
        waited = time.perf_counter()
        self._wait_pending(MAX_PENDING_SENDS - 1)  # back-pressure: the compute waits for the link
        if timed:  # (wait() times its own flush)
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
            e.tensor.grad = self.store.grad_region(e).view(e.shape)
        key = self.grad_key(u)  # what the norms describe: a later change of .grad invalidates them
        with self._cond:
            self._pending += 1
        self.norms[u] = None
        # merged (device gradients from the compute stream, among them sums made here, read by the
        # grad stream) stays referenced until the worker saw the copies end: the caching allocator
        # must not hand their memory to the compute stream first. What _copy_down allocated on the
        # grad stream is freed at once: only later work on that same stream can reuse it.
        self._jobs.put((u, key, events, merged, norms_host if device_norms else want_norm))
        return None if replaced or hooked else sums

    def _accumulate_hooked(self, e: Entry, g: torch.Tensor) -> None:
        """The synchronous host path of a parameter with tensor hooks (see module docstring)."""
        param = e.tensor
        grad = g.detach().to("cpu", self.store.grad_region(e).dtype).view(e.shape)
        for hook in (param._backward_hooks or {}).values():
            result = hook(grad)
            if result is not None:
                grad = result
        if param.grad is not None:
            self._wait_pending(0)  # an earlier send of this step may still be landing in the same region
        self._count(g)
        self.store.accumulate_grad(e, grad, self.store.entry_name(e.owner, e))
        for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(param)

    def _copy_down(self, fresh: Sums, added: Sums, device_norms: bool):
        """Queue one unit's transfers on the grad stream: ``fresh`` gradients down into the
        accumulators; for ``added`` ones the accumulator up, the gradient added to it, the sum down.
        Returns the (start, done) events, the pinned norms (or None) and the sums sent down."""
        streams, store = self.streams, self.store
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
                    part.copy_(store.grad_region(e), non_blocking=True)
                    part.add_(g.reshape(-1))  # fp32 += (bf16 | fp32): the host's fp32 add, on the device
                    sums.append((e, part))
                self.stats.h2d_bytes += acc.numel() * 4
                self.stats.grad_stream_bytes += acc.numel() * 4
            low = {}  # bf16 accumulators: the bf16 gradient itself goes down (the fp32 cast is for the norms)
            for e, g in fresh:
                if store.low_grad(e):
                    low[id(e)] = g.reshape(-1)
                sums.append((e, g.reshape(-1).float()))  # the cast runs on the device for free
            for e, total in sums:
                region = store.grad_region(e)
                region.copy_(low.get(id(e), total), non_blocking=True)
                self.stats.d2h_bytes += e.numel * region.element_size()
                self.stats.grad_stream_bytes += e.numel * region.element_size()
            if device_norms:
                norms = torch.stack(torch._foreach_norm([t for _, t in sums], 2))
                norms_host = streams.pinned(norms.shape, torch.float32)
                norms_host.copy_(norms, non_blocking=True)
            done = streams.record(self.stream, timing=True)
        return (start, done), norms_host, sums

    def flush_foreign(self) -> None:
        """Accumulate tied-weight contributions whose owner did not run in this backward: summed
        first, then accumulated once, the tensor hooks run on that sum (the pass's whole gradient)."""
        pending, self._foreign = self._foreign, {}
        for owner, items in pending.items():
            for e, g in _merge_duplicates(items):
                if has_tensor_hooks(e.tensor):
                    self._accumulate_hooked(e, g)
                    continue
                self._count(g)
                self.store.accumulate_grad(e, g, self.store.entry_name(owner, e))
            self.store.grads_landed(owner)
            self.norms[owner] = None

    def _count(self, g: torch.Tensor) -> None:
        if g.device.type != "cpu":
            self.stats.d2h_bytes += g.numel() * g.element_size()

    # ------------------------------------------------------------------ worker
    def _process(self, job) -> None:
        u, key, (start, done), _merged, want_norm = job
        try:
            done.synchronize()
            self.stats.grad_stream_busy_s += start.elapsed_time(done) / 1e3  # its effective link rate
            self.store.grads_landed(u)  # data parallelism: summed into the owner's accumulator
            if isinstance(want_norm, torch.Tensor):  # computed on the device, as of the send (key)
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
                    raise BackgroundWorkerError("megatrain gradient worker died")

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise BackgroundWorkerError(f"megatrain gradient accumulation failed: {error!r}") from error

    def grad_key(self, u: int) -> tuple:
        """Identity and version of unit ``u``'s gradients: a cached norm is valid while it holds."""
        grads = [e.tensor.grad for e in self.store.owned_trainable(u)]
        return tuple((id(g), g._version) if g is not None else None for g in grads)

    def _unit_norms(self, u: int) -> tuple[tuple, list[torch.Tensor]]:
        present = [e.tensor.grad for e in self.store.owned_trainable(u) if e.tensor.grad is not None]
        # dtype=: a bf16 gradient is cast to fp32 first (vector_norm's documented meaning), as an fp32 .grad
        return self.grad_key(u), (list(torch._foreach_norm(present, 2, dtype=torch.float32)) if present else [])

    def global_norm(self) -> torch.Tensor:
        """L2 norm over all host gradients, like ``torch.nn.utils.clip_grad_norm_`` computes it.

        Under data parallelism: over the owners' gradients (made means first), the ranks' sums of
        squares all-reduced as one scalar."""
        self.wait()
        sharding = self.store.sharding
        if sharding is not None:
            sharding.take_mean(self.store.held_grads())
        norms: list[torch.Tensor] = []
        for u in range(len(self.norms)):
            # recompute when the gradients changed since (a training_step override edited them)
            if self.norms[u] is None or self.norms[u][0] != self.grad_key(u):
                self.norms[u] = self._unit_norms(u)
            norms.extend(self.norms[u][1])
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros(())
        if sharding is not None:
            total = sharding.sum_scalar(total.square()).sqrt()
        return total

    def hooked_parameters(self) -> list[str]:
        """Names of trainable parameters with tensor hooks (they need one backward per micro-batch)."""
        return [f"{self.store.names[u]}.{e.name}" for u in range(len(self.store.entries))
                for e in self.store.owned_trainable(u) if has_tensor_hooks(e.tensor)]


def _merge_duplicates(local: Sums) -> Sums:
    """One (entry, gradient) per accumulator region: a tensor listed twice in a unit gets the sum of
    its gradients, as autograd gives a parameter used twice."""
    by_offset: dict[int, int] = {}
    merged: Sums = []
    for e, g in local:
        i = by_offset.get(e.offset)
        if i is None:
            by_offset[e.offset] = len(merged)
            merged.append((e, g))
        else:
            merged[i] = (merged[i][0], merged[i][1].float() + g.float())
    return merged


def _merge_foreign(local: Sums, pending: Sums) -> Sums:
    merged = list(local)
    for e, g in pending:
        for i, (le, lg) in enumerate(merged):
            if le.tensor is e.tensor:
                merged[i] = (le, g.to(lg.dtype) + lg)
                break
        else:
            merged.append((e, g))
    return merged

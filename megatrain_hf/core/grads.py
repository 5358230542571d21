"""Gradient sink: what each unit's backward sends to its host accumulators, and when.

``submit(u, entries, grads)`` takes a unit's weight gradients from its backward and decides what
is sent: a tensor listed twice gets the sum of its gradients, as autograd gives a parameter used
twice; a tied weight's contribution from another unit (lm_head -> embedding) waits on the device
for its owner's own gradient; in a layer-major group (``runtime/layer_major.py``) the
micro-batches' gradients of a unit are first summed on the device in fp32 and sent once, when the
unit's last backward call of the group has run. A *landing* (``grad_landing.py``: inline on the
CPU, or over the grad stream) moves what is sent into the accumulators and records the norms
(``norms.py``). ``wait()`` runs at the end of every backward pass, so when ``loss.backward()``
returns every ``param.grad`` is complete, as in plain PyTorch.

A resident unit (``resident_units``, ``resident.py``) has no landing: its gradients are added into its
device accumulator on the compute stream (no copy down), its norms recorded as device scalars; its
parameters' ``.grad`` stays None (:meth:`gradients` lists every gradient, those too).

Tensor hooks on parameters (``p.register_hook``, ``register_post_accumulate_grad_hook``) run as
autograd runs them: on the parameter's whole gradient of the backward pass (fp32, on the
parameter's device: the host), in registration order, before it is accumulated; the
post-accumulate hooks after. Those parameters take the synchronous host path.

``global_norm()`` is the L2 norm clipping reads (``clip_grad_norm_``'s), from the recorded norms;
it first finishes the step's gradients (``ownership.finish_grads``: under data parallelism the
owners' sums become means).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..errors import UsageError
from .grad_landing import MAX_PENDING_SENDS, InlineLanding, StreamLanding, Sums
from .layout import Entry, Kind
from .norms import NormBook
from .resident import RESIDENT_GRAD_FIX
from .store import HostStore

logger = logging.getLogger(__name__)

__all__ = ["GradSink", "MAX_PENDING_SENDS", "Sums", "has_tensor_hooks"]

SendListener = Callable[[int, tuple, "Sums | None"], None]  # (unit, its grad key before the send, the sums sent)


def has_tensor_hooks(param: torch.Tensor) -> bool:
    return bool(param._backward_hooks) or bool(getattr(param, "_post_accumulate_grad_hooks", None))


class GradSink:
    """Routes each unit's gradients to its landing (see module docstring). ``streams``: the device's
    streams (None: the compute device is the host, gradients land inline)."""

    def __init__(self, store: HostStore, stats, streams=None, host_threads: int = 1) -> None:
        self.store = store
        self.stats = stats
        self.streams = streams
        self.norm_book = NormBook(store)
        self.landing = (StreamLanding(store, stats, self.norm_book, streams, host_threads) if streams is not None
                        else InlineLanding(store, stats, self.norm_book))
        self.final_microbatch: Callable[[], bool] = lambda: True  # whether norms are wanted (Engine sets it)
        self.send_listeners: list[SendListener] = []  # told of every unit sent (optim/device_update.py)
        self._foreign: dict[int, list] = {}  # owner unit -> tied-weight gradients waiting for it
        self._pending_calls: list[int] | None = None  # layer-major group: backward calls still to come
        self._held: dict[int, dict] = {}  # layer-major group: owner -> {offset: (entry, fp32 device sum)}
        # units whose backward can add into an owner's gradients (itself; lm_head for a tied embedding)
        self._contributors: list[set[int]] = [set() for _ in store.entries]
        for u in range(len(store.entries)):
            for e in store.entries_of(u, Kind.TRAINABLE):
                self._contributors[e.owner].add(u)

    @property
    def norms(self) -> list[tuple | None]:
        """Each unit's recorded (grad key, per-tensor norms), or None."""
        return self.norm_book.norms

    def grad_key(self, u: int) -> tuple:
        return self.norm_book.key(u)

    def close(self) -> None:
        self.landing.close()

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

    def _send(self, u: int, local: Sums, want_norm: bool, timed: bool = True) -> None:
        """Unit ``u``'s gradients (owned by ``u``) to its landing; hooked parameters synchronously."""
        resident = self.store.resident
        if resident is not None and u in resident.grad:
            self._add_resident(u, _merge_duplicates(local), want_norm)
            return
        before = self.norm_book.key(u) if self.send_listeners else None
        merged = _merge_duplicates(local)
        hooked = [(e, g) for e, g in merged if has_tensor_hooks(e.tensor)]
        if hooked:
            merged = [(e, g) for e, g in merged if not has_tensor_hooks(e.tensor)]
            for e, g in hooked:
                self._accumulate_hooked(e, g)
        sums = self.landing.send(u, merged, want_norm, timed)
        for listener in self.send_listeners:  # the sums sent describe all of .grad only without hooked ones
            listener(u, before, None if hooked else sums, merged)

    def _add_resident(self, u: int, merged: Sums, want_norm: bool) -> None:
        """A resident unit's gradients into its device accumulator; its norms on the device."""
        resident = self.store.resident
        for e, g in merged:
            if has_tensor_hooks(e.tensor):
                self._accumulate_hooked(e, g)  # (refused)
            resident.add(e, g, self.store.entry_name(u, e))
        if want_norm:
            self.norm_book.refresh(u)
        else:
            self.norm_book.forget(u)

    def _accumulate_hooked(self, e: Entry, g: torch.Tensor) -> None:
        """The synchronous host path of a parameter with tensor hooks (see module docstring)."""
        param = e.tensor
        if self.store.resident is not None and self.store.resident.holds(e):
            raise UsageError(
                f"megatrain: {self.store.entry_name(e.owner, e)} has tensor hooks, which run on the host "
                "gradient of a parameter, but its unit is kept on the compute device (resident_units), where "
                f"its gradient accumulates without one. {RESIDENT_GRAD_FIX}")
        accumulators = self.store.accumulators
        grad = g.detach().to("cpu", accumulators.region(e).dtype).view(e.shape)
        for hook in (param._backward_hooks or {}).values():
            result = hook(grad)
            if result is not None:
                grad = result
        if param.grad is not None:
            self.landing.wait(0)  # an earlier send of this step may still be landing in the same region
        self._count(g)
        accumulators.accumulate(e, grad, self.store.entry_name(e.owner, e))
        for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(param)

    def flush_foreign(self) -> None:
        """Accumulate tied-weight contributions whose owner did not run in this backward: summed
        first, then accumulated once, the tensor hooks run on that sum (the pass's whole gradient)."""
        pending, self._foreign = self._foreign, {}
        resident = self.store.resident
        for owner, items in pending.items():
            if resident is not None and owner in resident.grad:
                self._add_resident(owner, _merge_duplicates(items), want_norm=False)
                continue
            for e, g in _merge_duplicates(items):
                if has_tensor_hooks(e.tensor):
                    self._accumulate_hooked(e, g)
                    continue
                self._count(g)
                self.store.accumulators.accumulate(e, g, self.store.entry_name(owner, e))
            self.store.ownership.grads_landed(owner)
            self.norm_book.forget(owner)

    def _count(self, g: torch.Tensor) -> None:
        if g.device.type != "cpu":
            self.stats.d2h_bytes += g.numel() * g.element_size()

    # ------------------------------------------------------------------ results
    def wait(self) -> None:
        """Block until every submitted gradient is in the host accumulators."""
        if self._held:
            self._flush_held()
        if self._foreign:
            self.landing.wait(0)  # the owner's own send may still be landing in the same accumulator
            self.flush_foreign()
        self.landing.wait(0)
        self.raise_error()

    def raise_error(self) -> None:
        self.landing.raise_error()

    def finish(self) -> None:
        """The step's gradients are complete and final (every ``.grad`` landed; under data parallelism
        the owners' sums made means): what the norm and the optimizer read. Idempotent within a step."""
        self.wait()
        self.store.ownership.finish_grads(self.store)

    def global_norm(self) -> torch.Tensor:
        """L2 norm over all host gradients, like ``torch.nn.utils.clip_grad_norm_`` computes it.

        Under data parallelism: over the owners' gradients (made means first), the ranks' sums of
        squares all-reduced as one scalar."""
        self.finish()
        return self.norm_book.global_norm()

    def gradients(self) -> list[torch.Tensor]:
        """Every trainable tensor's gradient of this step, in unit order: ``.grad``, or a resident unit's
        device gradient (what clipping multiplies)."""
        resident, out = self.store.resident, []
        for u in range(len(self.store.entries)):
            for e in self.store.owned_trainable(u):
                g = resident.gradient(e) if resident is not None and resident.holds(e) else e.tensor.grad
                if g is not None:
                    out.append(g)
        return out

    def scale_(self, coef: torch.Tensor) -> None:
        """Multiply every gradient by ``coef`` in place (``clip_grad_norm_``'s multiply, per device)."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in self.gradients():
            by_device.setdefault(g.device, []).append(g)
        for device, grads in by_device.items():
            torch._foreach_mul_(grads, coef.to(device))

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

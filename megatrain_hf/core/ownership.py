"""Who holds each unit's state: this process (one rank), or the unit's owner rank (data parallelism).

The components that read masters or land gradients ask an ownership object instead of testing
whether data parallelism is on: :class:`LocalOwnership`, the null object, owns every unit and does
nothing at each of these points; :class:`ShardedOwnership` (``core/sharding.py``'s collectives) owns
the units ``u % world_size == rank`` and, at the same points,

* lays the units another rank owns (``remote``) into receive slots when the store allocates;
* receives a unit's masters from its owner before a fetch reads them (:meth:`before_read`);
* sums a unit's gradients into the owner's accumulator once a backward landed them
  (:meth:`grads_landed`; on the CPU path, :meth:`land` sends a remote unit's as computed, so the
  gradient slot is never written);
* turns the owners' sums into means once per optimizer step (:meth:`finish_grads`, the one place:
  the gradient norm and the optimizer's step both call it, and only the first call of a step divides);
* marks every unit's masters changed when a step starts (:meth:`step_started`: the units another rank
  updates change too), and sums the norm's square over the ranks (:meth:`combine_norm`).
"""

from __future__ import annotations

from typing import Callable

import torch

from .layout import Entry

Landed = list[tuple[Entry, torch.Tensor]]  # (entry, its gradient of this backward)


class LocalOwnership:
    """Every unit is this process's (no data parallelism)."""

    world_size = 1
    rank = 0
    sharding = None  # the collectives (core/sharding.UnitSharding) under data parallelism
    remote: frozenset[int] = frozenset()  # units another rank owns (in receive slots here)
    lands_in_place = True  # the CPU path may compute a gradient into its accumulator (runtime/grads_in_place.py)

    def bind(self, store) -> "LocalOwnership":
        """This ownership for ``store`` (called once the store planned its layout, before it allocates)."""
        return self

    def owns(self, u: int) -> bool:
        return True

    def owner(self, u: int) -> int:
        return self.rank

    def before_read(self, units: list[int], transport) -> None:
        """A fetch reads ``units``' masters next (through ``transport``)."""

    def land(self, u: int, landed: Landed, accumulate: Callable[[Entry, torch.Tensor], None]) -> None:
        """The CPU path: unit ``u``'s gradients of this backward into the accumulators (``accumulate``)."""
        for e, g in landed:
            accumulate(e, g)

    def grads_landed(self, u: int) -> None:
        """Unit ``u``'s gradients of this backward are in its accumulators."""

    def finish_grads(self, store) -> None:
        """The step's gradients are complete: make them what the optimizer and the norm read."""

    def step_started(self, gates, units: list[int]) -> None:
        """An optimizer step over ``units`` begins (the units this process updates close their own gates)."""

    def combine_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The global norm from this process's ``norm`` (of the gradients it holds)."""
        return norm

    def nbytes(self) -> int:
        """Host bytes of the receive slots."""
        return 0


class ShardedOwnership(LocalOwnership):
    """Each unit owned by rank ``u % world_size`` (see module docstring); ``slots``: receive slots for
    the units another rank owns, (master slots, gradient slots)."""

    lands_in_place = False

    def __init__(self, sharding, slots: tuple[int, int]) -> None:
        self.sharding = sharding
        self.world_size, self.rank = sharding.world_size, sharding.rank
        self._slot_counts = slots
        self._store = None
        self._slots = None

    def bind(self, store) -> "ShardedOwnership":
        from .sharding import ReceiveSlots

        self._store = store
        # a flat another unit reads (a tied embedding, read by the head) stays whole on every rank
        tied = {e.owner for u, entries in enumerate(store.entries) for e in entries if e.owner != u}
        self.remote = frozenset(u for u in range(len(store.entries))
                                if store.n_train(u) and u not in tied and not self.owns(u))
        self._slots = ReceiveSlots(store, self.remote, *self._slot_counts) if self.remote else None
        return self

    def owns(self, u: int) -> bool:
        return self.sharding.owns(u)

    def owner(self, u: int) -> int:
        return self.sharding.owner(u)

    def lay_out(self, u: int, bufs, sizes) -> None:
        """Unit ``u`` (remote) reads its masters and lands its gradients in a receive slot."""
        self._slots.lay_out(u, bufs, sizes)

    def nbytes(self) -> int:
        return self._slots.nbytes() if self._slots is not None else 0

    # ------------------------------------------------------------------ weights
    def before_read(self, units: list[int], transport) -> None:
        store = self._store
        if any(u in self.remote for u in units):
            transport.drain()  # no earlier upload still reads a receive slot we overwrite
        for u in units:
            bufs = store.buffers[u]
            if bufs.master_host is None:
                continue
            if u not in self.remote and self._slots is not None and self._slots.reads_in_place(store.pin):
                self._slots.release()  # no remote unit is read now: the slot's pages go back until the next one
            self.sharding.broadcast_master(u, bufs.master_host)
            if u in self.remote:
                store.staging_changed(u)  # the slot's copy belongs to another unit's masters
                self._slots.idle = False

    # ------------------------------------------------------------------ gradients
    def land(self, u: int, landed: Landed, accumulate: Callable[[Entry, torch.Tensor], None]) -> None:
        if u in self.remote:  # sent as computed, piece by piece: the slot is never written
            self._reduce(u, {e.offset: g for e, g in landed})
            return
        super().land(u, landed, accumulate)
        self._reduce(u)

    def grads_landed(self, u: int) -> None:
        self._reduce(u)

    def _reduce(self, u: int, computed: dict | None = None) -> None:
        """Sum unit ``u``'s gradients of this backward into the owner's, tensor by tensor. ``computed``
        ({entry offset: gradient}; the CPU, a remote unit): sent as computed."""
        store = self._store
        if store.buffers[u].grad_host is None:
            return
        mine = self.owns(u)
        for e in store.owned_trainable(u):  # every rank sends unit u in the same backward (same graph)
            g = computed.get(e.offset) if computed is not None and e.tensor.grad is None else None
            if mine or g is None and e.tensor.grad is not None:
                part = store.accumulators.region(e)
                if e.tensor.grad is None:  # no contribution here: a zero one (the region may be a reused slot)
                    part.zero_()
                    if mine:
                        e.tensor.grad = part.view(e.shape)
                self.sharding.reduce_grad_pieces(u, part, part, e.numel)
            else:  # sent as computed (None: zeros), piece by piece
                self.sharding.reduce_grad_pieces(u, None, None if g is None else g.detach().reshape(-1), e.numel)
            if not mine:
                e.tensor.grad = None  # the owner holds the sum (and the region may be a slot)

    def finish_grads(self, store) -> None:
        held = [e.tensor.grad for u in range(len(store.entries)) if self.owns(u)
                for e in store.owned_trainable(u) if e.tensor.grad is not None]
        self.sharding.take_mean(held)  # (once per step: only after a reduce)

    def step_started(self, gates, units: list[int]) -> None:
        for u in units:  # every rank: the units' masters change (here or on their owner)
            gates.bump(u)

    def combine_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return self.sharding.sum_scalar(norm.square()).sqrt()  # the owners' sums of squares, all-reduced

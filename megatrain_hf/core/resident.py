"""Resident units: units kept whole on the compute device (``MegaTrainConfig(resident_units=N)``).

For each resident unit (the plan's ``residency.units``, the first units in forward order) this holds,
on the device, laid out like the unit's host flats:

* ``master``: the fp32 masters (a copy of ``master_host``), what the device update writes;
* ``grad``: the fp32 gradient accumulator. The gradient sink adds into it on the compute stream
  (:meth:`add`: the step's first contribution of an entry copied, later ones added; nothing crosses the
  link), and :attr:`received` says which entries hold a gradient this step. ``param.grad`` of a resident
  parameter stays None on every device (torch refuses a CUDA ``.grad`` on a host parameter): the
  optimizer's snapshot, the norms (``norms.py``) and clipping read :meth:`gradient` instead, and
  ``zero_grad`` (the model's and HostAdamW's, wrapped: :meth:`wrap_zero_grad`) empties it;
* ``copy``: the compute-dtype copy of ``master[:n_staged]`` (bf16 compute), refreshed by each update;
* ``frozen``: the frozen flats in their wire dtype, uploaded once;
* ``moments``: ``exp_avg`` / ``exp_avg_sq`` (fp32), copied up from HostAdamW's RAM flats when the
  optimizer binds them (``bind_moments``).

A fetch of a resident unit reads these (``source``, the streamer's ``(owner, key)`` lookup): nothing
crosses the link. HostAdamW's resident scheduler (``optim/resident_update.py``) updates them in place, in
stream order (:meth:`run_update`): with streams (CUDA, or ``EmulatedStreams`` on the CPU) on a side stream
that waits for the compute stream, an event recorded after it; whatever touches a unit's device state
next on the compute stream (its fetch: :meth:`before_read`; a gradient, a zeroing, a load) waits on that
event first (no host block), and what reads it on the host (:meth:`sync_down`) waits for the event. Without
streams (the CPU) the update runs inline. No readiness gate is closed for a resident unit: nothing waits
for an upload that does not happen.

The host copies are stale while the device trains and are brought level on demand, so the files a
checkpoint writes do not depend on where a unit lived: :meth:`sync_down` (masters and moments to the
host flats) runs in ``Engine.synchronize()`` (before ``state_dict``, a save, ``detach``, pickling) and in
``HostAdamW.synchronize()`` (its ``state_dict`` and state files); :meth:`sync_up` after the host changed
(a model ``load_state_dict``, ``engine.mark_dirty()``, a parameter edited in place: its version counter;
the optimizer's loads: :meth:`moments_changed`).

On the CPU the "device" is the CPU: the device flats are separate copies, and the host flats are not
read while training (the CPU acceptance test in ``tests/parity/test_resident_units.py``, also over
``EmulatedStreams``: the stream-ordered code of CUDA).
"""

from __future__ import annotations

import logging

import torch

from ..errors import UsageError
from .layout import Entry, Kind

logger = logging.getLogger(__name__)

RESIDENT_GRAD_FIX = "Fix: attach with resident_units=0 (every unit streams; .grad is the host accumulator)."


class ResidentState:
    """The device state of the resident units of ``store`` (see module docstring). ``streams``: the
    device's streams (None: the CPU, everything inline)."""

    def __init__(self, store, units: frozenset[int], device: torch.device, compute_dtype: torch.dtype,
                 streams=None) -> None:
        self.store, self.device, self.compute_dtype, self.streams = store, device, compute_dtype, streams
        self.units = frozenset(units)
        self.master: dict[int, torch.Tensor] = {}
        self.grad: dict[int, torch.Tensor] = {}
        self.received: dict[int, set[int]] = {}  # unit -> offsets of its entries holding a gradient this step
        self.copy: dict[int, torch.Tensor] = {}
        self.frozen: dict[int, dict[torch.dtype, torch.Tensor]] = {}
        self.moments: dict[int, dict[str, torch.Tensor]] = {}
        self._host_moments: dict[int, dict[str, torch.Tensor]] = {}
        self.binding: object | None = None  # the optimizer whose moments are bound (bind_moments): only it updates
        self._versions: dict[int, tuple[int, ...]] = {}
        self._updated: dict[int, object] = {}  # unit -> event after its last update (streams only)
        self.update_stream = streams.new_stream() if streams is not None else None
        self.host_stale = False  # an update changed device state the host flats do not hold yet
        for u in sorted(self.units):
            bufs = store.buffers[u]
            if bufs.master_host is not None:
                self.master[u] = bufs.master_host.to(device, copy=True)
                self.grad[u] = torch.zeros_like(self.master[u])
                self.received[u] = set()
                if compute_dtype != torch.float32 and bufs.n_staged:
                    self.copy[u] = self.master[u][: bufs.n_staged].to(compute_dtype)
            self.frozen[u] = {}
            for e in store.entries_of(u, Kind.FROZEN):
                if e.owner == u and e.wire not in self.frozen[u]:
                    self.frozen[u][e.wire] = bufs.frozen_host[store.frozen_storage(e.wire)].to(device, e.wire, copy=True)
            self._versions[u] = self._versions_of(u)
        logger.info("megatrain: %d resident unit(s) on %s (%.3f GiB of masters, gradients and copies)",
                    len(self.units), device, self.nbytes() / 2**30)

    @classmethod
    def build(cls, store, streamer, units: frozenset[int], device: torch.device,
              compute_dtype: torch.dtype, streams=None) -> "ResidentState | None":
        """The device state of ``units`` wired into ``store`` and ``streamer`` (None without resident units)."""
        if not units:
            return None
        state = cls(store, units, device, compute_dtype, streams)
        store.resident = streamer.device_state = state
        return state

    def nbytes(self) -> int:
        tensors = [*self.master.values(), *self.grad.values(), *self.copy.values(),
                   *(t for flats in self.frozen.values() for t in flats.values()),
                   *(t for flats in self.moments.values() for t in flats.values())]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ stream order
    def _after_update(self, u: int) -> None:
        """Work issued next on the current stream that touches unit ``u``'s device state runs after its update."""
        event = self._updated.get(u)
        if event is not None:
            self.streams.current().wait_event(event)

    def run_update(self, u: int, update) -> None:
        """Run ``update()`` (unit ``u``'s device update) in stream order: inline without streams; else on the
        update stream, after what the compute stream was given so far, an event recorded after it."""
        if self.streams is None:
            update()
            return
        stream = self.update_stream
        stream.wait_stream(self.streams.current())  # the step's gradients (and the last forward) first
        with self.streams.on(stream):
            update()
        self._updated[u] = self.streams.record(stream)

    def wait_updates(self) -> None:
        """Block the host until every issued update ran (before the host reads the device state)."""
        for event in self._updated.values():
            event.synchronize()
        self._updated.clear()

    # ------------------------------------------------------------------ what a fetch reads
    def source(self, u: int, key: tuple[Kind, torch.dtype]) -> tuple[torch.Tensor, int]:
        """(device flat, element offset of its first element) for ``key``, as ``HostStore.source`` for the host."""
        kind, wire = key
        if kind is Kind.FROZEN:
            return self.frozen[u][wire], 0
        n_staged = self.store.buffers[u].n_staged
        if wire != torch.float32:
            return self.copy[u], 0
        return self.master[u][n_staged:], n_staged

    def before_read(self, units) -> None:
        """A fetch reads ``units``' device flats next (each fetch, a reused one too): a parameter changed in
        place on the host is copied up, and the compute stream waits for the units' updates."""
        for u in units:
            if u in self.units:
                if self._versions_of(u) != self._versions[u]:
                    self.sync_up(u)
                self._after_update(u)

    def entry_views(self, u: int, entries) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(masters, exp_avg, exp_avg_sq) of ``entries`` of unit ``u``, on the device, in their shapes."""
        master, moments = self.master[u], self.moments[u]
        views = ([], [], [])
        for e in entries:
            for out, flat in zip(views, (master, moments["exp_avg"], moments["exp_avg_sq"])):
                out.append(flat[e.offset : e.offset + e.numel].view(e.shape))
        return views

    def upload_scalars(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host scalars (0-d fp32: step counts, a clip coefficient) as device scalars for the work issued next
        on the current stream. With streams: one non-blocking copy from pinned memory (the host allocator keeps
        the pinned block until the copy ran). A plain ``.to(device)`` copies from pageable memory and blocks
        the host until the current stream drained: on the update stream, which waits for the compute stream,
        that is every unit's update issued before, one after another."""
        host = torch.stack(values)
        if self.streams is None:
            return list(host.unbind())
        pinned = self.streams.pinned(host.shape, host.dtype)
        pinned.copy_(host)
        return list(pinned.to(self.device, non_blocking=True).unbind())

    def updated(self, u: int) -> None:
        """Unit ``u``'s masters changed on the device: its compute-dtype copy follows."""
        if u in self.copy:
            self.copy[u].copy_(self.master[u][: self.copy[u].numel()])
        self.host_stale = True

    # ------------------------------------------------------------------ gradients
    def holds(self, e: Entry) -> bool:
        """Whether ``e``'s gradient accumulates here (its owner is a resident unit)."""
        return e.owner in self.grad

    def region(self, e: Entry) -> torch.Tensor:
        return self.grad[e.owner][e.offset : e.offset + e.numel]

    def add(self, e: Entry, g: torch.Tensor, name: str) -> None:
        """Accumulate ``g`` (on the device, any float dtype) into ``e``'s device accumulator, on the current
        stream: the step's first contribution is copied, later ones added (the fp32 sum the host makes)."""
        if e.tensor.grad is not None:
            raise UsageError(
                f"megatrain: {name} has a .grad of its own, but it belongs to a unit kept on the compute device "
                "(resident_units), whose gradient accumulates there and whose .grad stays None. " + RESIDENT_GRAD_FIX)
        self._after_update(e.owner)  # the last update read (and clipped) this accumulator
        region, flat = self.region(e), g.detach().reshape(-1)
        received = self.received[e.owner]
        if e.offset in received:
            region.add_(flat)
        else:
            region.copy_(flat)
            received.add(e.offset)

    def gradient(self, e: Entry) -> torch.Tensor | None:
        """``e``'s gradient of this step (a view of the device accumulator, shaped), or None. What the current
        stream does next with it runs after the unit's last update (whose clip multiply writes it in place)."""
        if e.offset not in self.received[e.owner]:
            return None
        self._after_update(e.owner)
        return self.region(e).view(e.shape)

    def grad_key(self, u: int) -> tuple:
        """Identity of unit ``u``'s gradients now (which entries hold one, the accumulator's version): a norm
        recorded under it is valid while it holds."""
        return ("resident", self.grad[u]._version, frozenset(self.received[u]))

    def zero_grad(self, set_to_none: bool = True, tensors: frozenset[int] | None = None) -> None:
        """``zero_grad`` of the resident entries (those whose tensor id is in ``tensors``; all if None): set to
        none (the next gradient starts the region afresh) or zeroed in place, after the last update."""
        for u, received in self.received.items():
            for e in self.store.owned_trainable(u):
                if e.offset not in received or (tensors is not None and id(e.tensor) not in tensors):
                    continue
                if set_to_none:
                    received.discard(e.offset)
                else:
                    self._after_update(u)
                    self.region(e).zero_()

    def wrap_zero_grad(self, patcher, modules) -> None:
        """``module.zero_grad`` of each of ``modules`` (the model and its wrappers, the units) also empties the
        resident gradients of its parameters (Trainer calls ``model.zero_grad()`` after each step)."""
        for module in modules:
            previous = module.zero_grad

            def zero_grad(set_to_none: bool = True, previous=previous, module=module) -> None:
                previous(set_to_none=set_to_none)
                self.zero_grad(set_to_none, frozenset(id(p) for p in module.parameters()))

            patcher.set_attr(module, "zero_grad", zero_grad)

    def detach(self) -> None:
        """The engine detaches: each resident parameter's gradient becomes its ``.grad`` (a host copy), as a
        streamed one's stays its host accumulator."""
        self.wait_updates()
        for u in self.received:
            for e in self.store.owned_trainable(u):
                grad = self.gradient(e)
                if grad is not None and e.tensor.grad is None:
                    e.tensor.grad = grad.to("cpu", copy=True)

    # ------------------------------------------------------------------ the optimizer's moments
    def bind_moments(self, host: dict[int, dict[str, torch.Tensor]]) -> object:
        """The optimizer's RAM moment flats of each resident unit it updates: copied up, kept level from now.
        An optimizer built again drops the previous device moments: first the host waits for the updates issued
        on them (the caching allocator would hand their memory to the new copies while an update still writes)."""
        self.wait_updates()
        self.binding = object()  # the optimizer bound last: only it may update the device state
        self._host_moments = {u: flats for u, flats in host.items() if u in self.units}
        self.moments = {u: {name: t.to(self.device, copy=True) for name, t in flats.items()}
                        for u, flats in self._host_moments.items()}
        return self.binding

    def moments_changed(self, u: int | None = None) -> None:
        """The host moments of unit ``u`` (all if None) were written (an optimizer load): copy them up."""
        for v in self.moments if u is None else [u] if u in self.moments else []:
            self._after_update(v)
            for name, t in self._host_moments[v].items():
                self.moments[v][name].copy_(t)

    # ------------------------------------------------------------------ keeping the host level
    def sync_down(self) -> None:
        """Copy the device masters and moments into the host flats (after the updates issued so far)."""
        self.wait_updates()
        if not self.host_stale:
            return
        for u, master in self.master.items():
            self.store.buffers[u].master_host.copy_(master)
            self.store.staging_changed(u)  # the host's compute-dtype copy no longer matches
            self._versions[u] = self._versions_of(u)  # (the host changed to what the device holds)
        for u, flats in self.moments.items():
            for name, t in flats.items():
                self._host_moments[u][name].copy_(t)
        self.host_stale = False

    def sync_up(self, u: int | None = None) -> None:
        """The host masters (and frozen weights) of unit ``u`` (all resident ones if None) changed: copy them up."""
        for v in sorted(self.units) if u is None else [u] if u in self.units else []:
            self._after_update(v)
            bufs = self.store.buffers[v]
            if v in self.master:
                self.master[v].copy_(bufs.master_host)
                if v in self.copy:
                    self.copy[v].copy_(self.master[v][: bufs.n_staged])
            for wire, flat in self.frozen[v].items():
                flat.copy_(bufs.frozen_host[self.store.frozen_storage(wire)])
            self._versions[v] = self._versions_of(v)

    def mark_dirty(self, u: int | None = None) -> None:
        """``HostStore.mark_dirty`` for masters changed from outside (a load, an edit): the device copies follow."""
        self.store.mark_dirty(u)
        self.sync_up(u)

    def _versions_of(self, u: int) -> tuple[int, ...]:
        return tuple(e.tensor._version for e in self.store.owned_trainable(u))

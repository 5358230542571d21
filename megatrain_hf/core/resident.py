"""Resident units: units kept whole on the compute device (``MegaTrainConfig(resident_units=N)``).

For each resident unit (the plan's ``residency.units``, the first units in forward order) this holds,
on the device, laid out like the unit's host flats:

* ``master``: the fp32 masters (a copy of ``master_host``), what the device update writes;
* ``grad``: the fp32 gradient accumulator: ``GradAccumulators.region`` of the unit's entries is a slice
  of it (``device_flats``), so ``param.grad`` views it and the gradient sink adds into it there;
* ``copy``: the compute-dtype copy of ``master[:n_staged]`` (bf16 compute), refreshed by each update;
* ``frozen``: the frozen flats in their wire dtype, uploaded once;
* ``moments``: ``exp_avg`` / ``exp_avg_sq`` (fp32), copied up from HostAdamW's RAM flats when the
  optimizer binds them (``bind_moments``).

A fetch of a resident unit reads these (``source``, the streamer's ``(owner, key)`` lookup): nothing
crosses the link. HostAdamW's resident scheduler (``optim/resident_update.py``) updates them in place.

The host copies are stale while the device trains and are brought level on demand, so the files a
checkpoint writes do not depend on where a unit lived: :meth:`sync_down` (masters and moments to the
host flats) runs in ``Engine.synchronize()`` (before ``state_dict``, a save, ``detach``, pickling) and in
``HostAdamW.synchronize()`` (its ``state_dict`` and state files); :meth:`sync_up` after the host changed
(a model ``load_state_dict``, ``engine.mark_dirty()``, a parameter edited in place: its version counter;
the optimizer's loads: :meth:`moments_changed`).

On the CPU the "device" is the CPU: the device flats are separate copies, and the host flats are not
read while training (the CPU acceptance test in ``tests/parity/test_resident_units.py``).
"""

from __future__ import annotations

import logging

import torch

from .layout import Kind

logger = logging.getLogger(__name__)


class ResidentState:
    """The device state of the resident units of ``store`` (see module docstring)."""

    def __init__(self, store, units: frozenset[int], device: torch.device, compute_dtype: torch.dtype) -> None:
        self.store, self.device, self.compute_dtype = store, device, compute_dtype
        self.units = frozenset(units)
        self.master: dict[int, torch.Tensor] = {}
        self.grad: dict[int, torch.Tensor] = {}
        self.copy: dict[int, torch.Tensor] = {}
        self.frozen: dict[int, dict[torch.dtype, torch.Tensor]] = {}
        self.moments: dict[int, dict[str, torch.Tensor]] = {}
        self._host_moments: dict[int, dict[str, torch.Tensor]] = {}
        self._versions: dict[int, tuple[int, ...]] = {}
        self.host_stale = False  # an update changed device state the host flats do not hold yet
        for u in sorted(self.units):
            bufs = store.buffers[u]
            if bufs.master_host is not None:
                self.master[u] = bufs.master_host.to(device, copy=True)
                self.grad[u] = torch.zeros_like(self.master[u])
                if compute_dtype != torch.float32 and bufs.n_staged:
                    self.copy[u] = self.master[u][: bufs.n_staged].to(compute_dtype)
            self.frozen[u] = {}
            for e in store.entries_of(u, Kind.FROZEN):
                if e.owner == u and e.wire not in self.frozen[u]:
                    self.frozen[u][e.wire] = bufs.frozen_host[store.frozen_storage(e.wire)].to(device, e.wire, copy=True)
            self._versions[u] = self._versions_of(u)
        store.accumulators.device_flats = self.grad
        logger.info("megatrain: %d resident unit(s) on %s (%.3f GiB of masters, gradients and copies)",
                    len(self.units), device, self.nbytes() / 2**30)

    @classmethod
    def build(cls, store, streamer, units: frozenset[int], device: torch.device,
              compute_dtype: torch.dtype) -> "ResidentState | None":
        """The device state of ``units`` wired into ``store`` and ``streamer`` (None without resident units)."""
        if not units:
            return None
        state = cls(store, units, device, compute_dtype)
        store.resident = streamer.device_state = state
        return state

    def nbytes(self) -> int:
        tensors = [*self.master.values(), *self.grad.values(), *self.copy.values(),
                   *(t for flats in self.frozen.values() for t in flats.values()),
                   *(t for flats in self.moments.values() for t in flats.values())]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ what a fetch reads
    def source(self, u: int, key: tuple[Kind, torch.dtype]) -> tuple[torch.Tensor, int]:
        """(device flat, element offset of its first element) for ``key``, as ``HostStore.source`` for the host."""
        if self._versions_of(u) != self._versions[u]:  # a parameter was changed in place on the host
            self.sync_up(u)
        kind, wire = key
        if kind is Kind.FROZEN:
            return self.frozen[u][wire], 0
        n_staged = self.store.buffers[u].n_staged
        if wire != torch.float32:
            return self.copy[u], 0
        return self.master[u][n_staged:], n_staged

    def entry_views(self, u: int, entries) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(masters, exp_avg, exp_avg_sq) of ``entries`` of unit ``u``, on the device, in their shapes."""
        master, moments = self.master[u], self.moments[u]
        views = ([], [], [])
        for e in entries:
            for out, flat in zip(views, (master, moments["exp_avg"], moments["exp_avg_sq"])):
                out.append(flat[e.offset : e.offset + e.numel].view(e.shape))
        return views

    def updated(self, u: int) -> None:
        """Unit ``u``'s masters changed on the device: its compute-dtype copy follows."""
        if u in self.copy:
            self.copy[u].copy_(self.master[u][: self.copy[u].numel()])
        self.host_stale = True

    # ------------------------------------------------------------------ the optimizer's moments
    def bind_moments(self, host: dict[int, dict[str, torch.Tensor]]) -> None:
        """The optimizer's RAM moment flats of each resident unit it updates: copied up, kept level from now."""
        self._host_moments = {u: flats for u, flats in host.items() if u in self.units}
        self.moments = {u: {name: t.to(self.device, copy=True) for name, t in flats.items()}
                        for u, flats in self._host_moments.items()}

    def moments_changed(self, u: int | None = None) -> None:
        """The host moments of unit ``u`` (all if None) were written (an optimizer load): copy them up."""
        for v in self.moments if u is None else [u] if u in self.moments else []:
            for name, t in self._host_moments[v].items():
                self.moments[v][name].copy_(t)

    # ------------------------------------------------------------------ keeping the host level
    def sync_down(self) -> None:
        """Copy the device masters and moments into the host flats (no update may be running)."""
        if not self.host_stale:
            return
        for u, master in self.master.items():
            self.store.buffers[u].master_host.copy_(master)
            self.store.staging_changed(u)  # the host's compute-dtype copy no longer matches
        for u, flats in self.moments.items():
            for name, t in flats.items():
                self._host_moments[u][name].copy_(t)
        self.host_stale = False

    def sync_up(self, u: int | None = None) -> None:
        """The host masters (and frozen weights) of unit ``u`` (all resident ones if None) changed: copy them up."""
        for v in sorted(self.units) if u is None else [u] if u in self.units else []:
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

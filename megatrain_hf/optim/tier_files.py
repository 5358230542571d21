"""The disk tier's files, made once while the model attaches (so the fp32 masters never all exist in RAM).

With the optimizer state on disk (``offload_dir``; ``offload_state`` "moments", "all" or "auto"
choosing them) the engine's plan knows at attach which units' moments (and masters) go to disk and
in which format (``optimizer_state``). :class:`TierFiles` is the host store's ``on_unit`` hook: at
the first unit it creates the tier's files, laid out as HostAdamW lays them out (:func:`tier_layout`),
and as soon as each unit's flats are filled it moves that unit's staged masters into its file
(``paged_state.move_masters``): at most one unit's masters are in RAM at any time.

A HostAdamW built on that store pages these files (:func:`open_tier`): one built through the engine
(``engine.host_optimizer``) or by hand without disk arguments takes the plan's tier, so none can miss
it. Only one built by hand with disk arguments of its own (another window, I/O engine or set of
units), or while another live optimizer pages the files, makes files of its own (the masters then
move there from the mapping: correct, their bytes twice on disk). A second optimizer on the files
starts from zero moments, as a fresh one does.
"""

from __future__ import annotations

import logging
import weakref

import torch

from .compressed import unit_spec
from .moment_store import PagedHome
from .paged_state import DEFAULT_WINDOW, MASTER, PagedState, master_units, move_masters
from .moment_formats import format_of

logger = logging.getLogger(__name__)


def tier_layout(specs: dict[int, dict], n_staged: dict[int, int]) -> dict[int, dict[str, tuple[int, torch.dtype]]]:
    """Each paged unit's file: its staged fp32 masters first (the units of ``n_staged``), then its state
    tensors ``specs[u]``."""
    return {u: ({MASTER: (n_staged[u], torch.float32)} if u in n_staged else {}) | specs[u] for u in sorted(specs)}


class TierFiles:
    """The store's ``on_unit`` hook that makes the files of the moments of ``units`` in ``optimizer_state``'s
    format and puts ``masters``' staged masters in them as the store fills them; then the tier the optimizer
    pages (``store.tier_files``)."""

    def __init__(self, offload_dir: str, units, masters, optimizer_state: str, disk_io: str = "threads",
                 window: int = DEFAULT_WINDOW) -> None:
        self.offload_dir, self.units, self.masters = offload_dir, tuple(units), frozenset(masters)
        self.format, self.window, self.disk_io = format_of(optimizer_state), window, disk_io
        self.pager: PagedState | None = None
        self._user = None  # weakref of the optimizer paging the files now
        self._used = False  # an optimizer paged them before: their moments are not zero any more

    def __call__(self, store, u: int) -> None:
        if self.pager is None:
            specs = {v: unit_spec(self.format, store.owned_trainable(v), store.n_train(v))
                     for v in self.units if store.owns(v)}  # (under data parallelism: this rank's units)
            self.pager = PagedState(self.offload_dir, tier_layout(specs, {v: store.n_staged(v) for v in self.masters}),
                                    self.window, disk_io=self.disk_io)
            store.tier_files = self
        if u in self.masters:
            move_masters(self.pager, store, [u])

    def options(self) -> dict:
        """The disk arguments of a HostAdamW that pages these files."""
        return dict(offload_dir=self.offload_dir, offload_units=self.units, offload_masters=self.masters,
                    offload_window=self.window, disk_io=self.disk_io)

    def adopt(self, optimizer, layout: dict, window: int, disk_io: str) -> PagedState | None:
        """The files for ``optimizer``, whose tier would be ``layout`` paged through ``window`` slots by
        ``disk_io``; None where they do not fit it or another live optimizer pages them."""
        pager = self.pager
        if pager is None or pager.closed:
            return None
        if (pager.specs, pager.window, pager.disk_io_name) != (layout, window, disk_io):
            logger.warning(
                "megatrain disk tier: the files made at attach are laid out for other optimizer settings (their "
                "window %d, disk_io %r; asked %d, %r, or other moments or units); this optimizer pages files of its "
                "own and the masters move there", pager.window, pager.disk_io_name, window, disk_io)
            return None
        if self._user is not None and self._user() is not None:
            logger.warning("megatrain disk tier: another optimizer still pages the files made at attach (close it "
                           "first: optimizer.close()); this one pages files of its own")
            return None
        if self._used:  # a fresh optimizer's moments are zero
            for u in pager.units:
                with pager.state(u, write=True) as flats:
                    for t in flats.values():
                        t.zero_()
        self._user, self._used = weakref.ref(optimizer), True
        return pager

    def release(self, optimizer) -> None:
        """``optimizer`` (closed) no longer pages the files: they stay where they hold masters, else they are
        removed (as an optimizer's own files are; a later optimizer makes new ones)."""
        if self._user is not None and self._user() is optimizer:
            self._user = None
            if self.masters:
                self.pager.flush()
            else:
                self.pager.close()

    def close(self) -> None:
        """Remove the files (the parameters keep their mapping of the masters: valid once the files are gone)."""
        if self.pager is not None:
            self.pager.close()


def open_tier(owner, store, layout, paged, offload_masters, offload_dir: str, window: int | None,
              disk_io: str) -> PagedHome:
    """The disk tier of ``owner`` (an optimizer) for the units ``paged`` of its moments' ``layout``: the files
    the engine made at attach where they fit (the masters already in them), else files of its own with the
    masters of ``offload_masters`` moved there."""
    masters = master_units(store, paged, offload_masters)
    files = tier_layout({u: layout.specs[u] for u in paged}, {u: store.n_staged(u) for u in masters})
    window = window or DEFAULT_WINDOW
    tier = store.tier_files  # the files the engine made at attach, the masters already in them
    pager = tier.adopt(owner, files, window, disk_io) if tier is not None else None
    if pager is not None:
        ref = weakref.ref(owner)  # (no cycle through the optimizer's own tier)
        return PagedHome(layout, pager, masters, lambda: tier.release(ref()))  # they keep holding the masters
    pager = PagedState(offload_dir, files, window, disk_io=disk_io)
    move_masters(pager, store, masters)  # (from RAM, or from the attach tier's mapping)
    return PagedHome(layout, pager, masters, pager.close)  # close removes the run's directory

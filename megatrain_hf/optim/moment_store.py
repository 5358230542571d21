"""HostAdamW's moments: one layout (fp32 flats, or a compressed format) in per-unit homes (RAM, or the disk tier).

The two axes are composed, not branched on:

* the *layout* says which contiguous tensors a unit's moments are (``spec``) and gives each entry a
  state over them (``views``): :class:`Fp32Layout` (``exp_avg`` / ``exp_avg_sq`` fp32 flats laid out
  like the master flat) or ``compressed.CompressedLayout`` (bf16, 8-bit, 4-bit codes and scales);
* the *home* of a unit holds those tensors: :class:`RamHome` (allocated once) or :class:`PagedHome`
  (a file of the disk tier, paged through a window of RAM slots, ``paged_state.py``; with the unit's
  staged masters in the same file where they are on disk).

Every entry state answers the same questions (``fp32(k)``, ``assign(k, x)``, ``write_back(m, v, grad)``,
``views(shape)``), so the kernels, ``state_dict()``, ``load_state_dict()`` and the checkpoints read one
code path for every format and tier. :class:`MomentStore` puts the two together for one optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..core.layout import Entry
from .compressed import CompressedLayout, distinct_entries, unit_spec
from .moment_formats import MOMENTS, Format
from .paged_state import MASTER, PagedState


class Fp32State:
    """One parameter's fp32 moments: views of its unit's ``exp_avg`` / ``exp_avg_sq`` flats, in its shape."""

    __slots__ = ("moments",)

    def __init__(self, m: torch.Tensor, v: torch.Tensor) -> None:
        self.moments = (m, v)

    def fp32(self, k: int) -> torch.Tensor:
        return self.moments[k]  # the view itself: a kernel updates it in place

    def assign(self, k: int, x: torch.Tensor) -> None:
        self.moments[k].copy_(x.reshape(self.moments[k].shape))

    def write_back(self, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> None:
        """(``m``, ``v`` are :meth:`fp32`'s views, updated in place: nothing to do)"""

    def views(self, shape) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.moments[0], "exp_avg_sq": self.moments[1]}


class _NoState:
    """The state of a parameter whose moments live in a reused slot: ``optimizer.state`` shows none."""

    @staticmethod
    def views(shape) -> dict[str, torch.Tensor]:
        return {}


NO_STATE = _NoState()


class Fp32Layout:
    """fp32 moments: each unit's ``exp_avg`` and ``exp_avg_sq`` flats laid out like its master flat."""

    def __init__(self, fmt: Format, entries: dict[int, list[Entry]], numels: dict[int, int]) -> None:
        self.fmt = fmt
        self.specs = {u: unit_spec(fmt, [], numels[u]) for u in entries}
        self._entries = {u: distinct_entries(es) for u, es in entries.items()}

    def views(self, u: int, tensors: dict[str, torch.Tensor]) -> dict[int, Fp32State]:
        m, v = (tensors[name] for name in MOMENTS)
        return {id(e.tensor): Fp32State(m[e.offset : e.offset + e.numel].view(e.shape),
                                        v[e.offset : e.offset + e.numel].view(e.shape)) for e in self._entries[u]}

    def native(self, lib, w, stages, scalars, clip: float, threads: int) -> None:
        from . import native

        native.adamw(lib, w.params, w.grads, [s.moments[0] for s in w.states], [s.moments[1] for s in w.states],
                     stages, scalars, clip, bool(w.maximize), threads)


def layout_of(fmt: Format, entries: dict[int, list[Entry]], numels: dict[int, int]):
    """The layout of ``fmt``'s moments for the optimizer's ``entries`` of each unit."""
    return (Fp32Layout if fmt.mode == "fp32" else CompressedLayout)(fmt, entries, numels)


class RamHome:
    """Units whose moments are tensors in RAM, allocated (zero) once."""

    def __init__(self, layout, units, allocate: Callable[[int, torch.dtype], torch.Tensor]) -> None:
        self.layout = layout
        self.tensors = {u: {name: allocate(n, dtype).zero_() for name, (n, dtype) in layout.specs[u].items()}
                        for u in units}
        self.states = {u: layout.views(u, t) for u, t in self.tensors.items()}

    def unit_state(self, u: int, write: bool):
        return contextlib.nullcontext(self.tensors[u])

    @contextlib.contextmanager
    def bound(self, job):
        states = self.states[job.unit]
        for w in job.work:
            w.states = [states[id(e.tensor)] for e in w.entries]
        yield None

    def persistent(self, u: int) -> dict:
        return self.states[u]

    @staticmethod
    def keep(x: torch.Tensor) -> torch.Tensor:
        return x  # a view of tensors that stay


class PagedHome:
    """Units whose moments (and staged masters, for ``master_units``) are files of the disk tier."""

    def __init__(self, layout, pager: PagedState, master_units: list[int], release: Callable[[], None]) -> None:
        self.layout, self.pager, self.master_units, self._release = layout, pager, master_units, release

    def unit_state(self, u: int, write: bool):
        return self.pager.state(u, write)

    @contextlib.contextmanager
    def bound(self, job):
        """The job's moments over a slot (read now, or by the read-ahead), written back after the block;
        with the unit's masters in its file, the job's staged parameters are the slot's master (yielded)."""
        with self.pager.resident(job.unit, write=True) as flats:
            master = flats.get(MASTER)
            params = [w.params for w in job.work]
            try:
                states = self.layout.views(job.unit, flats)
                for w in job.work:
                    w.params = _on_master(master, w.entries, w.params)
                    w.states = [states[id(e.tensor)] for e in w.entries]
                yield master
            finally:
                for w, p in zip(job.work, params):  # no view of a slot outlives the block (the slot is reused)
                    w.params, w.states = p, []

    def persistent(self, u: int) -> dict:
        return {}

    @staticmethod
    def keep(x: torch.Tensor) -> torch.Tensor:
        return x.clone()  # the slot is reused

    def prefetch(self, unit: int, upcoming: list[int]) -> None:
        units = self.pager.units
        wanted = [unit] * (unit in units) + [v for v in upcoming if v in units][: self.pager.ahead]
        if wanted:
            self.pager.prefetch(wanted)  # exact: the order is known

    def before_step(self) -> None:
        self.pager.forget(self.master_units)  # masters written through their mapping are in the files now

    def flush(self) -> None:
        self.pager.flush()

    def close(self) -> None:
        self._release()


def _on_master(master: torch.Tensor | None, entries: list[Entry], params: list[torch.Tensor]) -> list[torch.Tensor]:
    if master is None:
        return params
    # staged entries come first in the flat: [0, n_staged)
    return [master[e.offset : e.offset + e.numel].view(e.shape) if e.offset < master.numel() else p
            for e, p in zip(entries, params)]


class NoTier:
    """No unit on disk: nothing to read ahead, forget, flush or close."""

    pager = None
    master_units: list[int] = []

    def prefetch(self, unit: int, upcoming: list[int]) -> None:
        pass

    def before_step(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class MomentStore:
    """The moments of one optimizer: ``layout`` in RAM for some units, in ``tier`` (a :class:`PagedHome`,
    or :class:`NoTier`) for the others."""

    def __init__(self, layout, units: list[int], allocate, tier: PagedHome | NoTier) -> None:
        paged = frozenset(tier.pager.units) if tier.pager is not None else frozenset()
        self.layout, self.format, self.tier = layout, layout.fmt, tier
        self.ram = RamHome(layout, [u for u in units if u not in paged], allocate)
        self._homes = {u: tier if u in paged else self.ram for u in units}

    # ------------------------------------------------------------------ per unit
    def spec(self, u: int) -> dict[str, tuple[int, torch.dtype]]:
        """Unit ``u``'s contiguous state tensors: name -> (elements, dtype)."""
        return dict(self.layout.specs[u])

    def unit_state(self, u: int, write: bool = False):
        """Unit ``u``'s state tensors while the block runs (no update running); ``write=True``: kept."""
        return self._homes[u].unit_state(u, write)

    def bound(self, job):
        """A ``UnitJob`` whose groups' ``states`` are its entries' moments while the block runs; yields the
        unit's master flat where the tier holds it (else None)."""
        return self._homes[job.unit].bound(job)

    def persistent(self, u: int) -> dict:
        """The entry states that stay valid (``optimizer.state`` shows their views): RAM fp32 units'."""
        return self._homes[u].persistent(u)

    @contextlib.contextmanager
    def exported(self, u: int):
        """{id(entry.tensor): (exp_avg, exp_avg_sq)} of unit ``u`` in fp32, valid after the block."""
        home = self._homes[u]
        with home.unit_state(u, write=False) as tensors:
            states = self.layout.views(u, tensors)
            yield {key: (home.keep(s.fp32(0)), home.keep(s.fp32(1))) for key, s in states.items()}

    @contextlib.contextmanager
    def assigned(self, u: int):
        """Unit ``u``'s entry states to :meth:`assign` to while the block runs; written back after it."""
        with self._homes[u].unit_state(u, write=True) as tensors:
            yield self.layout.views(u, tensors)

    # ------------------------------------------------------------------ the step
    def prefetch(self, unit: int, upcoming: list[int]) -> None:
        self.tier.prefetch(unit, upcoming)

    def before_step(self) -> None:
        self.tier.before_step()

    def flush(self) -> None:
        self.tier.flush()

    def close(self) -> None:
        self.tier.close()

    # ------------------------------------------------------------------ accessors
    @property
    def in_ram(self) -> dict[int, dict[str, torch.Tensor]]:
        """The RAM units' state tensors (unit -> name -> tensor); a paged unit's are in its file."""
        return self.ram.tensors

    @property
    def pager(self) -> PagedState | None:
        return self.tier.pager

    @property
    def master_units(self) -> list[int]:
        return self.tier.master_units

    def nbytes(self) -> int:
        """Bytes of the moments in RAM (paged units' are not here)."""
        return sum(t.numel() * t.element_size() for unit in self.ram.tensors.values() for t in unit.values())

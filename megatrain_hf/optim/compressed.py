"""HostAdamW's compressed moments: each unit's codes and scales, and one entry's view of them.

A unit's state is a few contiguous named tensors (see ``quant.py``): ``<moment>.codes`` (uint8;
bf16 for ``"bf16"``, named plain ``<moment>``) laid out like the master flat, and
``<moment>.scales`` (fp32, one per block of each entry, entries in offset order). An
:class:`EntryState` is one parameter's slices of them: what the kernels update in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.layout import Entry
from .moment_formats import MOMENTS, Format, compress, expand


@dataclass
class EntryState:
    """One parameter's slices of its unit's compressed moments (``scales`` None for bf16)."""

    numel: int
    codes: tuple[torch.Tensor, torch.Tensor]  # (m's, v's)
    scales: tuple[torch.Tensor | None, torch.Tensor | None]

    def expand(self, fmt: Format, k: int) -> torch.Tensor:
        return expand(fmt, k, self.codes[k], self.scales[k], self.numel)

    def assign(self, fmt: Format, k: int, x: torch.Tensor, toward_zero: torch.Tensor | None = None) -> None:
        """Compress ``x`` into moment ``k``; ``toward_zero``: see :func:`moment_formats.compress`."""
        mask = None if toward_zero is None else toward_zero.reshape(-1)
        compress(fmt, k, x.reshape(-1).to(torch.float32), self.codes[k], self.scales[k], mask)


def tensor_names(fmt: Format) -> list[str]:
    """The names of a unit's state tensors in this format (the keys of its checkpoint file)."""
    if not fmt.quantized:
        return list(MOMENTS)
    return [f"{m}.{part}" for m in MOMENTS for part in ("codes", "scales")]


def _distinct(entries: list[Entry]) -> list[Entry]:
    """The entries of distinct tensors (a tied one once), in offset order."""
    return sorted({id(e.tensor): e for e in entries}.values(), key=lambda e: e.offset)


def unit_spec(fmt: Format, entries: list[Entry], numel: int) -> dict[str, tuple[int, torch.dtype]]:
    """A unit's AdamW state tensors in ``fmt`` (name -> (elements, dtype)) for the optimizer's ``entries``
    of it, whose master flat has ``numel`` elements: what HostAdamW allocates, checkpoints and pages."""
    if fmt.mode == "fp32":
        return {m: (numel, torch.float32) for m in MOMENTS}
    if not fmt.quantized:
        return {m: (numel, torch.bfloat16) for m in MOMENTS}
    n_blocks = sum(fmt.blocks(e.numel) for e in _distinct(entries))
    spec = {}
    for m in MOMENTS:
        spec[f"{m}.codes"] = (fmt.code_bytes(numel), torch.uint8)
        spec[f"{m}.scales"] = (max(n_blocks, 1), torch.float32)
    return spec


class CompressedMoments:
    """The compressed moments of every unit an optimizer updates.

    ``paged``: units whose tensors live elsewhere (the disk tier's slots, ``paged_state.py``): none
    is allocated for them here, only their specs (:attr:`specs`); :meth:`views` builds the entries'
    states over the tensors the caller holds.
    """

    def __init__(self, fmt: Format, entries: dict[int, list[Entry]], numels: dict[int, int],
                 allocate: Callable[[int, torch.dtype], torch.Tensor], paged=frozenset()) -> None:
        self.fmt = fmt
        self.specs: dict[int, dict[str, tuple[int, torch.dtype]]] = {}  # unit -> name -> (elements, dtype)
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}  # the units in RAM only
        self.entries: dict[int, dict[int, EntryState]] = {}  # unit in RAM -> id(entry.tensor) -> its state
        self._blocks: dict[int, dict[int, tuple[Entry, int]]] = {}  # unit -> id(entry.tensor) -> (entry, 1st block)
        for u, unit_entries in entries.items():
            block_at, n_blocks = {}, 0
            for e in _distinct(unit_entries):
                block_at[id(e.tensor)] = (e, n_blocks)
                n_blocks += fmt.blocks(e.numel)
            self._blocks[u] = block_at
            self.specs[u] = spec = unit_spec(fmt, unit_entries, numels[u])
            if u not in paged:
                self.tensors[u] = {name: allocate(n, dtype).zero_() for name, (n, dtype) in spec.items()}
                self.entries[u] = self.views(u, self.tensors[u])

    def views(self, u: int, tensors: dict[str, torch.Tensor]) -> dict[int, EntryState]:
        """Each entry's state (by ``id(entry.tensor)``) over ``tensors``: unit ``u``'s tensors, as
        :attr:`specs` names them (its own flats in RAM, or a disk-tier slot's views)."""
        return {key: self._entry(tensors, e, block) for key, (e, block) in self._blocks[u].items()}

    def _entry(self, tensors: dict[str, torch.Tensor], e: Entry, block: int) -> EntryState:
        fmt = self.fmt
        if not fmt.quantized:
            codes = tuple(tensors[m][e.offset : e.offset + e.numel] for m in MOMENTS)
            return EntryState(e.numel, codes, (None, None))
        start = e.offset if fmt.bits == 8 else e.offset // 2  # offsets are 16-element aligned
        codes = tuple(tensors[f"{m}.codes"][start : start + fmt.code_bytes(e.numel)] for m in MOMENTS)
        scales = tuple(tensors[f"{m}.scales"][block : block + fmt.blocks(e.numel)] for m in MOMENTS)
        return EntryState(e.numel, codes, scales)

    def of(self, u: int, e: Entry) -> EntryState:
        """An entry's state of a unit in RAM (a paged unit's: :meth:`views` of its resident tensors)."""
        return self.entries[u][id(e.tensor)]

    def nbytes(self) -> int:
        """Bytes of the moments in RAM (paged units' are not here)."""
        return sum(t.numel() * t.element_size() for unit in self.tensors.values() for t in unit.values())

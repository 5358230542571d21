"""HostAdamW's compressed moments: the layout of each unit's codes and scales, and one entry's view of them.

A unit's state is a few contiguous named tensors (see ``moment_formats.py``): ``<moment>.codes``
(uint8; bf16 for ``"bf16"``, named plain ``<moment>``) laid out like the master flat, and
``<moment>.scales`` (fp32, one per block of each entry, entries in offset order). An
:class:`EntryState` is one parameter's slices of them: what the kernels update in place.
:class:`CompressedLayout` is one of the two moment layouts of ``moment_store.py`` (the other: fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.layout import Entry
from .moment_formats import MOMENTS, Format, compress, expand


@dataclass
class EntryState:
    """One parameter's slices of its unit's compressed moments (``scales`` None for bf16)."""

    fmt: Format
    numel: int
    codes: tuple[torch.Tensor, torch.Tensor]  # (m's, v's)
    scales: tuple[torch.Tensor | None, torch.Tensor | None]

    def fp32(self, k: int) -> torch.Tensor:
        """Moment ``k`` (0: m, 1: v) expanded to a new fp32 flat."""
        return expand(self.fmt, k, self.codes[k], self.scales[k], self.numel)

    def assign(self, k: int, x: torch.Tensor, toward_zero: torch.Tensor | None = None) -> None:
        """Moment ``k`` := ``x`` (compressed); ``toward_zero``: see :func:`moment_formats.compress`."""
        mask = None if toward_zero is None else toward_zero.reshape(-1)
        compress(self.fmt, k, x.reshape(-1).to(torch.float32), self.codes[k], self.scales[k], mask)

    def write_back(self, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> None:
        """After a kernel updated the expanded copies of :meth:`fp32`: compress them again (no gradient:
        m rounds toward zero, ``moment_formats.py``)."""
        self.assign(0, m, grad == 0)
        self.assign(1, v)

    def views(self, shape) -> dict[str, torch.Tensor]:
        """What ``optimizer.state[p]`` shows of it: nothing (``state_dict()`` expands a copy)."""
        return {}


def tensor_names(fmt: Format) -> list[str]:
    """The names of a unit's state tensors in this format (the keys of its checkpoint file)."""
    if not fmt.quantized:
        return list(MOMENTS)
    return [f"{m}.{part}" for m in MOMENTS for part in ("codes", "scales")]


def distinct_entries(entries: list[Entry]) -> list[Entry]:
    """The entries of distinct tensors (a tied one once), in offset order."""
    return sorted({id(e.tensor): e for e in entries}.values(), key=lambda e: e.offset)


def unit_spec(fmt: Format, entries: list[Entry], numel: int) -> dict[str, tuple[int, torch.dtype]]:
    """A unit's AdamW state tensors in ``fmt`` (name -> (elements, dtype)) for the optimizer's ``entries``
    of it, whose master flat has ``numel`` elements: what HostAdamW allocates, checkpoints and pages."""
    if fmt.mode == "fp32":
        return {m: (numel, torch.float32) for m in MOMENTS}
    if not fmt.quantized:
        return {m: (numel, torch.bfloat16) for m in MOMENTS}
    n_blocks = sum(fmt.blocks(e.numel) for e in distinct_entries(entries))
    spec = {}
    for m in MOMENTS:
        spec[f"{m}.codes"] = (fmt.code_bytes(numel), torch.uint8)
        spec[f"{m}.scales"] = (max(n_blocks, 1), torch.float32)
    return spec


class CompressedLayout:
    """The compressed moments' layout in every unit an optimizer updates: each unit's tensors
    (:attr:`specs`) and each entry's :class:`EntryState` over tensors laid out so (:meth:`views`)."""

    def __init__(self, fmt: Format, entries: dict[int, list[Entry]], numels: dict[int, int]) -> None:
        self.fmt = fmt
        self.specs: dict[int, dict[str, tuple[int, torch.dtype]]] = {}  # unit -> name -> (elements, dtype)
        self._blocks: dict[int, dict[int, tuple[Entry, int]]] = {}  # unit -> id(entry.tensor) -> (entry, 1st block)
        for u, unit_entries in entries.items():
            block_at, n_blocks = {}, 0
            for e in distinct_entries(unit_entries):
                block_at[id(e.tensor)] = (e, n_blocks)
                n_blocks += fmt.blocks(e.numel)
            self._blocks[u] = block_at
            self.specs[u] = unit_spec(fmt, unit_entries, numels[u])

    def views(self, u: int, tensors: dict[str, torch.Tensor]) -> dict[int, EntryState]:
        """Each entry's state (by ``id(entry.tensor)``) over ``tensors``: unit ``u``'s tensors, as
        :attr:`specs` names them (its own flats in RAM, or a disk-tier slot's views)."""
        return {key: self._entry(tensors, e, block) for key, (e, block) in self._blocks[u].items()}

    def _entry(self, tensors: dict[str, torch.Tensor], e: Entry, block: int) -> EntryState:
        fmt = self.fmt
        if not fmt.quantized:
            codes = tuple(tensors[m][e.offset : e.offset + e.numel] for m in MOMENTS)
            return EntryState(fmt, e.numel, codes, (None, None))
        start = e.offset if fmt.bits == 8 else e.offset // 2  # offsets are 16-element aligned
        codes = tuple(tensors[f"{m}.codes"][start : start + fmt.code_bytes(e.numel)] for m in MOMENTS)
        scales = tuple(tensors[f"{m}.scales"][block : block + fmt.blocks(e.numel)] for m in MOMENTS)
        return EntryState(fmt, e.numel, codes, scales)

    def native(self, lib, w, stages, scalars, clip: float, threads: int) -> None:
        """One group's update through the native kernel: expand, update, compress block by block."""
        from . import native

        codes = tuple([s.codes[k] for s in w.states] for k in (0, 1))
        scales = tuple([s.scales[k] for s in w.states] for k in (0, 1))
        native.adamw_compressed(lib, w.params, w.grads, codes, scales, stages, scalars, self.fmt, clip,
                                bool(w.maximize), threads)

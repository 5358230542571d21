"""Streamer: brings a unit's weights onto the compute device, ahead of time.

``fetch(u)`` returns ``{name: tensor_dev}`` for every tensor unit ``u`` needs; the engine calls
``prefetch(v)`` for the next unit in forward or backward order right after queuing the compute
of ``u``, so the upload of ``v`` runs on the copy stream while ``u`` computes. Each host flat a
unit reads (its compute-dtype staging, its fp32 vectors, a tied weight's owner flat, frozen
weights) crosses the link as ONE copy from pinned memory; the entries are views into it, so
binding a template is free. Without streams (the CPU) the views point straight into the host
flats: no copy at all.

Residency lives here and nowhere else: the in-flight table (at most the current unit plus the
prefetched one), the unit fetched last (kept until another is fetched: the next micro-batch of a
layer-major round, or the backward right after the head's forward, reuse it), and the device
copies of unit buffers (uploaded once, e.g. Gemma3's ``embed_scale``). Before reading a unit's
host flats the streamer waits until no background optimizer update is writing them; an upload
issued before the masters changed is dropped (``gates.generation``).

A unit the plan keeps on the device (``resident.py``) is read from its device flats: no copy, no
readiness gate (its update is stream-ordered: each fetch makes the compute stream wait for the unit's
last update, ``ResidentState.before_read``), and an upload of nothing else has no event to wait for.

Quantized frozen weights (``quant.py``) cross the link as bytes and are dequantized on the compute
stream when the unit is fetched, into one device flat per unit in the compute dtype (the template
binds views of it); the dequantized flat lives as long as the fetched unit stays resident, and the
caching allocator hands its memory to the next unit's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from .frozen_formats import dequantize_into
from .layout import Kind
from .store import HostStore
from .uploads import InlineUploads, StreamUploads


@dataclass
class _Upload:
    flats: dict[tuple, tuple[torch.Tensor, int]]  # (owner, source key) -> (device flat, base offset)
    ready: Any  # event recorded on the copy stream after the last copy (None: nothing was copied)
    generation: tuple[int, ...]
    copied: list[torch.Tensor]  # the flats this upload brought (not a resident unit's device flats)


class Streamer:
    def __init__(self, store: HostStore, device: torch.device, stats, streams=None) -> None:
        self.store = store
        self.device = device
        self.stats = stats  # EngineStats: h2d_bytes counts link traffic host -> device
        self.streams = streams  # CudaStreams / EmulatedStreams, or None: compute on the host flats
        self.uploads = StreamUploads(stats, streams) if streams is not None else InlineUploads(stats)
        self._inflight: dict[int, _Upload] = {}
        self._resident: tuple[int, _Upload] | None = None
        self._buffers_dev: dict[tuple[int, str], torch.Tensor] = {}
        for u, entries in enumerate(store.entries):
            for e in entries:
                if e.kind is Kind.BUFFER:
                    self._buffers_dev[(u, e.name)] = e.tensor.to(device)
        self._sources: list[list[tuple]] = [
            list(dict.fromkeys((e.owner, e.source) for e in entries if e.kind is not Kind.BUFFER))
            for entries in store.entries
        ]
        self._owners = [sorted({owner for owner, _ in sources}) for sources in self._sources]
        self._quantized = [[e for e in entries if e.quant is not None] for entries in store.entries]
        self._dequantized: tuple[_Upload, dict[str, torch.Tensor]] | None = None  # of the resident unit
        self.device_state = None  # a ResidentState (resident.py): the units whose flats stay on the device

    @property
    def copy_stream(self):
        return getattr(self.uploads, "copy_stream", None)

    def _generation(self, u: int) -> tuple[int, ...]:
        generation = self.store.gates.generation
        return tuple(generation[o] for o in self._owners[u])

    def _issue(self, u: int) -> _Upload:
        """Upload unit ``u``'s host flats: one copy per source flat, as one batch (``uploads.py``)."""
        resident = self.device_state.units if self.device_state is not None else frozenset()
        flats: dict[tuple, tuple[torch.Tensor, int]] = {}
        for owner, key in self._sources[u]:
            if owner in resident:  # on the device already: no copy, no gate
                flats[(owner, key)] = self.device_state.source(owner, key)
        owners = [owner for owner in self._owners[u] if owner not in resident]
        if self._owners[u] and not owners:  # every flat it reads is a resident unit's
            return _Upload(flats, None, self._generation(u), [])
        self.stats.uploads += 1
        started = time.perf_counter()
        for owner in owners:
            self.store.gates.wait_ready(owner)  # no background update is writing these masters
        self.stats.optimizer_wait_s += time.perf_counter() - started
        self.store.ownership.before_read(owners, self.uploads)  # (data parallelism: the owners' masters)
        copied = []
        with self.uploads.batch() as batch:
            for owner, key in self._sources[u]:
                if owner not in resident:
                    host, base = self.store.source(owner, key)
                    copied.append(batch.copy(host, key[1]))
                    flats[(owner, key)] = (copied[-1], base)
        return _Upload(flats, batch.ready, self._generation(u), copied)

    def prefetch(self, u: int) -> None:
        if self.uploads.prefetches and 0 <= u < len(self._sources) and u not in self._inflight:
            self._inflight[u] = self._issue(u)

    def fetch(self, u: int) -> dict[str, torch.Tensor]:
        resident, generation = self._resident, self._generation(u)
        if resident is not None and resident[0] == u and resident[1].generation == generation:
            upload = resident[1]
        else:
            self._resident = None  # release it before the next upload lands
            upload = self._inflight.pop(u, None)
            if upload is None or upload.generation != generation:
                upload = self._issue(u)
            self._resident = (u, upload)
        self.stats.fetches += 1
        if upload.copied:
            self.uploads.wait(upload.ready, upload.copied)
        if self.device_state is not None:
            self.device_state.before_read(self._owners[u])
        tensors: dict[str, torch.Tensor] = {}
        for e in self.store.entries[u]:
            if e.kind is Kind.BUFFER:
                tensors[e.name] = self._buffers_dev[(u, e.name)]
                continue
            if e.quant is not None:
                continue
            flat_dev, base = upload.flats[(e.owner, e.source)]
            start = e.offset - base
            tensors[e.name] = flat_dev[start : start + e.numel].view(e.shape)
        if self._quantized[u]:
            tensors.update(self._dequantize(u, upload))
        return tensors

    def _dequantize(self, u: int, upload: _Upload) -> dict[str, torch.Tensor]:
        """Unit ``u``'s quantized weights, dequantized from ``upload`` (again only for a new upload)."""
        if self._dequantized is not None and self._dequantized[0] is upload:
            return self._dequantized[1]
        self._dequantized = None  # the previous unit's flat goes back to the allocator first
        entries = self._quantized[u]
        dtype = entries[0].quant.dtype
        flat = torch.empty(sum(e.quant.numel for e in entries), dtype=dtype, device=self.device)
        out, first = {}, 0
        for e in entries:
            flat_dev, base = upload.flats[(e.owner, e.source)]
            start = e.offset - base
            out[e.name] = dequantize_into(e.quant, flat_dev[start : start + e.numel], flat[first : first + e.quant.numel])
            first += e.quant.numel
        self.stats.dequantized_bytes += flat.numel() * flat.element_size()
        self._dequantized = (upload, out)
        return out

    def exposed_wait_s(self) -> float:
        """Seconds the compute stream waited for uploads since the last call (``uploads.py``)."""
        return self.uploads.exposed_wait_s()

    def device_units(self) -> set[int]:
        """Units whose weights are on the compute device now: the resident one and those in flight."""
        return ({self._resident[0]} if self._resident is not None else set()) | set(self._inflight)

    def drop_prefetched(self) -> None:
        """Forget uploads not consumed yet and the resident unit (end of a pass, an aborted pass)."""
        self._inflight.clear()
        self._resident = None
        self._dequantized = None

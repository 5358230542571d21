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

Quantized frozen weights (``quant.py``) cross the link as bytes and are dequantized on the compute
stream when the unit is fetched, into one device flat per unit in the compute dtype (the template
binds views of it); the dequantized flat lives as long as the fetched unit stays resident, and the
caching allocator hands its memory to the next unit's.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

import torch

from . import host_pages
from .layout import Kind
from .frozen_formats import dequantize_into
from .store import HostStore


@dataclass
class _Upload:
    flats: dict[tuple, tuple[torch.Tensor, int]]  # (owner, source key) -> (device flat, base offset)
    ready: Any  # event recorded on the copy stream after the last copy (None: nothing was copied)
    generation: tuple[int, ...]


class Streamer:
    def __init__(self, store: HostStore, device: torch.device, stats, streams=None) -> None:
        self.store = store
        self.device = device
        self.stats = stats  # EngineStats: h2d_bytes counts link traffic host -> device
        self.streams = streams  # CudaStreams / EmulatedStreams, or None: compute on the host flats
        self.copy_stream = streams.new_stream() if streams is not None else None
        self._inflight: dict[int, _Upload] = {}
        self._resident: tuple[int, _Upload] | None = None
        self._stalls: collections.deque = collections.deque()  # (event before, event after) around waits
        self._stalled_s = 0.0  # stall time of pairs already folded (completed)
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
        self._untrimmed = 0  # bytes of units computed on the host since the heap was last trimmed
        if streams is None:  # large temporaries (gradients, activations) go back to the OS when freed, and
            host_pages.mmap_large()  # what filling the store left in the heap goes before the optimizer's state
            host_pages.trim()

    def _generation(self, u: int) -> tuple[int, ...]:
        generation = self.store.gates.generation
        return tuple(generation[o] for o in self._owners[u])

    def _issue(self, u: int) -> _Upload:
        self.stats.uploads += 1
        started = time.perf_counter()
        for owner in self._owners[u]:
            self.store.gates.wait_ready(owner)  # no background update is writing these masters
        self.stats.optimizer_wait_s += time.perf_counter() - started
        streams = self.streams
        if self.store.sharding is not None:
            if streams is not None and any(o in self.store.remote for o in self._owners[u]):
                self.copy_stream.synchronize()  # no earlier upload still reads the receive slot
            for owner in self._owners[u]:
                self.store.before_read(owner)  # data parallelism: the owner's masters arrive
        flats: dict[tuple, tuple[torch.Tensor, int]] = {}
        if streams is None:
            for owner, key in self._sources[u]:
                host, base = self.store.source(owner, key)
                flats[(owner, key)] = (host if host.dtype == key[1] else host.to(key[1]), base)
                self._untrimmed += host.numel() * host.element_size()
            if self._untrimmed >= host_pages.TRIM_EVERY_BYTES:  # what the computations freed goes back
                host_pages.trim()
                self._untrimmed = 0
            return _Upload(flats, None, self._generation(u))
        with streams.on(self.copy_stream):
            for owner, key in self._sources[u]:
                host, base = self.store.source(owner, key)
                dev = streams.empty(host.shape, host.dtype)
                # pinned source + non_blocking: a DMA on the copy stream, overlapping compute
                dev.copy_(host, non_blocking=True)
                self.stats.h2d_bytes += host.numel() * host.element_size()
                if dev.dtype != key[1]:  # no host staging copy: round the fp32 masters here
                    dev = dev.to(key[1])
                flats[(owner, key)] = (dev, base)
            ready = streams.record(self.copy_stream)
        return _Upload(flats, ready, self._generation(u))

    def prefetch(self, u: int) -> None:
        if self.streams is not None and 0 <= u < len(self._sources) and u not in self._inflight:
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
        if upload.ready is not None:
            self._wait_for(upload)
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

    def _wait_for(self, upload: _Upload) -> None:
        """The compute stream reads the upload only once it landed; a stall is timed with two events."""
        streams = self.streams
        compute = streams.current()
        if upload.ready.query():
            compute.wait_event(upload.ready)  # (already complete: no stall)
        else:
            self.stats.fetches_not_ready += 1
            before = streams.record(compute, timing=True)
            compute.wait_event(upload.ready)
            after = streams.record(compute, timing=True)
            self._stalls.append((before, after))
            self._fold_stalls()
        for dev, _ in upload.flats.values():
            streams.keep_alive(dev, compute)  # allocated on the copy stream, freed after compute

    def exposed_wait_s(self) -> float:
        """Seconds the compute stream waited for uploads since the last call (exposed H2D time).

        Measured by events around each wait whose upload had not landed when it was queued; read
        when the work is done (the metrics read it at log time, after the step).
        """
        stalls, self._stalls = self._stalls, collections.deque()
        total, self._stalled_s = self._stalled_s, 0.0
        for before, after in stalls:
            after.synchronize()
            total += before.elapsed_time(after) / 1e3
        return total

    def _fold_stalls(self, keep: int = 256) -> None:
        """Sum completed pairs so the list stays short when nobody reads the metric (own loops, eval)."""
        while self._stalls and (len(self._stalls) > keep or self._stalls[0][1].query()):
            before, after = self._stalls.popleft()
            after.synchronize()  # a no-op when query() said done; otherwise only past the cap
            self._stalled_s += before.elapsed_time(after) / 1e3

    def device_units(self) -> set[int]:
        """Units whose weights are on the compute device now: the resident one and those in flight."""
        return ({self._resident[0]} if self._resident is not None else set()) | set(self._inflight)

    def drop_prefetched(self) -> None:
        """Forget uploads not consumed yet and the resident unit (end of a pass, an aborted pass)."""
        self._inflight.clear()
        self._resident = None
        self._dequantized = None

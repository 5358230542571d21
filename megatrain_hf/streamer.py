"""Streamer: brings a unit's weights onto the compute device, as views of one upload per source.

``fetch(u)`` returns ``{name: tensor_dev}`` for every tensor unit ``u`` needs. Each host flat the
unit reads (its compute-dtype staging, its fp32 vectors, a tied weight's owner flat, frozen
weights) crosses the link as ONE copy; the entries are views into it, so binding a template is
free. On the CPU the views point straight into the host flats (no copy at all).

Residency lives here and nowhere else: device buffers (unit buffers such as Gemma3's
``embed_scale``) are uploaded once at construction.
"""

from __future__ import annotations

import torch

from .store import HostStore


class Streamer:
    def __init__(self, store: HostStore, device: torch.device, stats) -> None:
        self.store = store
        self.device = device
        self.stats = stats  # EngineStats: h2d_bytes counts link traffic host -> device
        self._buffers_dev: dict[tuple[int, str], torch.Tensor] = {}
        for u, entries in enumerate(store.entries):
            for e in entries:
                if e.kind == "buffer":
                    self._buffers_dev[(u, e.name)] = e.tensor.to(device)
        self._sources: list[list[tuple]] = [
            list(dict.fromkeys((e.owner, e.source) for e in entries if e.kind != "buffer"))
            for entries in store.entries
        ]

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return host
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        # Pinned source + non_blocking: the copy is queued on the current stream, ordered
        # before the compute that reads it and after the compute that last used this memory.
        dev.copy_(host, non_blocking=host.is_pinned())
        self.stats.h2d_bytes += host.numel() * host.element_size()
        return dev

    def fetch(self, u: int) -> dict[str, torch.Tensor]:
        flats: dict[tuple, tuple[torch.Tensor, int]] = {}
        for owner, key in self._sources[u]:
            host, base = self.store.source(owner, key)
            flats[(owner, key)] = (self._upload(host), base)
        tensors: dict[str, torch.Tensor] = {}
        for e in self.store.entries[u]:
            if e.kind == "buffer":
                tensors[e.name] = self._buffers_dev[(u, e.name)]
                continue
            flat_dev, base = flats[(e.owner, e.source)]
            start = e.offset - base
            tensors[e.name] = flat_dev[start : start + e.numel].view(e.shape)
        return tensors

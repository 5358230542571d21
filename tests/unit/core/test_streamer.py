"""core/streamer.py on its own: a Streamer over a HostStore of plain modules, with EmulatedStreams
(the CUDA pipeline's code on the CPU) and without streams (views straight into the host flats)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from megatrain_hf.core.layout import Kind
from megatrain_hf.core.store import HostStore
from megatrain_hf.core.streamer import Streamer
from megatrain_hf.core.streams import EmulatedStreams
from megatrain_hf.stats import EngineStats
from megatrain_hf.errors import BackgroundWorkerError

BF16, FP32 = torch.bfloat16, torch.float32
GUARD_S = 10.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 12)
        self.norm = nn.LayerNorm(12)
        self.base = nn.Linear(12, 8)
        self.base.requires_grad_(False)
        self.register_buffer("scale", torch.tensor([2.0, 3.0]))
        self.register_buffer("positions", torch.arange(5))


def _units():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    return [("embed", emb), ("block", Block()), ("head", head)]


def _make(streams, compute=BF16, staging=True):
    units = _units()
    store = HostStore(units, compute_dtype=compute, pin=False, embedding_units=frozenset({0}), staging=staging)
    stats = EngineStats()
    return Streamer(store, torch.device("cpu"), stats, streams), store, stats, units


def _expected(store, u) -> dict[str, torch.Tensor]:
    """What unit ``u`` computes with: each tensor in its wire dtype."""
    return {e.name: e.tensor.detach().to(e.wire) for e in store.entries[u]}


STREAMS = [pytest.param(lambda: None, id="no-streams"), pytest.param(EmulatedStreams, id="emulated")]


def _inside_host(t: torch.Tensor, store: HostStore) -> bool:
    flats = [f for b in store.buffers for f in (b.master_host, b.staging_host, *b.frozen_host.values())
             if f is not None]
    return any(f.data_ptr() <= t.data_ptr() < f.data_ptr() + f.numel() * f.element_size() for f in flats)


# ---------------------------------------------------------------------- what fetch returns
@pytest.mark.parametrize("make_streams", STREAMS)
@pytest.mark.parametrize("compute,staging", [(BF16, True), (BF16, False), (FP32, True)],
                         ids=["bf16-staged", "bf16-unstaged", "fp32"])
def test_fetch_returns_every_entry_with_its_shape_dtype_and_values(make_streams, compute, staging):
    streamer, store, stats, units = _make(make_streams(), compute, staging)
    for u in range(3):
        tensors = streamer.fetch(u)
        expected = _expected(store, u)
        assert tensors.keys() == expected.keys()
        for name, want in expected.items():
            got = tensors[name]
            assert got.shape == want.shape and got.dtype == want.dtype, (u, name)
            assert torch.equal(got, want), (u, name)
    assert set(streamer.fetch(1)) == {"proj.weight", "proj.bias", "norm.weight", "norm.bias",
                                      "base.weight", "base.bias", "scale", "positions"}
    assert streamer.fetch(1)["positions"].dtype == torch.int64
    # the tied head computes with the embedding's master
    assert torch.equal(streamer.fetch(2)["weight"], units[0][1].weight.detach())


def test_without_streams_the_views_point_into_the_host_flats():
    streamer, store, stats, _ = _make(None)
    tensors = streamer.fetch(1)
    for e in store.entries[1]:
        if e.kind is not Kind.BUFFER:
            assert _inside_host(tensors[e.name], store), e.name
    assert stats.h2d_bytes == 0  # nothing crossed a link


def test_with_streams_the_upload_is_a_copy_and_its_bytes_are_counted():
    streamer, store, stats, _ = _make(EmulatedStreams())
    tensors = streamer.fetch(1)
    for e in store.entries[1]:
        if e.kind is not Kind.BUFFER:
            assert not _inside_host(tensors[e.name], store), e.name
    b = store.buffers[1]
    expected = (b.staging_host.numel() * 2 + (b.master_host.numel() - b.n_staged) * 4
                + b.frozen_host[BF16].numel() * 2 + b.frozen_host[FP32].numel() * 4)
    assert stats.h2d_bytes == expected
    # a copy: a later change of the masters does not reach the fetched tensors
    before = tensors["norm.weight"].clone()
    with torch.no_grad():
        next(e for e in store.entries[1] if e.name == "norm.weight").tensor.add_(1.0)
    assert torch.equal(tensors["norm.weight"], before)


def test_without_staging_the_fp32_masters_cross_and_are_rounded_after():
    streamer, store, stats, _ = _make(EmulatedStreams(), staging=False)
    tensors = streamer.fetch(1)
    b = store.buffers[1]
    assert tensors["proj.weight"].dtype == BF16
    assert stats.h2d_bytes == (b.master_host.numel() * 4 + b.frozen_host[BF16].numel() * 2
                               + b.frozen_host[FP32].numel() * 4)


def test_buffers_are_uploaded_once():
    streamer, store, stats, units = _make(EmulatedStreams())
    first = streamer.fetch(1)["scale"]
    streamer.fetch(0)
    assert streamer.fetch(1)["scale"] is first
    assert torch.equal(first, units[1][1].scale)


# ---------------------------------------------------------------------- reuse
def test_prefetch_then_fetch_reuses_the_upload():
    streamer, _, stats, _ = _make(EmulatedStreams())
    streamer.prefetch(1)
    streamer.prefetch(1)  # already in flight
    assert stats.uploads == 1
    streamer.fetch(1)
    assert (stats.uploads, stats.fetches) == (1, 1)
    streamer.prefetch(-1)
    streamer.prefetch(3)  # out of range: nothing
    assert stats.uploads == 1


def test_without_streams_prefetch_does_nothing():
    streamer, _, stats, _ = _make(None)
    streamer.prefetch(1)
    assert stats.uploads == 0
    streamer.fetch(1)
    assert stats.uploads == 1


@pytest.mark.parametrize("make_streams", STREAMS)
def test_the_resident_unit_is_reused_until_another_is_fetched(make_streams):
    streamer, _, stats, _ = _make(make_streams())
    a = streamer.fetch(1)
    b = streamer.fetch(1)
    assert (stats.uploads, stats.fetches) == (1, 2)
    assert a["proj.weight"].data_ptr() == b["proj.weight"].data_ptr()
    streamer.fetch(0)
    streamer.fetch(1)
    assert stats.uploads == 3


def test_drop_prefetched_forgets_inflight_and_resident_uploads():
    streamer, _, stats, _ = _make(EmulatedStreams())
    streamer.prefetch(1)
    streamer.drop_prefetched()
    streamer.fetch(1)
    assert stats.uploads == 2
    streamer.drop_prefetched()
    streamer.fetch(1)
    assert stats.uploads == 3


# ---------------------------------------------------------------------- stale uploads
def _write_masters(store, u, value):
    """Change unit ``u``'s masters as the optimizer does: the flat, no version bump."""
    b = store.buffers[u]
    b.master_host.fill_(value)


@pytest.mark.parametrize("how", ["mark_dirty", "update"])
def test_an_upload_issued_before_the_masters_changed_is_reissued(how):
    streamer, store, stats, _ = _make(EmulatedStreams())
    streamer.prefetch(1)
    if how == "mark_dirty":
        _write_masters(store, 1, 0.5)
        store.mark_dirty(1)
    else:
        store.gates.begin_update(1)
        _write_masters(store, 1, 0.5)
        store.mark_dirty(1)  # the update marks the staging copy stale
        store.gates.end_update(1)
    tensors = streamer.fetch(1)
    assert stats.uploads == 2
    assert torch.all(tensors["proj.weight"] == 0.5) and torch.all(tensors["norm.weight"] == 0.5)
    # the resident copy goes stale the same way
    _write_masters(store, 1, 0.25)
    store.mark_dirty(1)
    assert torch.all(streamer.fetch(1)["norm.weight"] == 0.25)
    assert stats.uploads == 3


def test_a_tied_weight_upload_goes_stale_with_its_owner():
    streamer, store, stats, _ = _make(EmulatedStreams())
    streamer.fetch(2)
    _write_masters(store, 0, 2.0)
    store.mark_dirty(0)  # the embedding's update changes the head's weight
    assert torch.all(streamer.fetch(2)["weight"] == 2.0)
    assert stats.uploads == 2
    store.mark_dirty(1)  # another unit: the head's upload stays valid
    streamer.fetch(2)
    assert stats.uploads == 2


# ---------------------------------------------------------------------- late events
def test_a_fetch_before_the_upload_landed_is_counted_and_its_wait_measured():
    latency = 0.2
    streamer, _, stats, _ = _make(EmulatedStreams(latency_s=latency))
    streamer.prefetch(1)
    streamer.fetch(1)  # at once: the upload has not landed
    assert (stats.fetches, stats.fetches_not_ready) == (1, 1)
    streamer.prefetch(0)
    time.sleep(latency + 0.05)
    streamer.fetch(0)  # landed meanwhile: no stall
    assert stats.fetches_not_ready == 1
    waited = streamer.exposed_wait_s()
    assert 0.5 * latency <= waited <= latency + 0.05, waited
    assert streamer.exposed_wait_s() == 0.0  # read once


def test_stalls_nobody_reads_are_folded_and_still_counted():
    latency = 0.05
    streamer, _, stats, _ = _make(EmulatedStreams(latency_s=latency))
    for u in (0, 1, 0, 1, 0, 1):
        streamer.fetch(u)  # issued and needed at once: a stall of about one latency
        time.sleep(latency + 0.01)  # the compute stream idles past it: the next stall is its own
    assert stats.fetches_not_ready == 6
    assert 6 * 0.5 * latency <= streamer.exposed_wait_s() <= 6 * latency + 0.05


def test_back_to_back_stalls_overlap_as_on_a_device():
    """Two uploads issued together land together: the second fetch waits only for what is left."""
    latency = 0.2
    streamer, _, stats, _ = _make(EmulatedStreams(latency_s=latency))
    streamer.prefetch(0)
    streamer.prefetch(1)
    streamer.fetch(0)
    streamer.fetch(1)
    assert stats.fetches_not_ready == 2
    assert 0.5 * latency <= streamer.exposed_wait_s() <= latency + 0.05


# ---------------------------------------------------------------------- gates
@pytest.mark.parametrize("make_streams", STREAMS)
def test_fetch_waits_for_the_update_of_its_unit(make_streams):
    streamer, store, stats, _ = _make(make_streams())
    store.gates.begin_update(1)
    result: dict = {}

    def fetch():
        result["tensors"] = {k: v.clone() for k, v in streamer.fetch(1).items()}

    reader = threading.Thread(target=fetch, daemon=True)
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and "tensors" not in result  # blocked on the update
    streamer.fetch(0)  # another unit is not held up
    _write_masters(store, 1, 4.0)
    store.mark_dirty(1)
    store.gates.end_update(1)
    reader.join(GUARD_S)
    assert not reader.is_alive(), "fetch hung"
    assert torch.all(result["tensors"]["proj.weight"] == 4.0)  # read after the update, not before
    assert stats.optimizer_wait_s >= 0.25


def test_fetch_re_raises_a_failed_update():
    streamer, store, _, _ = _make(EmulatedStreams())
    store.gates.begin_update(1)
    store.gates.end_update(1, error=ValueError("adamw failed"))
    with pytest.raises(BackgroundWorkerError, match="adamw failed"):
        streamer.fetch(1)

"""core/store.py on its own: a HostStore built from a few plain modules (no model, no attach)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatrain_hf.core.layout import ALIGN_ELEMS, Kind
from megatrain_hf.core.store import HostStore, unfrozen_error
from megatrain_hf.errors import PinnedMemoryError, UnsupportedModelError

BF16, FP32 = torch.bfloat16, torch.float32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 12)
        self.norm = nn.LayerNorm(12)
        self.base = nn.Linear(12, 8)  # frozen, as a PEFT base weight
        self.base.requires_grad_(False)
        self.register_buffer("scale", torch.tensor([2.0, 3.0]))

    def forward(self, x):
        return self.base(self.norm(self.proj(x))) * self.scale[0]


def _units(seed: int = 0):
    torch.manual_seed(seed)
    emb = nn.Embedding(10, 8)
    block = Block()
    head = nn.Linear(8, 10, bias=False)
    head.weight = emb.weight  # tied: lives in the embedding's flat
    return [("embed", emb), ("block", block), ("head", head)]


def _store(compute=BF16, staging=True, seed=0):
    units = _units(seed)
    originals = {(u, n): p.detach().clone() for u, (_, m) in enumerate(units)
                 for n, p in m.named_parameters(remove_duplicate=False)}
    store = HostStore(units, compute_dtype=compute, pin=False, embedding_units=frozenset({0}), staging=staging)
    return store, units, originals


def _entry(store, u, name):
    return next(e for e in store.entries[u] if e.name == name)


def _inside(t: torch.Tensor, flat: torch.Tensor) -> bool:
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end


# ---------------------------------------------------------------------- layout and aliasing
def test_parameters_are_repointed_into_the_flats_with_a_storage_each():
    store, units, originals = _store()
    seen_storages = []
    for u, (_, module) in enumerate(units):
        for name, p in module.named_parameters(remove_duplicate=False):
            e = _entry(store, u, name)
            assert e.tensor is p  # the registered Parameter object is kept
            assert torch.equal(p.detach(), originals[(u, name)].to(p.dtype))  # values kept (frozen: rounded)
            owner = store.buffers[e.owner]
            flat = owner.master_host if e.kind is Kind.TRAINABLE else owner.frozen_host[e.wire]
            assert _inside(p, flat), (u, name)
            assert p.data_ptr() == flat.data_ptr() + e.offset * flat.element_size()
            if e.owner == u:
                # a storage of its own, covering exactly the tensor (not the flat)
                storage = p.untyped_storage()
                assert storage.data_ptr() == p.data_ptr()
                assert storage.nbytes() == p.numel() * p.element_size()
                seen_storages.append(storage.data_ptr())
    assert len(seen_storages) == len(set(seen_storages))
    # writes through the parameter land in the flat, and the other way round
    p = units[1][1].proj.weight
    e = _entry(store, 1, "proj.weight")
    with torch.no_grad():
        p.fill_(0.25)
    assert torch.all(store.buffers[1].master_host[e.offset : e.offset + e.numel] == 0.25)
    store.buffers[1].master_host[e.offset] = -1.0
    assert p.reshape(-1)[0].item() == -1.0


def test_trainable_layout_staged_matrices_first_then_fp32():
    store, _, _ = _store()
    block = store.entries[1]
    kinds = {e.name: (e.kind, e.wire) for e in block}
    assert kinds["proj.weight"] == (Kind.TRAINABLE, BF16)
    assert kinds["proj.bias"] == (Kind.TRAINABLE, FP32)
    assert kinds["norm.weight"] == (Kind.TRAINABLE, FP32)
    assert kinds["base.weight"] == (Kind.FROZEN, BF16)
    assert kinds["base.bias"] == (Kind.FROZEN, FP32)
    assert kinds["scale"] == (Kind.BUFFER, FP32)
    bufs = store.buffers[1]
    assert bufs.n_staged == 96  # proj.weight only (12 * 8)
    assert bufs.staging_host is not None and bufs.staging_host.dtype == BF16 and bufs.staging_host.numel() == 96
    for e in store.owned_trainable(1):
        assert e.offset % ALIGN_ELEMS == 0
        assert (e.offset < bufs.n_staged) == (e.wire == BF16)
    # the embedding table is fp32-wire: no staging copy at all
    assert store.buffers[0].n_staged == 0 and store.buffers[0].staging_host is None


def test_tied_weight_lives_once_in_the_owner_flat():
    store, units, _ = _store()
    emb, head = units[0][1], units[2][1]
    tied = _entry(store, 2, "weight")
    own = _entry(store, 0, "weight")
    assert tied.owner == 0 and tied.offset == own.offset and tied.kind is Kind.TRAINABLE
    assert head.weight is emb.weight and _inside(head.weight, store.buffers[0].master_host)
    # the head owns nothing: no flats of its own
    assert store.owned_trainable(2) == []
    assert store.buffers[2].master_host is None and store.buffers[2].grad_host is None
    assert store.entries_of(2, Kind.TRAINABLE) == [tied]
    assert store.home_of(head.weight) == (0, own)
    assert store.accumulators.region(tied).data_ptr() == store.accumulators.region(own).data_ptr()
    assert store.trainable_numel() == sum(b.master_host.numel() for b in store.buffers[:2])


def test_frozen_parameters_live_in_the_frozen_flat_of_their_wire_dtype():
    store, units, originals = _store()
    block = units[1][1]
    frozen = store.buffers[1].frozen_host
    assert set(frozen) == {BF16, FP32}
    assert frozen[BF16].dtype == BF16 and frozen[FP32].dtype == FP32
    # the bf16 flat holds the weight rounded (it is its only copy: no fp32 master)
    assert block.base.weight.dtype == BF16 and _inside(block.base.weight, frozen[BF16])
    assert torch.equal(block.base.weight.detach(), originals[(1, "base.weight")].to(BF16))
    assert block.base.bias.dtype == FP32 and _inside(block.base.bias, frozen[FP32])
    assert not _inside(block.base.weight, store.buffers[1].master_host)
    assert not block.base.weight.requires_grad
    storage = block.base.weight.untyped_storage()  # the bf16 alias has a storage of its own as well
    assert storage.nbytes() == block.base.weight.numel() * 2
    assert store.entries_of(1, Kind.FROZEN) == [_entry(store, 1, "base.weight"), _entry(store, 1, "base.bias")]


def test_fp32_compute_has_no_staging_and_every_master_is_fp32_wire():
    store, _, _ = _store(compute=FP32)
    for u, bufs in enumerate(store.buffers):
        assert bufs.staging_host is None and bufs.n_staged == 0
        assert all(e.wire == FP32 for e in store.entries[u] if e.kind is not Kind.BUFFER)


def test_a_parameter_off_the_cpu_is_refused():
    lin = nn.Linear(4, 4, device="meta")
    with pytest.raises(UnsupportedModelError, match=r"u\.weight is on meta.*model\s+on the CPU"):
        HostStore([("u", lin)], compute_dtype=BF16, pin=False)


# ---------------------------------------------------------------------- source()
def test_source_sends_the_staging_copy_and_stages_it():
    store, units, _ = _store()
    proj = units[1][1].proj.weight
    flat, base = store.source(1, (Kind.TRAINABLE, BF16))
    assert flat is store.buffers[1].staging_host and base == 0
    e = _entry(store, 1, "proj.weight")
    assert torch.equal(flat[e.offset : e.offset + e.numel].view(e.shape), proj.detach().to(BF16))


def test_source_sends_fp32_vectors_from_the_masters_with_their_base():
    store, _, _ = _store()
    bufs = store.buffers[1]
    flat, base = store.source(1, (Kind.TRAINABLE, FP32))
    assert base == bufs.n_staged and flat.dtype == FP32
    assert flat.data_ptr() == bufs.master_host[bufs.n_staged :].data_ptr()
    e = _entry(store, 1, "norm.weight")
    assert torch.equal(flat[e.offset - base : e.offset - base + e.numel], e.tensor.detach())


def test_source_without_staging_sends_fp32_masters_to_be_rounded_on_the_device():
    store, _, _ = _store(staging=False)
    bufs = store.buffers[1]
    assert bufs.staging_host is None
    flat, base = store.source(1, (Kind.TRAINABLE, BF16))
    assert base == 0 and flat.dtype == FP32 and flat.numel() == bufs.n_staged
    assert flat.data_ptr() == bufs.master_host.data_ptr()
    assert store.staging.slice(_entry(store, 1, "proj.weight")) is None


def test_source_of_frozen_weights_is_their_flat():
    store, _, _ = _store()
    for dtype in (BF16, FP32):
        flat, base = store.source(1, (Kind.FROZEN, dtype))
        assert flat is store.buffers[1].frozen_host[dtype] and base == 0


def test_staging_slice():
    store, _, _ = _store()
    e = _entry(store, 1, "proj.weight")
    sl = store.staging.slice(e)
    assert sl.data_ptr() == store.buffers[1].staging_host.data_ptr() + e.offset * 2 and sl.numel() == e.numel
    assert store.staging.slice(_entry(store, 1, "norm.weight")) is None  # sent in fp32


# ---------------------------------------------------------------------- staging freshness
def _staging_matches(store, u) -> bool:
    bufs = store.buffers[u]
    return torch.equal(bufs.staging_host, bufs.master_host[: bufs.n_staged].to(BF16))


def test_stage_and_version_counters():
    store, units, _ = _store()
    proj = units[1][1].proj.weight
    assert not store.staging.fresh(1)  # never staged
    store.staging.stage(1)
    assert store.staging.fresh(1) and _staging_matches(store, 1)
    with torch.no_grad():
        proj.add_(1.0)  # an in-place edit bumps the parameter's version counter
    assert not store.staging.fresh(1)
    store.staging.stage(1)
    assert store.staging.fresh(1) and _staging_matches(store, 1)
    # load_state_dict copies in place too
    units[1][1].load_state_dict({k: v + 1 for k, v in units[1][1].state_dict().items()})
    assert not store.staging.fresh(1)
    store.staging.stage(1)
    assert _staging_matches(store, 1)
    assert not store.staging.fresh(0)  # a unit without a staging copy is never fresh


def test_mark_dirty_catches_writes_the_version_counters_miss():
    store, _, _ = _store()
    store.staging.stage(1)
    gen = list(store.gates.generation)
    bufs = store.buffers[1]
    bufs.master_host[: bufs.n_staged] += 1.0  # as the fused AdamW kernel writes: no version bump
    assert store.staging.fresh(1)  # the counters did not see it ...
    store.staging.stage(1)
    assert not _staging_matches(store, 1)  # ... so stage() does not copy
    store.mark_dirty(1)
    assert not store.staging.fresh(1)
    assert store.gates.generation == [gen[0], gen[1] + 1, gen[2]]
    store.staging.stage(1)
    assert store.staging.fresh(1) and _staging_matches(store, 1)
    store.mark_dirty()  # every unit
    assert store.gates.generation == [gen[0] + 1, gen[1] + 2, gen[2] + 1]
    assert not store.staging.fresh(1)


def test_staging_written_marks_the_copy_fresh_without_copying():
    store, units, _ = _store()
    bufs = store.buffers[1]
    store.staging.stage(1)
    with torch.no_grad():
        units[1][1].proj.weight.mul_(3.0)  # the update changes the masters ...
    bufs.staging_host.copy_(bufs.master_host[: bufs.n_staged])  # ... and writes their bf16 copy itself
    bufs.staging_host[0] = 123.0  # a value stage() would overwrite
    assert not store.staging.fresh(1)
    store.staging.written(1)
    assert store.staging.fresh(1)
    store.staging.stage(1)
    assert bufs.staging_host[0].item() == 123.0  # not re-staged
    store.mark_dirty(1)
    store.staging.stage(1)
    assert _staging_matches(store, 1)


# ---------------------------------------------------------------------- gradients
def test_grad_region_is_the_entry_slice_of_the_owner_accumulator():
    store, _, _ = _store()
    for u in range(3):
        for e in store.entries_of(u, Kind.TRAINABLE):
            region = store.accumulators.region(e)
            grad_host = store.buffers[e.owner].grad_host
            assert region.numel() == e.numel
            assert region.data_ptr() == grad_host.data_ptr() + 4 * e.offset
    assert all(float(b.grad_host.abs().sum()) == 0 for b in store.buffers if b.grad_host is not None)


def test_accumulate_grad_copies_then_adds():
    store, units, _ = _store()
    e = _entry(store, 1, "proj.weight")
    p = units[1][1].proj.weight
    region = store.accumulators.region(e)
    region.fill_(7.0)  # stale content from an earlier step (zero_grad(set_to_none=True) leaves it)
    assert not store.accumulators.holds(e)
    g1 = torch.randn(e.shape)
    store.accumulators.accumulate(e, g1)
    assert store.accumulators.holds(e) and p.grad.data_ptr() == region.data_ptr()
    assert torch.equal(p.grad, g1)  # copied, not added to the stale 7s
    g2 = torch.randn(e.shape).to(BF16)  # a bf16 gradient adds in fp32
    store.accumulators.accumulate(e, g2)
    assert p.grad.dtype == FP32
    assert torch.equal(p.grad, g1 + g2.float())
    p.grad = None  # zero_grad(set_to_none=True)
    store.accumulators.accumulate(e, g2)
    assert torch.equal(p.grad, g2.float())


def test_accumulate_grad_adds_into_a_user_replaced_grad():
    store, units, _ = _store()
    e = _entry(store, 1, "norm.weight")
    p = units[1][1].norm.weight
    store.accumulators.accumulate(e, torch.ones(e.shape))
    mine = torch.full(e.shape, 10.0)
    p.grad = mine
    assert not store.accumulators.holds(e)
    store.accumulators.accumulate(e, torch.full(e.shape, 2.0, dtype=BF16))
    assert p.grad is mine and torch.equal(mine, torch.full(e.shape, 12.0))
    assert torch.equal(store.accumulators.region(e), torch.ones(e.numel))  # the accumulator is left alone


def test_tied_contributions_accumulate_in_the_owner_region():
    store, units, _ = _store()
    own, tied = _entry(store, 0, "weight"), _entry(store, 2, "weight")
    a, b = torch.randn(own.shape), torch.randn(own.shape)
    store.accumulators.accumulate(own, a)
    store.accumulators.accumulate(tied, b)
    assert torch.equal(units[0][1].weight.grad, a + b)
    assert store.accumulators.holds(own) and store.accumulators.holds(tied)


def test_unfrozen_error_names_the_parameter_and_the_fix():
    err = unfrozen_error("model.layers.3", "mlp.up_proj.weight")
    assert isinstance(err, ValueError)
    msg = str(err)
    assert "model.layers.3.mlp.up_proj.weight" in msg
    assert "requires_grad" in msg and "detach()" in msg and "attach" in msg


# ---------------------------------------------------------------------- pinning (fake cudart)
class FakeCudart:
    def __init__(self, refuse: bool = False) -> None:
        self.live: dict[int, int] = {}
        self.refuse = refuse

    def cudaHostRegister(self, ptr, size, flags):
        if self.refuse:
            return 2  # cudaErrorMemoryAllocation
        assert ptr not in self.live
        self.live[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        del self.live[ptr]
        return 0


def test_a_pinned_store_registers_every_flat_and_release_unregisters_them(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    store = HostStore(_units(), compute_dtype=BF16, pin=True, embedding_units=frozenset({0}))
    flats = [t for b in store.buffers
             for t in (b.master_host, b.grad_host, b.staging_host, *b.frozen_host.values()) if t is not None]
    assert len(flats) == 7  # embed: master, grad; block: master, grad, staging, frozen bf16 and fp32
    assert sorted(cudart.live) == sorted(f.data_ptr() for f in flats)
    for f in flats:
        assert cudart.live[f.data_ptr()] >= f.numel() * f.element_size()
    store.release()
    assert cudart.live == {}
    store.release()  # idempotent


def test_free_unpins_only_that_flat(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    store = HostStore(_units(), compute_dtype=BF16, pin=True, embedding_units=frozenset({0}))
    before = dict(cudart.live)
    extra = store.allocate(1000, FP32)
    assert extra.data_ptr() in cudart.live and len(cudart.live) == len(before) + 1
    store.free(torch.empty(10))  # not one of the store's: ignored
    store.free(extra)
    assert cudart.live == before
    store.free(extra)  # a second free is a no-op
    assert cudart.live == before
    store.release()


def test_an_empty_flat_is_not_pinned(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    store = HostStore.__new__(HostStore)
    store.pin, store._registered = True, []
    flat = store.allocate(0, FP32)
    assert flat.numel() == 0 and cudart.live == {}


def test_a_refused_registration_raises_with_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(refuse=True))
    with pytest.raises(PinnedMemoryError, match=r"cudaHostRegister refused.*\(error 2\).*pin_memory=False"):
        HostStore(_units(), compute_dtype=BF16, pin=True)


def test_an_unpinned_store_never_calls_cudart(monkeypatch):
    def no_cudart():
        raise AssertionError("cudart called without pinning")

    monkeypatch.setattr(torch.cuda, "cudart", no_cudart)
    store = HostStore(_units(), compute_dtype=BF16, pin=False)
    store.release()
    del store

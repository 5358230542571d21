"""core/activation_offload.py on its own: CheckpointOffload with EmulatedStreams (the CUDA code path on the CPU)
and without streams; a pool over plain host tensors and an ``available_bytes`` the test controls."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from megatrain_hf.core import activation_offload as offload_module
from megatrain_hf.core.activation_offload import CheckpointOffload
from megatrain_hf.core.streams import EmulatedStreams
from megatrain_hf.stats import EngineStats
from megatrain_hf.errors import HostMemoryError, UsageError

MiB = 2**20


class Pool:
    """A CheckpointOffload plus a record of what it allocated and freed."""

    def __init__(self, streams=None, available=lambda: 1 << 40, headroom: int = 0) -> None:
        self.allocated: list[torch.Tensor] = []
        self.freed: list[torch.Tensor] = []
        self.stats = EngineStats()
        self.offload = CheckpointOffload(self._allocate, self.freed.append, available, headroom, self.stats, streams)

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        flat = torch.empty(numel, dtype=dtype)
        self.allocated.append(flat)
        return flat

    def buffer_of(self, ckpt) -> int:
        """Index in ``allocated`` of the buffer holding ``ckpt``."""
        ptr = ckpt.host.data_ptr()
        for i, flat in enumerate(self.allocated):
            if flat.data_ptr() <= ptr < flat.data_ptr() + flat.numel() * flat.element_size():
                return i
        raise AssertionError("checkpoint outside the pool")


STREAMS = [pytest.param(lambda: None, id="no-streams"), pytest.param(EmulatedStreams, id="emulated"),
           pytest.param(lambda: EmulatedStreams(latency_s=0.01), id="emulated-late")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float32,):
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=g)
    x[0, 0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])  # bytes, not just values
    return [
        x.requires_grad_(),
        torch.randn(4, 5, generator=g).to(torch.bfloat16),
        torch.randn(7, generator=g).to(torch.float16).requires_grad_(),
        torch.randint(0, 1000, (3, 4), generator=g),
        torch.rand(6, generator=g) > 0.5,
    ]


# ---------------------------------------------------------------------- round trip
@pytest.mark.parametrize("make_streams", STREAMS)
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetched", "loaded"])
def test_save_prefetch_load_returns_the_same_bytes(make_streams, prefetch):
    pool = Pool(make_streams())
    inputs = _inputs()
    ckpts, prev = [], None
    for x in inputs:
        prev = pool.offload.save(x, prev)
        ckpts.append(prev)
    for ckpt in reversed(ckpts):  # backward order
        if prefetch:
            pool.offload.prefetch(ckpt)
            pool.offload.prefetch(ckpt)  # started already: no second upload
    for x, ckpt in zip(inputs, ckpts):
        out = pool.offload.load(ckpt)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert torch.equal(_bits(out), _bits(x.detach()))
        assert out.requires_grad == x.requires_grad
        assert out.is_leaf
    nbytes = sum(x.numel() * x.element_size() for x in inputs)
    assert pool.stats.d2h_bytes == nbytes and pool.stats.h2d_bytes == nbytes


def test_checkpoints_link_to_the_one_saved_before():
    pool = Pool(EmulatedStreams())
    a = pool.offload.save(torch.ones(3), None)
    b = pool.offload.save(torch.ones(3), a)
    assert b.prev is a and a.prev is None
    pool.offload.prefetch(None)  # nothing before the first: a no-op


@pytest.mark.parametrize("make_streams", STREAMS)
def test_a_loaded_checkpoint_does_not_alias_the_pool(make_streams):
    """The buffer returns to the pool once the checkpoint goes; what load returned must not change
    when a later save reuses that buffer."""
    pool = Pool(make_streams())
    ckpt = pool.offload.save(torch.full((16,), 1.0), None)
    out = pool.offload.load(ckpt)
    del ckpt
    gc.collect()
    pool.offload.save(torch.full((16,), 2.0), None)
    assert len(pool.allocated) == 1  # the buffer was reused ...
    assert torch.equal(out, torch.full((16,), 1.0))  # ... and the loaded tensor is a copy


def test_a_second_load_of_one_checkpoint_is_refused():
    pool = Pool(EmulatedStreams())
    ckpt = pool.offload.save(torch.ones(4), None)
    pool.offload.load(ckpt)
    with pytest.raises(UsageError, match=r"used by a second backward over the same\s+graph.*retain_graph=True"):
        pool.offload.load(ckpt)
    pool.offload.prefetch(ckpt)  # loaded: a no-op, not an error


# ---------------------------------------------------------------------- pool
def test_buffers_are_reused_best_fit_by_size():
    pool = Pool(EmulatedStreams())
    off = pool.offload
    kept = [off.save(torch.zeros(n), None) for n in (100, 60, 200)]
    assert len(pool.allocated) == 3 and off.pool_bytes == 4 * 360 and off.in_use_bytes == 4 * 360
    del kept
    gc.collect()  # dropped without a backward: their buffers return to the pool
    assert off.in_use_bytes == 0 and off.peak_in_use_bytes == 4 * 360
    a = off.save(torch.zeros(55), None)
    assert pool.buffer_of(a) == 1  # the 60: the smallest that fits
    b = off.save(torch.zeros(61), None)
    assert pool.buffer_of(b) == 0  # the 100 (the 60 is taken)
    c = off.save(torch.zeros(150), None)
    assert pool.buffer_of(c) == 2
    assert len(pool.allocated) == 3 and off.pool_bytes == 4 * 360
    assert off.in_use_bytes == 4 * (55 + 61 + 150)
    d = off.save(torch.zeros(10), None)  # nothing free: the pool grows
    assert len(pool.allocated) == 4 and off.pool_bytes == 4 * 370
    e = off.save(torch.zeros(10, dtype=torch.bfloat16), None)  # other dtype: its own buffers
    assert len(pool.allocated) == 5 and pool.allocated[-1].dtype == torch.bfloat16
    for ckpt in (a, b, c, d, e):
        off.load(ckpt)
    del a, b, c, d, e, ckpt
    gc.collect()
    assert off.in_use_bytes == 0 and pool.freed == []


def test_the_pool_refuses_with_the_arithmetic_when_ram_is_short():
    headroom = 1 * MiB
    pool = Pool(EmulatedStreams(), available=lambda: headroom + int(1.5 * MiB), headroom=headroom)
    off = pool.offload
    held = off.save(torch.zeros(MiB // 4), None)  # 1 MiB: fits
    with pytest.raises(HostMemoryError) as info:
        off.save(torch.zeros(MiB // 2), None)  # 2 MiB more: 2.5 MiB available, 1 MiB kept free
    msg = str(info.value)
    assert "needs 2.00 MiB more host RAM (the pool holds 1.00 MiB; 2.50 MiB available, 1.00 MiB kept free)" in msg
    assert "offload_checkpoints=False" in msg and "gradient_accumulation_steps" in msg
    assert len(pool.allocated) == 1 and off.pool_bytes == MiB  # nothing was taken
    huge = torch.zeros(1).expand(100 * MiB)  # 400 MiB counted, none allocated
    with pytest.raises(HostMemoryError, match=r"needs 0\.39 GiB more host RAM"):
        off.save(huge, None)
    del held


def test_short_ram_unpins_free_buffers_too_small_and_then_allocates():
    headroom = MiB
    total = headroom + int(2.5 * MiB)
    pools: list[CheckpointOffload] = []
    pool = Pool(EmulatedStreams(), available=lambda: total - pools[0].pool_bytes, headroom=headroom)
    off = pool.offload  # the machine's free RAM shrinks as the pool grows
    pools.append(off)
    small = off.save(torch.zeros(MiB // 4), None)  # 1 MiB
    del small
    gc.collect()
    big = off.save(torch.zeros(MiB // 2), None)  # 2 MiB: only fits once the free 1 MiB buffer is gone
    assert [f.data_ptr() for f in pool.freed] == [pool.allocated[0].data_ptr()]
    assert off.pool_bytes == 2 * MiB and pool.buffer_of(big) == 1
    del big


def test_a_free_buffer_large_enough_is_used_even_when_ram_is_short():
    room = [1 << 40]
    pool = Pool(EmulatedStreams(), available=lambda: room[0], headroom=MiB)
    off = pool.offload
    first = off.save(torch.zeros(1000), None)
    del first
    gc.collect()
    room[0] = 0  # no RAM left: the pool still serves what it holds
    again = off.save(torch.zeros(900), None)
    assert pool.buffer_of(again) == 0 and pool.freed == []


# ---------------------------------------------------------------------- in-place changes
def test_an_input_modified_in_place_before_its_copy_is_refused():
    latency = 0.05
    pool = Pool(EmulatedStreams(latency_s=latency))
    x = torch.randn(8)
    ckpt = pool.offload.save(x, None)
    x.mul_(2)  # the copy has not landed yet
    time.sleep(latency + 0.02)
    with pytest.raises(UsageError, match="modified in place after the layer used it"):
        pool.offload.load(ckpt)


def test_an_input_modified_in_place_is_refused_when_the_queue_is_full():
    """The compute stream runs at most MAX_PENDING downloads ahead; the oldest is waited for and
    checked then, even if its event has not completed."""
    pool = Pool(EmulatedStreams(latency_s=10.0))  # no event completes during the test
    x = torch.randn(8)
    pool.offload.save(x, None)
    x.add_(1)
    for _ in range(offload_module.MAX_PENDING - 1):
        pool.offload.save(torch.randn(8), None)
    with pytest.raises(UsageError, match="modified in place"):
        pool.offload.save(torch.randn(8), None)


def test_an_input_left_alone_is_not_refused():
    latency = 0.02
    pool = Pool(EmulatedStreams(latency_s=latency))
    xs = [torch.randn(8) for _ in range(offload_module.MAX_PENDING + 2)]
    ckpts = [pool.offload.save(x, None) for x in xs]
    later = torch.randn(8)  # a tensor never saved may change freely
    later.add_(1)
    time.sleep(latency + 0.02)
    for x, ckpt in zip(xs, ckpts):
        assert torch.equal(pool.offload.load(ckpt), x)

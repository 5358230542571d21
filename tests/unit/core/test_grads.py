"""core/grads.py on its own: a GradSink over a HostStore of plain modules, with EmulatedStreams (the
CUDA pipeline's code on the CPU: worker thread, round trip, device norms) and without streams."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from megatrain_hf.core import grads as grads_module
from megatrain_hf.core.grads import GradSink
from megatrain_hf.core.layout import Kind
from megatrain_hf.core.store import HostStore
from megatrain_hf.core.streams import EmulatedStreams, _EmulatedEvent
from megatrain_hf.stats import EngineStats
from megatrain_hf.errors import BackgroundWorkerError

BF16, FP32 = torch.bfloat16, torch.float32
GUARD_S = 20.0


def _units(blocks: int = 2):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = emb.weight  # tied: the head's contribution belongs to the embedding's accumulator
    layers = [(f"block{i}", nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))) for i in range(blocks)]
    return [("embed", emb), *layers, ("head", head)]


class Rig:
    def __init__(self, streams=None, blocks: int = 2) -> None:
        self.units = _units(blocks)
        self.store = HostStore(self.units, compute_dtype=BF16, pin=False, embedding_units=frozenset({0}))
        self.stats = EngineStats()
        self.sink = GradSink(self.store, self.stats, streams)
        self.head = len(self.units) - 1

    def entries(self, u):
        return self.store.entries_of(u, Kind.TRAINABLE)

    def grads(self, u, scale: float = 1.0, dtype=FP32, seed: int = 0):
        g = torch.Generator().manual_seed(seed * 100 + u)
        return [(scale * torch.randn(e.shape, generator=g)).to(dtype) for e in self.entries(u)]

    def all_params(self):
        seen, out = set(), []
        for u in range(len(self.units)):
            for e in self.store.owned_trainable(u):
                if id(e.tensor) not in seen:
                    seen.add(id(e.tensor))
                    out.append(e.tensor)
        return out

    def close(self):
        self.sink.close()


@pytest.fixture(params=["no-streams", "emulated"])
def rig(request):
    r = Rig(EmulatedStreams(latency_s=0.03) if request.param == "emulated" else None)
    yield r
    r.close()


@pytest.fixture
def emulated():
    r = Rig(EmulatedStreams(latency_s=0.05))
    yield r
    r.close()


def _reference_norm(params) -> torch.Tensor:
    clones = [nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(clones, params):
        c.grad = None if p.grad is None else p.grad.detach().clone()
    return torch.nn.utils.clip_grad_norm_(clones, max_norm=float("inf"))


# ---------------------------------------------------------------------- copy, then add
def test_first_contribution_copies_later_ones_add(rig):
    u = 1
    for e in rig.entries(u):
        rig.store.accumulators.region(e).fill_(9.0)  # what an earlier step left (zero_grad set .grad to None)
    g1, g2 = rig.grads(u, dtype=BF16, seed=1), rig.grads(u, dtype=BF16, seed=2)
    rig.sink.submit(u, rig.entries(u), g1)
    rig.sink.submit(u, rig.entries(u), g2)  # emulated: before the first one landed
    rig.sink.wait()
    for e, a, b in zip(rig.entries(u), g1, g2):
        assert rig.store.accumulators.holds(e)
        assert e.tensor.grad.dtype == FP32
        assert torch.equal(e.tensor.grad, a.float() + b.float())  # the host's fp32 add, bit for bit


def test_the_round_trip_moves_the_accumulator_up_and_the_sum_down(emulated):
    u = 1
    numel = sum(e.numel for e in emulated.entries(u))
    emulated.sink.submit(u, emulated.entries(u), emulated.grads(u))
    emulated.sink.wait()
    assert (emulated.stats.h2d_bytes, emulated.stats.d2h_bytes) == (0, 4 * numel)  # a copy down only
    emulated.sink.submit(u, emulated.entries(u), emulated.grads(u, seed=1))
    emulated.sink.wait()
    assert (emulated.stats.h2d_bytes, emulated.stats.d2h_bytes) == (4 * numel, 8 * numel)
    assert emulated.stats.grad_stream_bytes == 12 * numel


def test_a_none_gradient_leaves_its_parameter_alone(rig):
    u = 1
    entries = rig.entries(u)
    grads = rig.grads(u)
    grads[1] = None
    rig.sink.submit(u, entries, grads)
    rig.sink.wait()
    assert entries[1].tensor.grad is None and entries[0].tensor.grad is not None


def test_a_user_replaced_grad_is_added_into(rig):
    u = 1
    entries = rig.entries(u)
    rig.sink.submit(u, entries, rig.grads(u))
    rig.sink.wait()
    mine = torch.ones(entries[0].shape)
    entries[0].tensor.grad = mine
    g = rig.grads(u, seed=3)
    rig.sink.submit(u, entries, g)
    rig.sink.wait()
    assert entries[0].tensor.grad is mine and torch.equal(mine, 1 + g[0])


# ---------------------------------------------------------------------- norms
def test_cached_norms_are_the_final_accumulators_norms(rig):
    final = [True]
    rig.sink.final_microbatch = lambda: final[0]
    u = 1
    final[0] = False  # an early micro-batch: no norms wanted
    rig.sink.submit(u, rig.entries(u), rig.grads(u, seed=1))
    rig.sink.wait()
    assert rig.sink.norms[u] is None
    final[0] = True
    rig.sink.submit(u, rig.entries(u), rig.grads(u, seed=2))
    rig.sink.wait()
    key, norms = rig.sink.norms[u]
    assert key == rig.sink.grad_key(u)
    expected = [torch.linalg.vector_norm(e.tensor.grad) for e in rig.store.owned_trainable(u)]
    assert torch.equal(torch.stack(norms), torch.stack(expected))


def test_an_in_place_change_of_grad_invalidates_the_cached_norms(rig):
    u = 1
    rig.sink.submit(u, rig.entries(u), rig.grads(u))
    rig.sink.wait()
    key = rig.sink.grad_key(u)
    assert rig.sink.norms[u][0] == key
    before = rig.sink.global_norm()
    with torch.no_grad():
        rig.entries(u)[0].tensor.grad.mul_(3.0)  # a training_step override scaling a gradient
    assert rig.sink.grad_key(u) != key
    after = rig.sink.global_norm()
    assert after > before
    assert torch.equal(after, _reference_norm(rig.all_params()))
    rig.entries(u)[1].tensor.grad = torch.zeros(rig.entries(u)[1].shape)  # a replaced tensor
    assert torch.equal(rig.sink.global_norm(), _reference_norm(rig.all_params()))


def test_global_norm_equals_clip_grad_norm(rig):
    for u in reversed(range(len(rig.units))):  # backward order: head first
        rig.sink.submit(u, rig.entries(u), rig.grads(u, seed=5))
    norm = rig.sink.global_norm()
    assert torch.equal(norm, _reference_norm(rig.all_params()))


def test_global_norm_without_gradients_is_zero(rig):
    assert float(rig.sink.global_norm()) == 0.0


# ---------------------------------------------------------------------- tied weights
def test_tied_contributions_are_summed_once(rig):
    head, emb = rig.head, 0
    g_head, g_emb = rig.grads(head, seed=1)[0], rig.grads(emb, seed=2)[0]
    rig.sink.submit(head, rig.entries(head), [g_head])  # kept on the device until the owner submits
    rig.sink.submit(emb, rig.entries(emb), [g_emb])
    rig.sink.wait()
    weight = rig.units[0][1].weight
    assert torch.equal(weight.grad, g_head + g_emb)
    assert rig.stats.d2h_bytes == (4 * weight.numel() if rig.sink.streams is not None else 0)  # one send
    assert torch.equal(rig.sink.global_norm(), _reference_norm(rig.all_params()))


def test_a_tied_contribution_whose_owner_did_not_run_is_flushed_at_wait(rig):
    head = rig.head
    g_head = rig.grads(head, seed=1)[0]
    rig.sink.submit(head, rig.entries(head), [g_head])
    rig.sink.wait()
    assert torch.equal(rig.units[0][1].weight.grad, g_head)
    assert torch.equal(rig.sink.global_norm(), _reference_norm(rig.all_params()))


def test_a_tensor_listed_twice_in_a_unit_gets_the_sum(rig):
    u = 1
    e = rig.entries(u)[0]
    a, b = torch.randn(e.shape), torch.randn(e.shape)
    rig.sink.submit(u, [e, e], [a, b])
    rig.sink.wait()
    assert torch.equal(e.tensor.grad, a + b)


# ---------------------------------------------------------------------- layer-major groups
def test_group_sums_are_sent_once_per_unit_after_its_last_call(rig):
    sink, head, u = rig.sink, rig.head, 1
    sink.begin_group()
    assert sink.in_group
    for _ in range(2):  # two micro-batches' forwards
        for v in range(len(rig.units)):
            sink.count_call(v)
    micro = [{v: rig.grads(v, seed=m) for v in range(len(rig.units))} for m in range(2)]
    weight = rig.units[0][1].weight
    # layer-major backward: the head's two calls, then each layer's two calls
    for m in range(2):
        sink.submit(head, rig.entries(head), micro[m][head])
    assert weight.grad is None  # the embedding's own calls are still to come
    sink.submit(u + 1, rig.entries(u + 1), micro[0][u + 1])
    sink.submit(u + 1, rig.entries(u + 1), micro[1][u + 1])
    sink.submit(u, rig.entries(u), micro[0][u])
    assert all(e.tensor.grad is None for e in rig.entries(u))  # held: one call of unit u to go
    sent_before = rig.stats.d2h_bytes
    sink.submit(u, rig.entries(u), micro[1][u])
    if sink.streams is not None:
        assert rig.stats.d2h_bytes - sent_before == 4 * sum(e.numel for e in rig.entries(u))  # one send
    sink.submit(0, rig.entries(0), micro[0][0])
    assert weight.grad is None
    sink.submit(0, rig.entries(0), micro[1][0])
    sink.wait()
    sink.end_group()
    assert not sink.in_group
    for v in (u, u + 1):
        for i, e in enumerate(rig.entries(v)):
            assert torch.equal(e.tensor.grad, micro[0][v][i] + micro[1][v][i])
    expected = (micro[0][head][0] + micro[1][head][0]) + (micro[0][0][0] + micro[1][0][0])
    assert torch.allclose(weight.grad, expected, rtol=0, atol=1e-6)
    assert torch.equal(sink.global_norm(), _reference_norm(rig.all_params()))


def test_group_sums_of_calls_that_did_not_run_backward_are_flushed_at_wait(rig):
    sink, u = rig.sink, 1
    sink.begin_group()
    sink.count_call(u)
    sink.count_call(u)
    g = rig.grads(u)
    sink.submit(u, rig.entries(u), g)  # the second call's backward never runs
    assert all(e.tensor.grad is None for e in rig.entries(u))
    sink.wait()
    sink.end_group()
    for e, want in zip(rig.entries(u), g):
        assert torch.equal(e.tensor.grad, want)


def test_drop_held_forgets_a_failed_group(rig):
    sink, u = rig.sink, 1
    sink.begin_group()
    sink.count_call(u)
    sink.count_call(u)
    sink.submit(u, rig.entries(u), rig.grads(u))
    sink.drop_held()
    sink.wait()
    sink.end_group()
    assert all(e.tensor.grad is None for e in rig.entries(u))


# ---------------------------------------------------------------------- back-pressure
def test_back_pressure_bounds_the_sends_and_never_hangs():
    latency = 0.1
    rig = Rig(EmulatedStreams(latency_s=latency), blocks=6)
    try:
        sent = {}
        n = grads_module.MAX_PENDING_SENDS + 3

        def backward():
            for u in range(1, 1 + n):
                sent[u] = rig.grads(u)
                rig.sink.submit(u, rig.entries(u), sent[u])
            rig.sink.wait()

        t = threading.Thread(target=backward, daemon=True)
        started = time.perf_counter()
        t.start()
        t.join(GUARD_S)
        assert not t.is_alive(), "back-pressure hung"
        # the compute waited for the link: with at most MAX_PENDING_SENDS in flight, n sends of one
        # latency each take at least n / MAX_PENDING_SENDS latencies
        assert time.perf_counter() - started >= (n // grads_module.MAX_PENDING_SENDS) * latency * 0.9
        assert rig.stats.grad_wait_s > 0
        for u, grads in sent.items():
            for e, g in zip(rig.entries(u), grads):
                assert torch.equal(e.tensor.grad, g)
    finally:
        rig.close()


# ---------------------------------------------------------------------- tensor hooks
def test_a_tensor_hook_runs_on_the_whole_gradient_before_accumulation(rig):
    weight = rig.units[0][1].weight
    seen, order = [], []

    def hook(g):
        seen.append(g.clone())
        order.append(("hook", None if weight.grad is None else weight.grad.clone()))
        return 2 * g

    weight.register_hook(hook)
    weight.register_post_accumulate_grad_hook(lambda p: order.append(("post", p.grad.clone())))
    assert rig.sink.hooked_parameters() == ["embed.weight"]
    g_head, g_emb = rig.grads(rig.head, seed=1)[0], rig.grads(0, seed=2)[0]
    rig.sink.submit(rig.head, rig.entries(rig.head), [g_head])
    rig.sink.submit(0, rig.entries(0), [g_emb])
    rig.sink.wait()
    assert len(seen) == 1  # once, on the sum of the tied contributions: as autograd does
    assert seen[0].dtype == FP32 and seen[0].device.type == "cpu" and seen[0].shape == weight.shape
    assert torch.equal(seen[0], g_head + g_emb)
    assert torch.equal(weight.grad, 2 * (g_head + g_emb))
    assert [o[0] for o in order] == ["hook", "post"]
    assert order[0][1] is None  # the hook ran before accumulation ...
    assert torch.equal(order[1][1], weight.grad)  # ... the post-accumulate hook after it
    # a second backward pass: the hook sees that pass's gradient only, the sum accumulates
    rig.sink.submit(0, rig.entries(0), [g_emb])
    rig.sink.wait()
    assert torch.equal(seen[1], g_emb)
    assert torch.equal(weight.grad, 2 * (g_head + g_emb) + 2 * g_emb)
    assert torch.equal(rig.sink.global_norm(), _reference_norm(rig.all_params()))


# ---------------------------------------------------------------------- worker errors
class _BrokenEvent(_EmulatedEvent):
    def synchronize(self) -> None:
        raise OSError("the link went away")


class BrokenLink(EmulatedStreams):
    """Emulated streams whose transfer events fail when waited for, once ``broken`` is set."""

    broken = False

    def record(self, stream, *, timing: bool = False, blocking: bool = False):
        event = super().record(stream, timing=timing, blocking=blocking)
        if self.broken and stream is not self.current():
            return _BrokenEvent(event._done_at)
        return event


def test_a_worker_error_is_re_raised_in_the_caller():
    streams = BrokenLink()
    rig = Rig(streams)
    try:
        u = 1
        streams.broken = True
        rig.sink.submit(u, rig.entries(u), rig.grads(u))
        with pytest.raises(BackgroundWorkerError, match="gradient accumulation failed.*the link went away") as info:
            rig.sink.wait()
        assert isinstance(info.value.__cause__, OSError)
        streams.broken = False
        rig.sink.wait()  # reported once
        for e in rig.entries(u):
            e.tensor.grad = None  # zero_grad after the failed step
        g = rig.grads(u, seed=1)
        rig.sink.submit(u, rig.entries(u), g)  # the worker survived to serve the next pass
        rig.sink.wait()
        for e, want in zip(rig.entries(u), g):
            assert torch.equal(e.tensor.grad, want)
        streams.broken = True
        rig.sink.submit(u, rig.entries(u), rig.grads(u, seed=2))
        deadline = time.perf_counter() + GUARD_S
        with pytest.raises(BackgroundWorkerError, match="the link went away"):  # what submit() checks first
            while time.perf_counter() < deadline:
                rig.sink.raise_error()
                time.sleep(0.01)
        streams.broken = False
        rig.sink.wait()
    finally:
        rig.close()


def test_hooks_run_on_a_tied_contribution_whose_owner_did_not_run(rig):
    """The head's contribution flushed at wait() (the embedding unit did not run: inputs_embeds) is
    the tied weight's whole gradient of the pass: its hooks run on it, once, on the sum of the calls."""
    weight = rig.units[0][1].weight
    seen, post = [], []
    weight.register_hook(lambda g: (seen.append(g.clone()), 2 * g)[1])
    weight.register_post_accumulate_grad_hook(lambda p: post.append(p.grad.clone()))
    a, b = rig.grads(rig.head, seed=1)[0], rig.grads(rig.head, seed=2)[0]
    rig.sink.submit(rig.head, rig.entries(rig.head), [a])
    rig.sink.submit(rig.head, rig.entries(rig.head), [b])  # the head called twice in the pass
    rig.sink.wait()
    assert len(seen) == 1 and torch.equal(seen[0], a + b)
    assert torch.equal(weight.grad, 2 * (a + b))
    assert len(post) == 1 and torch.equal(post[0], weight.grad)
    assert torch.equal(rig.sink.global_norm(), _reference_norm(rig.all_params()))

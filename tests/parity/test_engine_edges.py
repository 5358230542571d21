"""Engine edge cases found in review: each test failed before its fix."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.helpers import tiny_model
from megatrain_hf import attach


def _loss(model):
    torch.manual_seed(0)  # same dropout masks in every call
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return model(input_ids=ids, labels=ids).loss


def test_backward_twice_with_retain_graph():
    ref = tiny_model("llama")
    _loss(ref).backward()
    expected = {n: 2 * p.grad.clone() for n, p in ref.named_parameters()}
    model = tiny_model("llama")
    attach(model, device="cpu")
    loss = _loss(model)
    loss.backward(retain_graph=True)
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], atol=1e-6, rtol=1e-5, msg=n)


def test_dropped_model_is_freed():
    model = tiny_model("llama")
    attach(model, device="cpu")
    _loss(model).backward()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "the engine (and the model with its host buffers) leaked"


def test_failed_backward_does_not_poison_the_next_one():
    model = tiny_model("llama")
    engine = attach(model, device="cpu")
    original = engine.runner.recompute_backward
    calls = {"n": 0}

    def failing(call, x, grad_out, *rest):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return original(call, x, grad_out, *rest)

    engine.runner.recompute_backward = failing
    with pytest.raises(RuntimeError, match="injected failure"):
        _loss(model).backward()
    engine.runner.recompute_backward = original
    assert not engine.runner.backward_pending
    model.zero_grad()
    _loss(model).backward()  # a clean pass afterwards gives the plain gradients
    ref = tiny_model("llama")
    _loss(ref).backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_load_state_dict_restages_bf16_copy():
    model = tiny_model("llama")
    engine = attach(model, device="cpu", bf16=True)
    model.eval()
    with torch.no_grad():
        before = _loss(model).item()
    state = {k: v * 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    with torch.no_grad():
        after = _loss(model).item()
    fresh = tiny_model("llama")
    fresh.load_state_dict(state)
    fresh.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _loss(fresh).item()
    assert after != before
    assert abs(after - expected) < 1e-3, (after, expected)
    engine.detach()


def test_pinned_flats_register_whole_pages_of_their_own(monkeypatch):
    """cudaHostRegister refuses a range that shares a page with one already registered (error 712,
    seen on the H200 with a tiny model's 1 KiB norm flats): each pinned flat gets pages of its own."""
    from megatrain_hf.core.store import PAGE_BYTES as _PAGE, HostStore

    registered: list[tuple[int, int]] = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            for start, span in registered:
                if ptr < start + span and start < ptr + size:
                    return 712  # cudaErrorHostMemoryAlreadyRegistered
            registered.append((ptr, size))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    store = HostStore.__new__(HostStore)
    store.pin, store._registered = True, []
    flats = [store.allocate(n, dtype) for n in (1, 7, 256, 3000, 100_000) for dtype in (torch.float32, torch.bfloat16)]
    assert len(registered) == len(flats)
    for flat, (ptr, size) in zip(flats, registered):
        assert ptr == flat.data_ptr() and ptr % _PAGE == 0 and size % _PAGE == 0
        assert size >= flat.numel() * flat.element_size()
        flat.fill_(1)  # the whole flat is writable memory


def test_store_unpins_its_flats_when_collected(monkeypatch):
    """A store dropped without release() (a model never detached) must unregister its memory before
    malloc can hand it out again; the next registration of those pages would fail (error 712)."""
    from megatrain_hf.core.store import HostStore

    live: dict[int, int] = {}

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            live[ptr] = size
            return 0

        def cudaHostUnregister(self, ptr):
            del live[ptr]
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    model = tiny_model("llama")
    store = HostStore(list(model.named_children())[:1], compute_dtype=torch.bfloat16, pin=True)
    assert live
    del store
    gc.collect()
    assert not live


def test_backward_failing_outside_the_engine_does_not_disarm_the_next_one():
    """autograd drops the end-of-backward callback when a pass fails in a node that is not the
    engine's; the next pass must still wait for its gradients (keyed by graph task)."""
    model = tiny_model("gemma", attention_dropout=0.0)  # embedding * normaliser: a plain node between units
    engine = attach(model, device="cpu")
    ids = torch.randint(0, 128, (2, 16))
    fail = [True]

    def hook(module, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)
        if fail[0] and h is not None and h.requires_grad:
            h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("simulated failure")))

    model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    with pytest.raises(RuntimeError, match="simulated failure"):
        model(input_ids=ids, labels=ids).loss.backward()
    fail[0] = False
    ran = []
    original = engine.runner.backward_done
    engine.runner.backward_done = lambda: (ran.append(1), original())
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    assert ran and not engine.runner.backward_pending


def test_gradient_round_trip_on_an_emulated_grad_stream():
    """The CUDA gradient pipeline itself (GradSink with streams), on the CPU: copies run at once, their
    events complete late, so the worker sees them land after the next send was queued. A unit sent
    twice before the worker caught up sums both contributions (the second adds to the first instead
    of copying over it), and the norms cached for clipping are those of the final gradients."""
    from megatrain_hf.core.layout import Kind
    from megatrain_hf.core.streams import EmulatedStreams

    model = tiny_model("llama")
    engine = attach(model, device="cpu", streams=EmulatedStreams(latency_s=0.05))
    sink = engine.grads
    try:
        u = 1
        entries = engine.store.entries_of(u, Kind.TRAINABLE)
        sink.submit(u, entries, [torch.ones_like(e.tensor) for e in entries])
        sink.submit(u, entries, [2 * torch.ones_like(e.tensor) for e in entries])  # before the first landed
        sink.wait()
        assert {float(v) for e in entries for v in e.tensor.grad.unique()} == {3.0}
        expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(e.tensor.grad) for e in entries]))
        cached_key, cached = sink.norms[u]
        assert cached_key == sink.grad_key(u)
        assert torch.allclose(torch.linalg.vector_norm(torch.stack(cached)), expected)
    finally:
        engine.detach()


def test_sub_module_hook_outputs_are_differentiable():
    """What a sub-module's forward hook keeps is part of the graph, as in plain PyTorch: a loss on it
    (here the MLP outputs and the attention outputs, a tuple) trains the weights that made it. Before
    the streamed call returned such tensors as outputs of its node, they were computed without a
    graph and their loss term reached no weight."""

    def run(model, engine=None):
        kept = []
        model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: kept.append(out))
        model.model.layers[1].self_attn.register_forward_hook(lambda m, a, k, out: kept.append(out[0]),
                                                              with_kwargs=True)
        seen = []  # an observing hook that keeps nothing: its output stays unused
        model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: seen.append(out.shape))
        loss = _loss(model)
        assert len(kept) == 2 and all(t.requires_grad for t in kept)
        (loss + 0.5 * sum(t.square().mean() for t in kept)).backward()
        if engine is not None:
            engine.synchronize()
        assert len(seen) == 1  # observing hooks run once per forward, not again in the recompute
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    expected = run(tiny_model("llama"))
    model = tiny_model("llama")
    got = run(model, attach(model, device="cpu"))
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], atol=1e-6, rtol=0, msg=n)

"""An incoming gradient megatrain owns alone takes a tiled layer's input gradient (runtime/grad_ownership.py,
tiling ``ResidualGrad.into``): bitwise the same gradients, the recomputed output's storage freed; where
anyone else may hold the gradient (a tensor hook, ``retain_grad``, a module backward hook, a shared
storage) it is never written into."""

from __future__ import annotations

import logging

import pytest
import torch

from megatrain_hf import MegaTrainConfig, attach
from megatrain_hf.runtime import grad_ownership, streamed_call, tiling
from tests.helpers import tiny_model
from tests.unit.runtime.test_tiling_residual import TILE, _layer, _two_buffers


def _seed(shape, seed=5):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_the_handed_gradient_takes_the_input_gradient_and_the_output_is_freed():
    recipe, layer, x, kwargs = _layer()
    params = [p for p in layer.parameters() if p.requires_grad]
    xx = x.clone().requires_grad_(True)
    ref = torch.autograd.grad(_two_buffers(recipe, layer, xx, kwargs, TILE), [xx, *params], _seed(x.shape))
    g = _seed(x.shape)
    out = tiling.tiled_layer(recipe, layer, xx, kwargs, TILE, g)
    assert out.untyped_storage().nbytes() == 0 and out.shape == x.shape  # only its grad_fn and shape are left
    got = torch.autograd.grad(out, [xx, *params], g)
    assert got[0].data_ptr() == g.data_ptr()  # the input's gradient in the incoming gradient's storage
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_another_incoming_gradient_than_the_handed_one_is_not_written():
    recipe, layer, x, kwargs = _layer()
    xx = x.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(_two_buffers(recipe, layer, xx, kwargs, TILE), xx, _seed(x.shape))
    handed, seed = _seed(x.shape), _seed(x.shape)
    out = tiling.tiled_layer(recipe, layer, xx, kwargs, TILE, handed)
    (got,) = torch.autograd.grad(out, xx, seed)
    assert torch.equal(got, ref) and got.data_ptr() not in (handed.data_ptr(), seed.data_ptr())
    assert torch.equal(handed, _seed(x.shape)) and torch.equal(seed, _seed(x.shape))


def _step(family="llama", enabled=True, before_backward=None, prepare=None):
    """One training forward and backward of a tiny model with whole tiled layers (tiles of 5 tokens):
    the parameters' gradients, what ``owns`` answered in backward order (head, norm, layers last to
    first, embedding), and what ``before_backward(outs)`` returned, ``outs`` the streamed calls' outputs
    in forward order (embedding, layers, norm, head); ``prepare(model)``: after attach, before the forward."""
    model = tiny_model(family, attention_dropout=0.0)
    engine = attach(model, MegaTrainConfig(sequence_tile_tokens=5), device="cpu")
    if prepare is not None:
        prepare(model)
    ownership = engine.runner.ownership
    ownership.enabled = enabled
    answers, owns = [], ownership.owns
    ownership.owns = lambda node, grad: answers.append(owns(node, grad)) or answers[-1]
    outs, watch = [], streamed_call.watch_output
    streamed_call.watch_output = lambda out: outs.append(out) or watch(out)
    try:
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        outputs = model(input_ids=ids, labels=ids)
    finally:
        streamed_call.watch_output = watch
    kept = before_backward(outs) if before_backward is not None else None
    del outs
    tiled_before = engine.stats.tiled_layer_calls
    outputs.loss.backward()
    assert engine.stats.tiled_layer_calls - tiled_before == 2  # both layers recomputed whole-tiled
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    engine.detach()
    return grads, answers, kept


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_owned_chain_is_bitwise_the_unowned_one(family, monkeypatch, caplog):
    layers_out = []
    tiled = tiling.tiled_layer

    def spy(*args):
        out = tiled(*args)
        layers_out.append(out)  # its storage: freed when the incoming gradient was handed over
        return out

    monkeypatch.setattr(streamed_call, "tiled_layer", spy)
    with caplog.at_level(logging.INFO, logger="megatrain_hf.runtime.streamed_call"):
        owned, answers, _ = _step(family)
    assert not [r for r in caplog.records if "may be held by someone else" in r.getMessage()]
    # the head's input gradient is a view (not handed); the norm's and both layers' are megatrain's
    assert answers == [False, False, True, True, True]
    assert [o.untyped_storage().nbytes() == 0 for o in layers_out] == [False, False, True, True]  # forwards, recomputes
    plain, answers, _ = _step(family, enabled=False)
    assert answers == [False] * 5
    _same(owned, plain)


def _hook_on_layer_output(outs):
    """A tensor hook on layer 0's output that keeps the gradient it sees (a clone of it on the side)."""
    kept = []
    outs[1].register_hook(lambda g: kept.append((g, g.clone())) and None)
    return kept


def test_a_tensor_hook_keeping_the_gradient_is_never_written_into(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="megatrain_hf.runtime.streamed_call"):
        grads, answers, kept = _step(before_backward=_hook_on_layer_output)
    assert answers == [False, False, True, False, True]  # layer 0 (4th) received the hooked gradient
    said = [r.getMessage() for r in caplog.records if "may be held by someone else" in r.getMessage()]
    assert len(said) == 1 and "model.layers.0's incoming gradient" in said[0]
    (held, copy), = kept
    assert torch.equal(held, copy)
    ref_grads, _, ((ref, _),) = _step(enabled=False, before_backward=_hook_on_layer_output)
    _same(grads, ref_grads)
    assert torch.equal(held, ref)
    # the hook table is what protects it: without it, layer 0 writes its input's gradient into what the hook kept
    monkeypatch.setattr(streamed_call, "watch_output", lambda out: None)
    monkeypatch.setattr(grad_ownership.GradOwnership, "owns",
                        lambda self, node, grad: any(t is grad for t in self._handed))
    _, _, ((held, copy),) = _step(before_backward=_hook_on_layer_output)
    assert not torch.equal(held, copy)


def test_retain_grad_and_module_backward_hooks_keep_the_gradient_unwritten():
    def retain(outs):
        outs[1].retain_grad()
        return outs[1]

    grads, answers, kept = _step(before_backward=retain)
    assert answers == [False, False, True, False, True]
    ref, _, ref_kept = _step(enabled=False, before_backward=retain)
    _same(grads, ref)
    assert torch.equal(kept.grad, ref_kept.grad)

    seen = []

    def full_backward_hook(model):  # on layer 1's module: it gets the gradient layer 1 receives
        model.model.layers[1].register_full_backward_pre_hook(lambda module, grad_output: seen.append(grad_output))

    grads, answers, _ = _step(prepare=full_backward_hook)
    assert answers == [False] * 5 and len(seen) == 1
    _same(grads, ref)
    for where in (lambda m: m.model, lambda m: m.model.norm):  # a container of the units, a unit beside the layers
        _, answers, _ = _step(prepare=lambda model: where(model).register_full_backward_hook(lambda *a: None))
        assert answers == [False] * 5


def test_a_shared_storage_or_an_unhanded_gradient_is_not_owned():
    ownership = grad_ownership.GradOwnership([])

    class Node:  # what watch_output leaves on a streamed call's node
        tensor_hooks: dict = {}
        output_ref = staticmethod(lambda: None)

    g = torch.randn(2, 3)
    assert not ownership.owns(Node, g)  # never handed
    ownership.hand(g, None, owned=False)
    view = g.view(6)
    assert not ownership.owns(Node, g)  # another tensor reads its storage
    del view
    ownership.hand(g, None, owned=False)
    assert ownership.owns(Node, g)
    assert not ownership.owns(Node, g)  # handed once, taken once
    incoming = torch.randn(2, 3)
    ownership.hand(incoming[:], incoming, owned=False)  # the unowned incoming gradient passed through
    assert ownership._handed == []

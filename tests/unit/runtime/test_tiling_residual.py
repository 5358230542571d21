"""A tiled layer's input gradient in one buffer, the storage of the layer's output (runtime/tiling.py,
``ResidualGrad``): bitwise the gradients of two buffers summed by autograd, and safe where the output
cannot lend its storage (dead, reused by a retained graph's second backward)."""

from __future__ import annotations

import weakref

import pytest
import torch

from megatrain_hf.models.layer_recipes import RECIPES
from megatrain_hf.runtime import tiling
from tests.helpers import tiny_model

SEQ, TILE = 24, 7


def _layer():
    model = tiny_model("llama", attention_dropout=0.0)
    layer = model.model.layers[0]
    x = torch.randn(2, SEQ, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(SEQ).expand(2, SEQ)
    cos, sin = model.model.rotary_emb(x, pos)
    kwargs = {"position_embeddings": (cos, sin), "attention_mask": None, "position_ids": pos}
    return RECIPES["llama"], layer, x, kwargs


def _two_buffers(recipe, layer, x, kwargs, tile):
    """The layer as before ResidualGrad: each piece returns its own gradient of ``x``, autograd sums them."""
    cos, sin = kwargs["position_embeddings"]
    rows = tiling.tile_rows(tile, x.shape[0], max(x.shape[-1], recipe.widest(layer)))
    q, k, v = tiling.tiled_call(recipe.pre(layer), recipe.pre_modules(layer), rows, x, cos, sin)
    attn = recipe.attend(layer, q, k, v, kwargs)
    (out,) = tiling.tiled_call(recipe.post(layer), recipe.post_modules(layer), rows, x, attn)
    return out


def _grads(forward, recipe, layer, x, kwargs):
    """The gradients of ``x`` and the layer's weights, the output's data pointer."""
    x = x.clone().requires_grad_(True)
    params = [p for p in layer.parameters() if p.requires_grad]
    out = forward(recipe, layer, x, kwargs, TILE)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    return torch.autograd.grad(out, [x, *params], g), out.data_ptr()


def test_one_buffer_is_bitwise_the_two_buffers_sum():
    recipe, layer, x, kwargs = _layer()
    ref, _ = _grads(_two_buffers, recipe, layer, x, kwargs)
    got, out_ptr = _grads(tiling.tiled_layer, recipe, layer, x, kwargs)
    assert got[0].data_ptr() == out_ptr  # the input's gradient lives in the output's storage
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    # and it is the untiled layer's within fp32 rounding
    xx = x.clone().requires_grad_(True)
    params = [p for p in layer.parameters() if p.requires_grad]
    whole = layer(xx, **kwargs)
    whole = whole[0] if isinstance(whole, tuple) else whole
    plain = torch.autograd.grad(whole, [xx, *params], torch.randn(whole.shape, generator=torch.Generator().manual_seed(5)))
    for a, b in zip(plain, got):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_dead_output_gets_a_new_buffer():
    recipe, layer, x, kwargs = _layer()
    ref, _ = _grads(_two_buffers, recipe, layer, x, kwargs)
    xx = x.clone().requires_grad_(True)
    params = [p for p in layer.parameters() if p.requires_grad]
    out = tiling.tiled_layer(recipe, layer, xx, kwargs, TILE)
    loss = (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum()
    alive = weakref.ref(out)
    del out  # MulBackward keeps the factor, not the output: the output tensor is freed
    assert alive() is None
    got = torch.autograd.grad(loss, [xx, *params])
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_a_retained_graph_keeps_the_first_backwards_gradient():
    recipe, layer, x, kwargs = _layer()
    xx = x.clone().requires_grad_(True)
    out = tiling.tiled_layer(recipe, layer, xx, kwargs, TILE)
    g1 = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    g2 = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    (first,) = torch.autograd.grad(out, xx, g1, retain_graph=True)
    kept = first.clone()
    (second,) = torch.autograd.grad(out, xx, g2)
    assert torch.equal(first, kept)  # the second backward wrote elsewhere
    assert second.data_ptr() != first.data_ptr()
    (again,) = torch.autograd.grad(_two_buffers(recipe, layer, xx, kwargs, TILE), xx, g2)
    assert torch.equal(second, again)


@pytest.mark.parametrize("wanted", ["x", "weights"])
def test_the_input_or_the_weights_alone(wanted):
    """Only the weights wanted: the first piece's backward may not run, the handed buffer is dropped;
    only the input: the same gradient."""
    recipe, layer, x, kwargs = _layer()
    params = [p for p in layer.parameters() if p.requires_grad]
    results = []
    for forward in (_two_buffers, tiling.tiled_layer):
        xx = x.clone().requires_grad_(True)
        out = forward(recipe, layer, xx, kwargs, TILE)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        results.append(torch.autograd.grad(out, [xx] if wanted == "x" else params, g))
    for a, b in zip(*results):
        assert torch.equal(a, b)

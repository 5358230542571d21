"""Sequence tiling inside a unit's compute and recompute (exact: per-token math, tile by tile).

At long sequence lengths a decoder layer's largest activations are per-token: the MLP's
``tokens x intermediate`` tensors (gate, up, their product), and around the attention core the
norms' outputs, the projections before rotary embedding, the o projection's output and the
residual sums. Tiling runs such per-token math over ``tile`` tokens at a time, so what it computes
inside exists for one tile only:

* :class:`TiledTokens`, an ``autograd.Function`` running ``fn(*inputs)`` over tiles of the
  sequence dimension (dim 1): its forward runs without a graph, tile by tile, into full-length
  outputs, and saves only its inputs; its backward recomputes and back-propagates tile by tile
  (as Snowflake ALST's ``TiledMLP`` does), writing the inputs' gradients into full-length buffers
  and summing the weights' gradients over the tiles in fp32;
* a whole decoder layer (:func:`tiled_layer`), for families with a layer recipe
  (``models/layer_recipes.py``): input norm, q/k/v projections and rotary embedding in one
  ``TiledTokens``; the attention kernel on the full q, k, v (HF's attention interface, unchanged);
  the o projection, residual add, post-attention norm and MLP in a second ``TiledTokens``. Inside
  the layer the only full-length tensors left are its input and output, q, k, v, the attention
  output, their gradients and the attention kernel's workspace. Both pieces read the layer's input
  (the residual stream): its gradient is one full-length buffer, the gradient flowing into the layer
  when the caller hands it over (the output's storage is then freed), else the storage of the layer's
  output (:class:`ResidualGrad`), which the second piece's backward fills and the first piece's adds to;
* the MLP alone (:func:`tiled`), for every other layer whose MLP is tileable.

The weights are inputs of the Function (they are the recompute's leaves, so their gradients reach
the unit's ``autograd.grad``); the template is unbound by the time the backward runs, so the
backward binds them again around each tile's recompute. Every per-tile kernel has fewer than
2^31 elements (``MAX_TILE_ELEMENTS``): int32-indexed kernels fail beyond (ALST reports an illegal
memory access at 555K tokens of an 8 B model).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch
from torch import nn

from .autocast import autocast_state

MLP_ATTRS = ("mlp", "feed_forward")
"""Attributes of a decoder layer under which families keep their MLP."""

MAX_TILE_ELEMENTS = 2**31 - 1
"""No tile's widest tensor may have more elements than this (int32 indexing)."""


def tileable_mlp(layer: nn.Module) -> nn.Module | None:
    """The MLP of ``layer`` if tiling it is exact and safe (see module docstring), else None."""
    mlp = next((getattr(layer, a) for a in MLP_ATTRS if isinstance(getattr(layer, a, None), nn.Module)), None)
    if mlp is None or "forward" in mlp.__dict__:  # someone else's forward: left alone
        return None
    for module in mlp.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return None
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            return None
        if module._parameters and not isinstance(module, nn.Linear):
            return None
    return mlp if any(isinstance(m, nn.Linear) for m in mlp.modules()) else None


def mlp_width(mlp: nn.Module) -> int:
    """The widest output of the MLP's linear layers (its intermediate width)."""
    return max(m.out_features for m in mlp.modules() if isinstance(m, nn.Linear))


def bound_params(modules: list[nn.Module]) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, name, tensor) of every parameter slot of ``modules`` and their sub-modules, once each."""
    seen, out = set(), []
    for root in modules:
        for m in root.modules():
            for name, p in m._parameters.items():
                if p is not None and (id(m), name) not in seen:
                    seen.add((id(m), name))
                    out.append((m, name, p))
    return out


@contextlib.contextmanager
def _bound(slots: list[tuple[nn.Module, str]], tensors: tuple[torch.Tensor, ...]):
    old = [m._parameters[name] for m, name in slots]
    for (m, name), t in zip(slots, tensors):
        m._parameters[name] = t
    try:
        yield
    finally:
        for (m, name), t in zip(slots, old):
            m._parameters[name] = t


def _tiles(tokens: int, tile: int):
    for start in range(0, tokens, tile):
        yield start, min(tokens, start + tile)


def _tile_loop(fn: Callable, inputs: tuple[torch.Tensor, ...], rows: int) -> list[torch.Tensor]:
    """``fn`` over slices ``[:, start:end]`` of ``inputs``, its outputs written into full-length ones."""
    length = inputs[0].shape[1]
    outs = None
    for start, end in _tiles(length, rows):
        ys = fn(*[t[:, start:end] for t in inputs])
        if outs is None:
            outs = [y.new_empty((y.shape[0], length, *y.shape[2:])) for y in ys]
        for out, y in zip(outs, ys):
            out[:, start:end] = y
        del ys
    return outs


class ResidualGrad:
    """One full-length buffer for the gradient of the input both pieces of a tiled layer read (the
    layer's input ``x``: the residual stream), instead of one per piece summed by autograd.

    The second piece (``out = x + o(attn) + mlp(...)``) is back-propagated first: ``give`` writes its
    part of ``dL/dx``, tile by tile, into the storage of its own forward output (the layer's output,
    which only its ``grad_fn`` is needed for once the backward runs), hands that buffer over and
    returns no gradient for ``x``; the first piece's backward (``take``) adds its part tile by tile
    and returns the sum, ``dL/dx = post + pre`` as autograd's own accumulation would add them. Without
    the output (a different dtype or shape, or no longer alive) ``give`` writes into a new buffer.

    With ``into`` (the gradient of the layer's output, handed over by a caller that owns it alone:
    ``runtime/grad_ownership.py``) ``give`` writes into ``into`` instead, each tile once the tile has read
    its part of it (the second piece is per token: tile ``[s, e)`` of the output's gradient is read by
    that tile only), and :func:`tiled_layer` frees the output's storage right after building the graph
    (the backward needs only its ``grad_fn`` and shape): one full-length tensor fewer. Should the
    backward receive another tensor than ``into`` for the output, ``give`` writes into a new buffer.

    The output's storage is overwritten: the caller must not read the layer's output once its
    backward has run. The engine builds a tiled layer's graph only in a unit's recompute
    (``runtime/streamed_call.py``), whose output is dropped after ``torch.autograd.grad``; an autograd
    node that saved the output has run its backward before this one (it is downstream), and a second
    backward over a retained graph would find the output's version changed and raise, not misread it
    (and gets a new buffer: the output's storage is used once, it holds the first backward's result).
    """

    __slots__ = ("buffer", "into")

    def __init__(self, into: torch.Tensor | None = None) -> None:
        self.buffer: torch.Tensor | None = None
        self.into = into  # the output's gradient, the caller's to give (see above); used once

    def take(self) -> torch.Tensor | None:
        buffer, self.buffer = self.buffer, None
        return buffer


class TiledTokens(torch.autograd.Function):
    """``fn(*inputs) -> tuple of tensors``, per-token along dim 1, over tiles of ``rows`` positions;
    the backward recomputes tile by tile (module docstring). Inputs that need no gradient (rotary
    tables) are sliced like the others."""

    @staticmethod
    def forward(ctx, fn: Callable, slots: list, rows: int, autocast: tuple, n_in: int, residual: tuple | None,
                *args: torch.Tensor):
        ctx.fn, ctx.slots, ctx.rows, ctx.autocast, ctx.n_in = fn, slots, rows, autocast, n_in
        ctx.save_for_backward(*args)
        with torch.no_grad():
            outs = tuple(_tile_loop(fn, args[:n_in], rows))
        # residual: None, ("give", ResidualGrad) (input 0's gradient into output 0's storage, handed over)
        # or ("take", ResidualGrad) (input 0's gradient added to the buffer handed over)
        ctx.residual, ctx.out_used = residual, False
        # "give" lends output 0's storage, unless the output's gradient is handed over (then it is freed)
        lends = residual is not None and residual[0] == "give" and residual[1].into is None
        ctx.out0 = weakref.ref(outs[0]) if lends else None
        return outs

    @staticmethod
    def backward(ctx, *grad_outs: torch.Tensor):
        saved = ctx.saved_tensors
        inputs, params = saved[: ctx.n_in], saved[ctx.n_in :]
        need_in = list(ctx.needs_input_grad[6 : 6 + ctx.n_in])
        need_p = list(ctx.needs_input_grad[6 + ctx.n_in :])
        grad_in = [torch.zeros_like(x) if n else None for x, n in zip(inputs[1:], need_in[1:])]
        grad_in.insert(0, _residual_buffer(ctx, inputs[0], grad_outs[0]) if need_in[0] else None)
        sums: list[torch.Tensor | None] = [None] * len(params)
        adds = ctx.residual is not None and ctx.residual[0] == "take"
        device_type, (enabled, dtype, cache) = inputs[0].device.type, ctx.autocast
        for start, end in _tiles(inputs[0].shape[1], ctx.rows):
            leaves = [p.detach().requires_grad_(n) for p, n in zip(params, need_p)]
            with torch.enable_grad(), _bound(ctx.slots, tuple(leaves)), torch.autocast(
                    device_type, dtype=dtype, enabled=enabled, cache_enabled=cache):
                xs = [x[:, start:end].detach().requires_grad_(n) for x, n in zip(inputs, need_in)]
                ys = ctx.fn(*xs)
            pairs = [(y, g[:, start:end]) for y, g in zip(ys, grad_outs) if g is not None and y.requires_grad]
            wanted = [x for x, n in zip(xs, need_in) if n] + [leaf for leaf, n in zip(leaves, need_p) if n]
            grads = list(torch.autograd.grad([y for y, _ in pairs], wanted, [g for _, g in pairs],
                                             allow_unused=True)) if pairs and wanted else [None] * len(wanted)
            del ys, pairs
            for k, n in enumerate(need_in):
                if n:
                    g = grads.pop(0)
                    # after this tile's gradients are computed: the buffer may be the output's storage
                    if k == 0 and adds:
                        if g is not None:
                            grad_in[0][:, start:end] += g
                    elif g is not None:
                        grad_in[k][:, start:end] = g
                    elif k == 0:  # the buffer may hold the output's values: zeros, as zeros_like would
                        grad_in[0][:, start:end] = 0
            for k, n in enumerate(need_p):
                if n:
                    g = grads.pop(0)
                    if g is not None:
                        sums[k] = g.float() if sums[k] is None else sums[k].add_(g)
        pgrads = [s.to(p.dtype) if s is not None else None for s, p in zip(sums, params)]
        if ctx.residual is not None and ctx.residual[0] == "give" and grad_in[0] is not None:
            ctx.residual[1].buffer = grad_in[0]  # the first piece's backward adds its part and returns the sum
            grad_in[0] = None
        return (None, None, None, None, None, None, *grad_in, *pgrads)


def _residual_buffer(ctx, x: torch.Tensor, grad_out: torch.Tensor | None) -> torch.Tensor:
    """The full-length buffer for input 0's gradient (:class:`ResidualGrad`); ``grad_out``: the gradient
    of output 0 this backward received."""
    if ctx.residual is not None and ctx.residual[0] == "take":
        handed = ctx.residual[1].take()
        return handed if handed is not None else torch.zeros_like(x)
    if ctx.residual is None:
        return torch.zeros_like(x)
    into, ctx.residual[1].into = ctx.residual[1].into, None
    if into is not None:  # "give" with the output's gradient handed over: into it, when it is what came in
        # (each tile writes its positions after reading them; the output's storage is freed)
        return into if grad_out is into and _fits(into, x) else torch.empty_like(x)
    # "give": the output's storage, once (a retained graph's next backward must not overwrite the
    # gradient this one returned)
    out = None if ctx.out_used else ctx.out0()
    ctx.out_used = True
    if out is not None and _fits(out, x):
        return out.detach()  # an alias without the graph: the gradient must not carry the output's grad_fn
    return torch.empty_like(x)  # every tile writes its positions


def _fits(buffer: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``buffer`` can hold ``x``'s gradient: its shape, dtype and device, contiguous."""
    return (buffer.shape == x.shape and buffer.dtype == x.dtype and buffer.device == x.device
            and buffer.is_contiguous())


def tiled_call(fn: Callable, modules: list[nn.Module], rows: int, *inputs: torch.Tensor,
               residual: tuple | None = None) -> tuple[torch.Tensor, ...]:
    """``fn(*inputs)`` over tiles of ``rows`` positions (dim 1) with :class:`TiledTokens`, the
    parameters of ``modules`` (what ``fn`` computes with) as the Function's weights; ``residual``:
    ``("give" | "take", ResidualGrad)``, the first input's gradient shared with another call."""
    bound = bound_params(modules)
    slots = [(m, name) for m, name, _ in bound]
    return TiledTokens.apply(fn, slots, rows, autocast_state(inputs[0].device.type), len(inputs), residual,
                             *inputs, *[p for _, _, p in bound])


def tile_rows(tile: int, batch: int, widest: int) -> int:
    """Positions per tile for ``tile`` tokens over ``batch`` rows, each tile's widest tensor below 2^31."""
    return max(1, min(tile // max(1, batch), MAX_TILE_ELEMENTS // max(1, batch * widest)))


def tiled_forward(mlp: nn.Module, tile: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A replacement of ``mlp.forward`` that runs it over ``tile`` tokens at a time."""
    forward = type(mlp).forward.__get__(mlp)

    def run(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or x.dim() < 2 or x.reshape(-1, x.shape[-1]).shape[0] <= tile:
            return forward(x, *args, **kwargs)
        shape = x.shape
        rows = tile_rows(tile, 1, mlp_width(mlp))
        (out,) = tiled_call(lambda t: (forward(t),), [mlp], rows, x.reshape(1, -1, shape[-1]))
        return out.reshape(*shape[:-1], out.shape[-1])

    return run


@contextlib.contextmanager
def tiled(layer: nn.Module, tile: int | None):
    """Inside: ``layer``'s MLP (if tileable) runs over ``tile`` tokens at a time; None: unchanged."""
    mlp = tileable_mlp(layer) if tile else None
    if mlp is None:
        yield False
        return
    mlp.__dict__["forward"] = tiled_forward(mlp, tile)
    try:
        yield True
    finally:
        mlp.__dict__.pop("forward", None)


def tiled_layer(recipe, layer: nn.Module, x: torch.Tensor, kwargs: dict, tile: int,
                grad_into: torch.Tensor | None = None) -> torch.Tensor:
    """A decoder layer's forward with every per-token operation tiled (module docstring), by ``recipe``
    (``models/layer_recipes.py``: ``pre``/``pre_modules``, ``attend``, ``post``/``post_modules``). Built
    with a graph (the engine's recompute), the output's storage takes the input's gradient during the
    backward (:class:`ResidualGrad`): the caller does not read the output after it. ``grad_into``: the
    gradient the output will receive, the caller's alone to give (``runtime/grad_ownership.py``): the
    input's gradient goes into it instead, and the output's storage is freed before returning (its
    values are gone: only its ``grad_fn`` and shape remain, for ``autograd.grad``)."""
    cos, sin = kwargs["position_embeddings"]
    widest = max(x.shape[-1], recipe.widest(layer))
    rows = tile_rows(tile, x.shape[0], widest)
    given = grad_into is not None and torch.is_grad_enabled() and _fits(grad_into, x)
    shared = ResidualGrad(grad_into if given else None)
    q, k, v = tiled_call(recipe.pre(layer), recipe.pre_modules(layer), rows, x, cos, sin, residual=("take", shared))
    attn = recipe.attend(layer, q, k, v, kwargs)
    (out,) = tiled_call(recipe.post(layer), recipe.post_modules(layer), rows, x, attn, residual=("give", shared))
    if given and out.grad_fn is not None:
        out.untyped_storage().resize_(0)  # saved by no node (TiledTokens saves its inputs): dead
    return out

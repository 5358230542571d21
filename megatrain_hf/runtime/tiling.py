"""Sequence-tiled MLP inside a unit's compute and recompute (exact: the MLP is per-token math).

A decoder layer's MLP turns ``tokens x hidden`` into ``tokens x intermediate`` tensors (gate, up,
their product: about 3.5x the hidden width each for Llama-style models), the largest activations
of a layer at long sequence lengths. Tiling runs it over ``tile`` tokens at a time, so those
intermediates exist for one tile only:

* the streamed forward (no graph): tile by tile, each tile's output written into the output;
* the backward's recompute (with grad): :class:`TiledMLP`, an ``autograd.Function`` that saves
  only its input and, in its backward, recomputes and back-propagates tile by tile (as Snowflake
  ALST's ``TiledMLP`` does), summing the weights' gradients over the tiles in fp32.

The MLP's weights are inputs of the Function (they are the recompute's leaves, so their
gradients reach the unit's ``autograd.grad``); the template is unbound by the time the backward
runs, so the backward binds them again around each tile's recompute. Tiling applies to an MLP
whose parameters all sit in ``nn.Linear`` modules, that draws no random numbers and carries no
hooks (a mixture-of-experts block, GPT-2's Conv1D MLP, a hooked one run whole).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from .autocast import autocast_state

MLP_ATTRS = ("mlp", "feed_forward")
"""Attributes of a decoder layer under which families keep their MLP."""


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


def _bound_params(mlp: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    return [(m, name, p) for m in mlp.modules() for name, p in m._parameters.items() if p is not None]


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


def _tile_loop(forward: Callable, x2d: torch.Tensor, tile: int) -> torch.Tensor:
    out = None
    for start, end in _tiles(x2d.shape[0], tile):
        y = forward(x2d[start:end])
        if out is None:
            out = y.new_empty((x2d.shape[0], *y.shape[1:]))
        out[start:end] = y
        del y
    return out


class TiledMLP(torch.autograd.Function):
    """``forward(x)`` of an MLP over tiles of tokens; the backward recomputes tile by tile."""

    @staticmethod
    def forward(ctx, forward: Callable, slots: list, tile: int, autocast: tuple, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.forward, ctx.slots, ctx.tile, ctx.autocast = forward, slots, tile, autocast
        ctx.save_for_backward(x, *params)
        shape = x.shape
        with torch.no_grad():
            out = _tile_loop(forward, x.reshape(-1, shape[-1]), tile)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[4]
        need_p = list(ctx.needs_input_grad[5:])
        x2d = x.reshape(-1, x.shape[-1])
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(x2d) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        device_type, (enabled, dtype, cache) = x.device.type, ctx.autocast
        for start, end in _tiles(x2d.shape[0], ctx.tile):
            leaves = [p.detach().requires_grad_(n) for p, n in zip(params, need_p)]
            with torch.enable_grad(), _bound(ctx.slots, tuple(leaves)), torch.autocast(
                    device_type, dtype=dtype, enabled=enabled, cache_enabled=cache):
                xt = x2d[start:end].detach().requires_grad_(need_x)
                y = ctx.forward(xt)
            wanted = ([xt] if need_x else []) + [leaf for leaf, n in zip(leaves, need_p) if n]
            grads = list(torch.autograd.grad(y, wanted, g2d[start:end], allow_unused=True))
            del y
            if need_x:
                grad_x[start:end] = grads.pop(0)
            for k, n in enumerate(need_p):
                if n:
                    g = grads.pop(0)
                    if g is not None:
                        sums[k] = g.float() if sums[k] is None else sums[k].add_(g)
        pgrads = [s.to(p.dtype) if s is not None else None for s, p in zip(sums, params)]
        return (None, None, None, None, grad_x.reshape(x.shape) if need_x else None, *pgrads)


def tiled_forward(mlp: nn.Module, tile: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A replacement of ``mlp.forward`` that runs it over ``tile`` tokens at a time."""
    forward = type(mlp).forward.__get__(mlp)

    def run(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or x.dim() < 2 or x.reshape(-1, x.shape[-1]).shape[0] <= tile:
            return forward(x, *args, **kwargs)
        if not torch.is_grad_enabled():
            shape = x.shape
            out = _tile_loop(forward, x.reshape(-1, shape[-1]), tile)
            return out.reshape(*shape[:-1], out.shape[-1])
        bound = _bound_params(mlp)
        slots = [(m, name) for m, name, _ in bound]
        return TiledMLP.apply(forward, slots, tile, autocast_state(x.device.type), x, *[p for _, _, p in bound])

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

"""The activation arithmetic of long sequences: a unit's working set, tiles, checkpoints.

Per token of a micro-batch, with ``h`` the hidden width, ``i`` the MLP's intermediate width,
``q``/``kv`` the query and key/value widths and ``c`` the compute dtype's bytes:

* a decoder layer's recompute with grad keeps q/k/v, the attention output and the residual
  stream's tensors (``c * (2h + 2q + 2kv) + 4 * 6h``, as ``plan.py`` always counted) plus the
  MLP's ``tokens x i`` tensors (gate, up, activation, product and two gradients in flight:
  ``MLP_TILE_FACTOR c i = 6 c i``; ``4 c i`` before 2026-12-07 fell 21 % short of the measured CPU
  peak, ``scripts/longctx_memory.py --tile 0``);
* sequence-tiled (``sequence_tile_tokens``), every per-token operation of the layer runs over
  tiles (``runtime/tiling.py``, families with a layer recipe): what stays full-length is q, k, v,
  the attention output (and its contiguous copy), their gradients, the flash kernel's fp32 ``dq``
  accumulator and the fp32 gradient flowing in, which takes the input's gradient tile by tile
  (``c * (5q + 4kv) + 4q + 4h``; the recomputed output's storage is freed after the recompute,
  ``runtime/grad_ownership.py``; before 2026-12-07 ``+ 2 * 4h``: the output's storage held the input's
  gradient, and before that each tiled piece had its own buffer); one tile holds the rest (:func:`tile_bytes`);
* activation checkpoints: one fp32 ``tokens x h`` per unit that keeps one (every decoder layer,
  the final norm's and the head's inputs), or with ``checkpoint_interval=k`` every k-th layer's
  plus the inputs of the k-1 layers of the block being back-propagated (recomputed and held).
"""

from __future__ import annotations

import math

AUTO_TILE_MIN = 4096
"""``sequence_tile_tokens="auto"``: tiles of ``max(hidden, AUTO_TILE_MIN)`` tokens (Snowflake
ALST's TiledMLP tiles by about ``hidden`` tokens)."""

AUTO_UNTILED_MAX_BYTES = 4 * 2**30
"""``sequence_tile_tokens="auto"`` leaves the MLP whole while its untiled working set
(:func:`mlp_tile_bytes` of all the tokens) is at most this, or at most ``AUTO_UNTILED_BUDGET_FRACTION``
of ``max_gpu_memory``: a tiled MLP runs its forward once more per layer in the backward (the tile's
recompute), which cost 11 % of the step at 1.36 B parameters and 16K tokens on an H200 (docs/log.md)."""

AUTO_UNTILED_BUDGET_FRACTION = 0.1

TILE_BUDGET_FRACTION = 0.02
"""Under ``max_gpu_memory``: a tile's MLP working set stays within this fraction of the budget."""

TILE_FLOOR = 256
"""No tile smaller than this (matmuls of fewer rows waste the GPU)."""

MLP_TILE_FACTOR = 6
"""``tokens x intermediate`` tensors alive while one MLP tile runs forward and backward: gate, up,
activation and product kept for the backward, their two gradients in flight."""


def mlp_tile_bytes(tile: int, intermediate: int, compute_bytes: int) -> int:
    """Peak bytes of one MLP tile's recompute and backward."""
    return tile * MLP_TILE_FACTOR * intermediate * compute_bytes


def auto_tile_tokens(tokens: int, hidden: int, intermediate: int, compute_bytes: int,
                     budget_bytes: int | None = None) -> int | None:
    """``sequence_tile_tokens="auto"``: tokens per MLP tile, or None when one tile holds them all or the
    whole MLP's working set is small (``AUTO_UNTILED_MAX_BYTES``)."""
    whole = mlp_tile_bytes(tokens, intermediate, compute_bytes)
    if whole <= (AUTO_UNTILED_BUDGET_FRACTION * budget_bytes if budget_bytes else AUTO_UNTILED_MAX_BYTES):
        return None
    tile = max(hidden, AUTO_TILE_MIN)
    if budget_bytes:
        fits = int(TILE_BUDGET_FRACTION * budget_bytes) // max(1, MLP_TILE_FACTOR * intermediate * compute_bytes)
        tile = min(tile, max(TILE_FLOOR, fits))
    return None if tokens <= tile else tile


def resolve_tile(option: int | str | None, tokens: int, hidden: int, intermediate: int, compute_bytes: int,
                 budget_bytes: int | None = None) -> int | None:
    """The ``sequence_tile_tokens`` option for a call of ``tokens`` tokens: a tile, or None (untiled)."""
    if option is None:
        return None
    if option == "auto":
        return auto_tile_tokens(tokens, hidden, intermediate, compute_bytes, budget_bytes)
    return None if tokens <= option else int(option)


def tile_policy(option: int | str | None, compute_bytes: int, budget_bytes: int | None = None):
    """``sequence_tile_tokens`` as the runner asks it: ``(tokens, hidden, intermediate) -> tile or None``;
    None when the option turns tiling off."""
    if option is None:
        return None

    def policy(tokens: int, hidden: int, intermediate: int) -> int | None:
        return resolve_tile(option, tokens, hidden, intermediate, compute_bytes, budget_bytes)

    return policy


def tiles(tokens: int, tile: int | None) -> int:
    return 1 if tile is None else math.ceil(tokens / tile)


def tile_bytes(tile: int, hidden: int, q_dim: int, kv_dim: int, intermediate: int, compute_bytes: int) -> int:
    """One tile of a tiled layer, recomputed and back-propagated: the MLP's intermediates and the
    norms', projections' and rotary embedding's per-token tensors (fp32 norm internals)."""
    c = compute_bytes
    return mlp_tile_bytes(tile, intermediate, c) + tile * (c * (2 * hidden + 3 * q_dim + 3 * kv_dim) + 4 * 6 * hidden)


def layer_working_set(tokens: int, hidden: int, q_dim: int, kv_dim: int, intermediate: int, compute_bytes: int,
                      tile: int | None = None) -> int:
    """Recomputing one decoder layer with grad (module docstring): untiled, the attention part and the
    MLP's intermediates for every token; tiled, the full-length tensors around the attention kernel
    and one tile of ``tile`` tokens."""
    c = compute_bytes
    if tile is None or tile >= tokens:
        attention = tokens * (c * (2 * hidden + 2 * q_dim + 2 * kv_dim) + 4 * 6 * hidden)
        return attention + mlp_tile_bytes(tokens, intermediate, c)
    full = tokens * (c * (5 * q_dim + 4 * kv_dim) + 4 * q_dim + 4 * hidden)
    return full + tile_bytes(tile, hidden, q_dim, kv_dim, intermediate, c)


def kept_checkpoints(layers: int, interval: int = 1) -> int:
    """Units whose input stays as a checkpoint: every layer, the final norm and the head; with
    ``checkpoint_interval=k`` every k-th of the chain of layers and norm, and the head."""
    if interval <= 1:
        return layers + 2
    return math.ceil((layers + 1) / interval) + 1


def checkpoint_bytes(tokens: int, hidden: int, layers: int, interval: int = 1) -> int:
    """fp32 ``tokens x hidden`` per kept checkpoint (the residual stream of mixed-precision training)."""
    return kept_checkpoints(layers, interval) * tokens * hidden * 4


def recomputed_inputs_bytes(tokens: int, hidden: int, interval: int = 1) -> int:
    """With ``checkpoint_interval=k``: the k-1 inputs of a block held on the device for its backward."""
    return max(0, interval - 1) * tokens * hidden * 4


def long_context_working_set(tokens: int, hidden: int, q_dim: int, kv_dim: int, intermediate: int,
                             compute_bytes: int, tile: int, heads: int | None = None) -> int:
    """GPU bytes of one decoder layer's backward (recompute included) with every per-token operation
    tiled (issue 34 item 1: norms, q/k/v with rotary, o with the residual add, the MLP), the one
    activation model of the joint long-context plan (``memory/long_context.py``).

    Full-length tensors left, per token, at the peak (the attention kernel's backward): two fp32
    ``tokens x h`` (``4 h`` each): the layer's input as loaded from its checkpoint and the gradient
    flowing in, which takes the gradient flowing out tile by tile (``runtime/grad_ownership.py``: the
    runtime owns it alone; the layer's recomputed output, of which the backward needs only the
    ``grad_fn``, has its storage freed right after the recompute); q, k, v and the attention output in
    the compute dtype (``c (2 q + 2 kv)``); their gradients (``c (2 q + 2 kv)``); the attention
    kernel's fp32 dq accumulator (``4 q``, FlashAttention's backward) and its fp32 log-sum-exp per head
    (``4 heads``; ``heads`` None: ``q_dim / 64``). Plus one tile of ``tile`` tokens of everything
    per-token: the MLP's intermediates (:func:`mlp_tile_bytes`) and the residual stream's fp32 tensors
    (``4 x 6 h``). 7 B (MHA) at 512K: 57 GiB; Llama-3-8B (GQA, 8 KV heads): 45 GiB. The recompute's
    own end (the output still alive, no gradients of q/k/v yet) is below this whenever ``q >= h``.

    Measured (docs/long-context.md, CPU, ``scripts/longctx_memory.py``): each step removed one fp32
    ``tokens x h`` from the layer peak, 1,024 B per token on the CPU shape (hidden 256) at 4K-32K: the
    shared buffer (``tiling.ResidualGrad``) and then the incoming gradient taking the input's gradient
    (7,321 B per token at 32K; with the input, 0.76-0.84 of this). On an H100 before both (the 7 B's
    layer, 32K to 64K) the growth was 144.9 KB per token against the then 4 B x 3 h of this function's
    131.2 KB: the GPU held a fourth ``4 h``; two fewer now, 112.1 KB expected against this function's 114.9
    (not measured on a GPU since; 2.5 % of margin per token). Not counted: when
    the incoming gradient cannot be proven megatrain's (a tensor hook on a layer's output, a module
    backward hook; ``grad_ownership.py``) the layer keeps the output's storage for the input's
    gradient: one ``4 h`` more per token (logged once). The tiling work owns this function: when it
    measures its working set, this is the number to change."""
    heads = q_dim // 64 if heads is None else heads
    full = tokens * (4 * 2 * hidden + 2 * compute_bytes * (2 * q_dim + 2 * kv_dim) + 4 * q_dim + 4 * heads)
    tile = min(tile, tokens)
    return full + mlp_tile_bytes(tile, intermediate, compute_bytes) + tile * 4 * 6 * hidden

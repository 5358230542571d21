"""Layer recipes: a decoder layer's forward split into per-token parts around the attention kernel.

Whole-layer sequence tiling (``runtime/tiling.py``, :func:`~megatrain_hf.runtime.tiling.tiled_layer`)
needs to know which of a layer's operations are per-token. A recipe says it for one family's
decoder layer, written after transformers' own ``forward`` of that layer and its attention, with the
same operations in the same order:

* ``pre``: input norm, q/k/v projections (biases included), q/k norms where the family has them,
  rotary embedding (the family's own ``apply_rotary_pos_emb``), in the ``(batch, tokens, heads,
  head_dim)`` layout HF's projections produce before transposing;
* ``attend``: the attention kernel HF selects (``ALL_ATTENTION_FUNCTIONS`` by
  ``config._attn_implementation``, eager as HF's fallback) on the full q, k, v, with the family's
  dropout, scaling, sliding window and soft-capping, and the layer call's other keyword arguments
  (``position_ids``, flash-attention's packed-sequence arguments) as HF passes them;
* ``post``: o projection, residual add, post-attention norm(s), MLP, residual add.

A recipe is used only when it matches the layer at hand (:meth:`LayerRecipe.why_not`): the layer
and attention classes it was written for, with transformers' own ``forward`` methods, no hooks on
sub-modules (a hook would see tiles), no dropout outside the attention kernel (it would draw its
masks tile by tile), no KV cache. Otherwise the layer runs with its MLP tiled alone, and the
reason is logged once.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

_SKIPPED_KWARGS = ("attention_mask", "position_embeddings", "cache", "past_key_values", "past_key_value")


def _no_kwargs(attn: nn.Module) -> dict:
    return {}


def _own_sliding_window(attn: nn.Module) -> dict:
    return {"sliding_window": attn.sliding_window}


def _config_sliding_window(attn: nn.Module) -> dict:  # Mistral reads it from the config
    return {"sliding_window": getattr(attn.config, "sliding_window", None)}


def _sliding_window_and_softcap(attn: nn.Module) -> dict:  # Gemma 2
    return {"sliding_window": attn.sliding_window, "softcap": attn.attn_logit_softcapping}


@dataclass(frozen=True)
class LayerRecipe:
    """How a family's decoder layer splits into per-token parts (module docstring)."""

    layer_class: str  # the decoder layer's class name ("LlamaDecoderLayer")
    attention_kwargs: Callable[[nn.Module], dict] = _no_kwargs  # the family's extra attention arguments
    sandwich: bool = False  # Gemma 2/3: norms after attention and MLP too, the MLP's input norm its own
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm of each head's q and k before rotary

    # ------------------------------------------------------------------ matching
    def why_not(self, layer: nn.Module, args: tuple, kwargs: dict) -> str | None:
        """Why this recipe cannot compute ``layer``'s call exactly (None: it can)."""
        if type(layer).__name__ != self.layer_class:
            return f"{type(layer).__name__} is not the {self.layer_class} the recipe was written for"
        attn = getattr(layer, "self_attn", None)
        for cls in (type(layer), type(attn)):
            if not cls.forward.__module__.startswith("transformers.models."):
                return f"{cls.__name__}.forward was replaced (by {cls.forward.__module__})"
        if args:
            return "the layer was called with positional arguments besides the hidden states"
        if kwargs.get("position_embeddings") is None:
            return "the layer call has no position_embeddings"
        if any(kwargs.get(name) is not None for name in ("cache", "past_key_values", "past_key_value")):
            return "the call writes a KV cache"
        if kwargs.get("output_attentions"):
            return "the call asks for the attention weights"
        for name, m in layer.named_modules():
            if m is layer:
                continue
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                return f"{name} has hooks, which would see tiles instead of the whole call"
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training:
                return f"{name} draws dropout masks, which tiling would draw tile by tile"
            if "forward" in m.__dict__:
                return f"{name}.forward was replaced on the instance"
        return None

    # ------------------------------------------------------------------ the parts
    def widest(self, layer: nn.Module) -> int:
        """The widest per-token tensor of a tile: the MLP's intermediate width or the projections'."""
        return max(m.out_features for m in layer.modules() if isinstance(m, nn.Linear))

    def pre_modules(self, layer: nn.Module) -> list[nn.Module]:
        attn = layer.self_attn
        extra = [attn.q_norm, attn.k_norm] if self.qk_norm else []
        return [layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj, *extra]

    def pre(self, layer: nn.Module) -> Callable:
        attn = layer.self_attn
        rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        qk_norm = self.qk_norm

        def pre(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
            normed = layer.input_layernorm(hidden)
            shape = (*normed.shape[:-1], -1, attn.head_dim)
            q, k, v = attn.q_proj(normed).view(shape), attn.k_proj(normed).view(shape), attn.v_proj(normed).view(shape)
            if qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = rope(q, k, cos, sin, unsqueeze_dim=2)  # (batch, tokens, heads, head_dim)
            return q, k, v

        return pre

    def attend(self, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kwargs: dict) -> torch.Tensor:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attn = layer.self_attn
        eager = sys.modules[type(attn).__module__].eager_attention_forward
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
        rest = {key: value for key, value in kwargs.items() if key not in _SKIPPED_KWARGS}
        out, _ = interface(attn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           kwargs.get("attention_mask"), dropout=attn.attention_dropout if attn.training else 0.0,
                           scaling=attn.scaling, **self.attention_kwargs(attn), **rest)
        return out.reshape(*q.shape[:2], -1).contiguous()

    def post_modules(self, layer: nn.Module) -> list[nn.Module]:
        norms = ([layer.post_attention_layernorm, layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
                 if self.sandwich else [layer.post_attention_layernorm])
        return [layer.self_attn.o_proj, *norms, layer.mlp]

    def post(self, layer: nn.Module) -> Callable:
        o_proj, mlp = layer.self_attn.o_proj, layer.mlp
        if self.sandwich:
            def post(hidden: torch.Tensor, attn_out: torch.Tensor):
                hidden = hidden + layer.post_attention_layernorm(o_proj(attn_out))
                return (hidden + layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(hidden))),)
        else:
            def post(hidden: torch.Tensor, attn_out: torch.Tensor):
                hidden = hidden + o_proj(attn_out)
                return (hidden + mlp(layer.post_attention_layernorm(hidden)),)
        return post


RECIPES: dict[str, LayerRecipe] = {
    "llama": LayerRecipe("LlamaDecoderLayer"),
    "mistral": LayerRecipe("MistralDecoderLayer", _config_sliding_window),
    "qwen2": LayerRecipe("Qwen2DecoderLayer", _own_sliding_window),
    "qwen3": LayerRecipe("Qwen3DecoderLayer", _own_sliding_window, qk_norm=True),
    "gemma2": LayerRecipe("Gemma2DecoderLayer", _sliding_window_and_softcap, sandwich=True),
    "gemma3_text": LayerRecipe("Gemma3DecoderLayer", _own_sliding_window, sandwich=True, qk_norm=True),
}
"""Families whose decoder layers tile whole, by ``config.model_type`` (each tested against the
untiled layer: tests/parity/test_long_context.py)."""

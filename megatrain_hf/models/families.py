"""Model families: one record per ``config.model_type`` holding every fact megatrain needs about it.

A registry keyed by ``model_type`` (Liger-Kernel's habit). What HF computes between the units
(rotary tables, masks per layer type, embedding scaling, logit soft-capping) stays in the model's
own ``forward``, so the engine never re-implements a family; the record says where the units are
and which of megatrain's shortcuts are exact for it.

A family must provide (see :func:`register_family`):

* ``locate(model) -> Units``: the streamed units in forward order -- the embedding table(s), every
  decoder layer, the final norm, the head -- each a module whose ``forward`` takes the previous
  unit's output (hidden states) as its first argument or as one of ``INPUT_KWARGS`` and returns
  one tensor; every trainable parameter of the model must be inside a unit. Most decoder-only
  models are :func:`decoder_units` with their attribute names.
* ``chunked_loss``: True only if the loss is cross-entropy on ``lm_head(hidden)``, at most
  soft-capped by ``config.final_logit_softcapping`` -- what the chunked loss computes
  (``chunked_loss.py``). A family that scales its logits otherwise (Cohere's ``logit_scale``,
  Granite's ``logits_scaling``) or adds a term in its forward (the MoE router's load-balancing
  loss) keeps HF's loss.

What a unit's sub-modules pass to forward hooks is differentiable outside the unit (the streamed
call returns it, ``runtime/streamed_call.py``): losses HF builds from captured outputs, such as
the router logits of mixture-of-experts layers, need nothing more from the family record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..errors import UnsupportedModelError
from .layer_recipes import RECIPES, LayerRecipe

INPUT_KWARGS = ("hidden_states", "input_ids", "input", "inputs_embeds")
"""Keyword names under which a unit may receive its main input."""
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Keyword names of a KV cache in a unit call (``cache`` from transformers 5.24 on)."""


@dataclass
class Units:
    """The streamed units of a model, in forward order."""

    names: list[str]  # dotted names inside the top-level model ("model.layers.3")
    modules: list[nn.Module]
    embedding_units: frozenset[int]  # indices of lookup-table units (stay fp32 on the wire)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under PEFT wrappers (``PeftModel`` -> ``LoraModel`` -> model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_units(embeddings: tuple[str, ...] = ("embed_tokens",), layers: str = "layers",
                  norm: str = "norm") -> Callable[[nn.Module], Units]:
    """``locate`` for a decoder-only model: ``get_decoder()``'s embedding tables, layers and final norm,
    then the head -- ``get_output_embeddings()`` (a causal LM), or ``score`` (``*ForSequenceClassification``,
    e.g. a reward model: the score projection of every position; HF's forward pools it)."""

    def locate(model: nn.Module) -> Units:
        base = unwrap(model)
        decoder = base.get_decoder()
        head = base.get_output_embeddings()
        if head is None and type(base).__name__.endswith("ForSequenceClassification"):
            head = getattr(base, "score", None)
        if head is None:
            raise UnsupportedModelError(
                f"{type(base).__name__} has neither an LM head (get_output_embeddings()) nor a sequence "
                "classification `score` head; megatrain trains causal LMs (AutoModelForCausalLM) and sequence "
                "classifiers of the same families (AutoModelForSequenceClassification). For other heads, train "
                "without the MegaTrainPlugin."
            )
        names_by_id = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        tables = [getattr(decoder, name) for name in embeddings]
        ordered: list[nn.Module] = [*tables, *getattr(decoder, layers), getattr(decoder, norm), head]
        missing = [m for m in ordered if id(m) not in names_by_id]
        if missing:
            raise UnsupportedModelError(
                f"could not name {len(missing)} unit(s) of {type(base).__name__} inside the model")
        return Units([names_by_id[id(m)] for m in ordered], ordered, frozenset(range(len(tables))))

    return locate


@dataclass(frozen=True)
class Family:
    model_type: str
    locate: Callable[[nn.Module], Units]
    chunked_loss: bool
    layer_recipe: LayerRecipe | None = None


FAMILIES: dict[str, Family] = {}


def register_family(model_type: str, locate: Callable[[nn.Module], Units] | None = None,
                    chunked_loss: bool = False, layer_recipe: LayerRecipe | None = None) -> Family:
    """Declare ``model_type`` supported, after checking that it trains exactly like plain HF (the
    parity tests of ``tests/parity/test_parity.py`` with the family added to ``FAMILY_CONFIGS`` in
    ``tests/helpers.py``).

    ``locate(model) -> Units``: the streamed units in forward order (default: :func:`decoder_units`
    with Llama's names ``embed_tokens`` / ``layers`` / ``norm`` and ``get_output_embeddings()``).
    Each unit's ``forward`` takes the previous unit's output as its first argument or under one
    of ``INPUT_KWARGS``, returns one tensor, and computes the same thing on every call with the
    same inputs and random state (the backward recomputes it); every trainable parameter of the
    model lies inside a unit; tables looked up by index are ``Units.embedding_units``.
    ``chunked_loss``: whether the chunked loss is exact for it (see the module docstring); when
    unsure, False (HF's own loss, always exact).
    ``layer_recipe``: the decoder layer's per-token parts (``layer_recipes.py``; default: the
    built-in recipe of ``model_type`` if any), for whole-layer sequence tiling.
    """
    family = Family(model_type, locate or decoder_units(), chunked_loss, layer_recipe or RECIPES.get(model_type))
    FAMILIES[model_type] = family
    return family


# Dense families whose head is lm_head(hidden), at most soft-capped: the chunked loss is exact.
for _model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
                    "smollm3", "starcoder2"):
    register_family(_model_type, chunked_loss=True)
register_family("gpt2", decoder_units(embeddings=("wte", "wpe"), layers="h", norm="ln_f"), chunked_loss=True)
# Scaled logits: Granite divides them by ``logits_scaling``, Cohere multiplies them by ``logit_scale``.
for _model_type in ("granite", "cohere"):
    register_family(_model_type, chunked_loss=False)
# Mixture-of-experts: HF adds ``router_aux_loss_coef`` x the load-balancing loss of the router logits
# it captures (``output_router_logits``) in the model's own forward, which the chunked loss bypasses.
for _model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
    register_family(_model_type, chunked_loss=False)


def unsupported_message(model_type: object, class_name: str) -> str:
    """The refusal of a model type without a family record (the engine's and ``megatrain estimate``'s)."""
    return (
        f"model type {model_type!r} ({class_name}) is not supported by megatrain; supported: {sorted(FAMILIES)}. "
        "If it is a decoder-only causal LM with embed_tokens/layers/norm/lm_head, "
        "megatrain_hf.register_family(model_type) enables it (verify parity first: docs/supported-models.md)."
    )


def family_of(model: nn.Module) -> Family:
    """The family record of ``model`` (under its PEFT wrappers); raises for an unsupported type."""
    config = getattr(model, "config", None) or getattr(unwrap(model), "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedModelError(unsupported_message(model_type, type(unwrap(model)).__name__))
    return family

"""Model families: where the streamed units of a model are.

A registry keyed by ``config.model_type`` (Liger-Kernel's habit). Every supported family is a
decoder-only causal LM whose decoder exposes ``embed_tokens``, ``layers`` and ``norm`` and whose
head is ``get_output_embeddings()``; what HF computes between them (rotary tables, masks per
layer type, embedding scaling, logit soft-capping) stays in the model's own ``forward``, so the
engine never re-implements a family. A family that needs something else registers its own
``locate`` function with :func:`register_family`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn


@dataclass
class Units:
    """The streamed units of a model, in forward order, and the module holding them."""

    names: list[str]  # dotted names inside the top-level model ("model.layers.3")
    modules: list[nn.Module]
    embedding_units: frozenset[int]  # indices of lookup-table units (stay fp32 on the wire)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under PEFT wrappers (``PeftModel`` -> ``LoraModel`` -> model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _locate_decoder_only(model: nn.Module) -> Units:
    base = unwrap(model)
    decoder = base.get_decoder()
    head = base.get_output_embeddings()
    if head is None:
        raise ValueError(
            f"{type(base).__name__} has no output embeddings (lm_head); megatrain trains causal LMs "
            "(AutoModelForCausalLM)."
        )
    names_by_id = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    ordered: list[nn.Module] = [decoder.embed_tokens, *decoder.layers, decoder.norm, head]
    missing = [m for m in ordered if id(m) not in names_by_id]
    if missing:
        raise ValueError(f"could not name {len(missing)} unit(s) of {type(base).__name__} inside the model")
    return Units(
        names=[names_by_id[id(m)] for m in ordered],
        modules=ordered,
        embedding_units=frozenset({0}),
    )


FAMILIES: dict[str, Callable[[nn.Module], Units]] = {
    "llama": _locate_decoder_only,
    "mistral": _locate_decoder_only,
    "qwen2": _locate_decoder_only,
    "qwen3": _locate_decoder_only,
    "gemma": _locate_decoder_only,
    "gemma2": _locate_decoder_only,
    "gemma3_text": _locate_decoder_only,
}


CHUNKED_LOSS_FAMILIES: set[str] = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"}
"""Families whose logits are ``lm_head(hidden)`` followed at most by ``final_logit_softcapping``:
what the chunked loss (loss.py) reproduces. A family that scales its logits otherwise (Cohere's
``logit_scale``, Granite's ``logits_scaling``) must not be listed."""


def register_family(
    model_type: str, locate: Callable[[nn.Module], Units] = _locate_decoder_only, chunked_loss: bool = False
) -> None:
    """Declare a model type supported (after checking it trains exactly like plain HF).

    ``chunked_loss=True`` only if its logits are ``lm_head(hidden)`` (optionally soft-capped by
    ``config.final_logit_softcapping``), as the chunked loss computes them.
    """
    FAMILIES[model_type] = locate
    if chunked_loss:
        CHUNKED_LOSS_FAMILIES.add(model_type)
    else:
        CHUNKED_LOSS_FAMILIES.discard(model_type)


def locate_units(model: nn.Module) -> Units:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"model type {model_type!r} ({type(unwrap(model)).__name__}) is not supported by megatrain; "
            f"supported: {sorted(FAMILIES)}. If it is a decoder-only causal LM with embed_tokens/layers/"
            "norm/lm_head, megatrain_hf.adapters.register_family(model_type) enables it (verify parity first)."
        )
    return FAMILIES[model_type](model)

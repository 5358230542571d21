"""Checks of what a model and its inputs ask for, each refusing with the value and the fix.

At attach: every trainable parameter inside a streamed unit, fp32 masters. Per training call of a
unit: no side input that requires grad, no pre-filled KV cache. Per training forward of the
decoder: the sequence fits the positions the model was built for. And the question layer-major
accumulation asks: which modules draw random numbers when training.
"""

from __future__ import annotations

import torch
from torch import nn

from .families import CACHE_KWARGS, Units


def check_coverage(model: nn.Module, units: Units) -> None:
    covered = {id(p) for m in units.modules for p in m.parameters()}
    stray = [n for n, p in model.named_parameters() if id(p) not in covered]
    if stray:
        raise ValueError(
            f"{len(stray)} parameter(s) live outside the streamed units and would stay on the host: "
            f"{stray[:5]}. megatrain supports models whose weights are all in the embedding, decoder "
            "layers, final norm and lm_head."
        )


def check_fp32(model: nn.Module) -> None:
    floating = {p.dtype for p in model.parameters() if p.requires_grad}
    if floating - {torch.float32}:
        raise ValueError(
            f"trainable parameters are {sorted(str(d) for d in floating)}; megatrain keeps fp32 masters. "
            "Load the model with dtype=torch.float32 (e.g. from_pretrained(path, dtype=torch.float32)); "
            "the compute still runs in bf16 with TrainingArguments(bf16=True)."
        )


def position_limit(config) -> int | None:
    """``max_position_embeddings`` when it bounds the trained positions; None without it, or when
    rope scaling (YaRN, linear, dynamic, ...) extends the context on purpose."""
    limit = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        return None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def sequence_too_long(seq: int, limit: int, model_type: str, where: str = "a training sequence") -> ValueError:
    return ValueError(
        f"megatrain: {where} has {seq} tokens, more than the model's max_position_embeddings={limit} "
        f"({model_type}): positions past it were never trained, and the loss would be computed on them "
        f"silently. Fix: truncate the data to <= {limit} tokens (e.g. tokenizer(..., truncation=True, "
        f"max_length={limit}) or SFTConfig(max_length={limit})), or extend the context on purpose (set "
        "rope_scaling and max_position_embeddings in the model config before loading)."
    )


class SequenceLengthCheck:
    """Forward pre-hook of the decoder: a training call's sequence must fit the positions the model
    was built for, unless it passes ``position_ids`` (packed documents restart them)."""

    def __init__(self, limit: int, model_type: str) -> None:
        self.limit, self.model_type = limit, model_type

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (module.training and torch.is_grad_enabled()) or kwargs.get("position_ids") is not None:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        if isinstance(ids, torch.Tensor) and ids.dim():
            seq = ids.shape[-1]
        elif isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
            seq = embeds.shape[-2]
        else:
            return
        if seq > self.limit:
            raise sequence_too_long(seq, self.limit, self.model_type)


def check_side_inputs(unit_name: str, rest: tuple, kwargs: dict) -> None:
    """Only the unit's main input is differentiated: refuse a side input that requires grad."""
    for value in (*rest, *kwargs.values()):
        for t in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise RuntimeError(
                    f"streamed unit {unit_name} received a side input that requires grad (shape "
                    f"{tuple(t.shape)}); megatrain differentiates only the unit's main input (hidden "
                    "states). Trainable rotary/position tables are not supported."
                )


def _is_cache(value) -> bool:
    return hasattr(value, "get_seq_length") and hasattr(value, "update")


def without_cache(unit_name: str, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Training calls never write a KV cache (the recompute would write it twice): a cache passed by
    keyword or by position (GPT-2's blocks take it second) is replaced by None; one that already
    holds tokens is refused."""

    def drop(cache):
        layer_idx = getattr(getattr(module, "self_attn", None), "layer_idx", 0)
        seen = cache.get_seq_length(layer_idx) if hasattr(cache, "get_seq_length") else 0
        if seen:
            raise RuntimeError(
                f"streamed unit {unit_name} got a KV cache holding {seen} tokens in a training "
                "(grad-enabled) call; megatrain does not train through a pre-filled cache. Pass "
                "use_cache=False / no past_key_values when training."
            )
        return None

    args = tuple(drop(a) if _is_cache(a) else a for a in args)
    out = dict(kwargs)
    for name in CACHE_KWARGS:
        if out.get(name) is not None:
            out[name] = drop(out[name])
    if "use_cache" in out:
        out["use_cache"] = False
    return args, out


def _is_random_attr(attr: str) -> bool:
    """Float attributes of HF modules that are a probability or noise level of a random draw in
    training: ``dropout``, ``attention_dropout``, Starcoder2's ``residual_dropout`` and
    ``embedding_dropout``, GPT-style ``*_pdrop``, Mixtral's router ``jitter_noise``."""
    return attr.endswith("dropout") or attr.endswith("_pdrop") or attr == "jitter_noise"


def dropout_modules(model: nn.Module) -> list[str]:
    """Modules that draw random numbers in training mode (dropout probability or noise > 0), whatever
    mode the model is in now: a training step puts it in training mode before its forward."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                found.append(name)
            continue
        for attr, value in module.__dict__.items():
            if _is_random_attr(attr) and isinstance(value, float) and value > 0:
                found.append(f"{name}.{attr}")
    return found


def prepare_graph_call(unit_name: str, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A training call of a unit (one with a graph): side inputs checked, KV caches dropped."""
    check_side_inputs(unit_name, args, kwargs)
    return without_cache(unit_name, module, args, kwargs)

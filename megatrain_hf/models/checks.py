"""Checks of what a model and its inputs ask for, each refusing with the value and the fix.

At attach: every trainable parameter inside a streamed unit, fp32 masters. Per training call of a
unit: no side input that requires grad, no pre-filled KV cache. Per training forward of the
decoder: the sequence fits the positions the model was built for. And the question layer-major
accumulation asks: which modules draw random numbers when training.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import TrainingDataError, UnsupportedModelError, UsageError
from .families import CACHE_KWARGS, Units


def check_coverage(model: nn.Module, units: Units) -> None:
    covered = {id(p) for m in units.modules for p in m.parameters()}
    stray = [n for n, p in model.named_parameters() if id(p) not in covered]
    if stray:
        raise UnsupportedModelError(
            f"{len(stray)} parameter(s) live outside the streamed units and would stay on the host: "
            f"{stray[:5]}. megatrain supports models whose weights are all in the embedding, decoder "
            "layers, final norm and lm_head."
        )


def check_fp32(model: nn.Module) -> None:
    floating = {p.dtype for p in model.parameters() if p.requires_grad}
    if floating - {torch.float32}:
        raise UnsupportedModelError(
            f"trainable parameters are {sorted(str(d) for d in floating)}; megatrain keeps fp32 masters. "
            "Load the model with dtype=torch.float32 (e.g. from_pretrained(path, dtype=torch.float32)); "
            "the compute still runs in bf16 with TrainingArguments(bf16=True)."
        )


UNBOUNDED_ROPE = ("dynamic",)
"""rope types that rescale to whatever length they meet (dynamic NTK): no position limit."""


def _rope(config) -> dict | None:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        return rope
    return None


def position_limit(config) -> int | None:
    """The longest training sequence the config's positions allow: ``max_position_embeddings``, or
    with rope scaling (linear, YaRN, llama3, LongRoPE, ...) ``factor x`` the original positions when
    that is more; None without a limit (no ``max_position_embeddings``, dynamic NTK, a scaling
    without a factor)."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    rope = _rope(config)
    if rope is None:
        return limit
    factor = rope.get("factor")
    if rope.get("rope_type", rope.get("type")) in UNBOUNDED_ROPE or not isinstance(factor, (int, float)):
        return None
    original = rope.get("original_max_position_embeddings") or limit
    return max(limit, int(original * factor))


def limit_reason(config) -> str:
    """What sets :func:`position_limit`, for the refusal's message."""
    limit = getattr(config, "max_position_embeddings", None)
    rope = _rope(config)
    if rope is None:
        return f"the model's max_position_embeddings={limit}"
    kind = rope.get("rope_type", rope.get("type"))
    original = rope.get("original_max_position_embeddings") or limit
    return (f"what the config's rope scaling allows ({kind} x{rope.get('factor')} of {original} positions = "
            f"{position_limit(config)}; max_position_embeddings={limit})")


def sequence_too_long(seq: int, limit: int, model_type: str, where: str = "a training sequence",
                      reason: str | None = None) -> TrainingDataError:
    reason = reason or f"the model's max_position_embeddings={limit}"
    return TrainingDataError(
        f"megatrain: {where} has {seq} tokens, more than {reason} "
        f"({model_type}): positions past it were never trained, and the loss would be computed on them "
        f"silently. Fix: truncate the data to <= {limit} tokens (e.g. tokenizer(..., truncation=True, "
        f"max_length={limit}) or SFTConfig(max_length={limit})), or extend the context on purpose (set "
        "rope_scaling, e.g. {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': ...}, "
        "and max_position_embeddings in the model config before loading)."
    )


class SequenceLengthCheck:
    """Forward pre-hook of the decoder: a training call's sequence must fit the positions the model
    was built for, unless it passes ``position_ids`` (packed documents restart them)."""

    def __init__(self, limit: int, model_type: str, reason: str | None = None) -> None:
        self.limit, self.model_type, self.reason = limit, model_type, reason

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
            raise sequence_too_long(seq, self.limit, self.model_type, reason=self.reason)


def check_side_inputs(unit_name: str, rest: tuple, kwargs: dict) -> None:
    """Only the unit's main input is differentiated: refuse a side input that requires grad."""
    for value in (*rest, *kwargs.values()):
        for t in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise UsageError(
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
            raise UsageError(
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


def check_liger_head(model: nn.Module) -> None:
    """Refuse Liger-Kernel's fused linear cross-entropy forward (``apply_liger_kernel_to_*`` with
    ``fused_linear_cross_entropy=True``, on the class before the model was built or on the instance): it
    multiplies the hidden states by ``lm_head.weight`` itself, the fp32 master in host RAM, outside the
    streamed head unit."""
    from ..errors import IncompatibleOptionsError

    for candidate in (model, getattr(model, "get_base_model", lambda: None)()):
        if candidate is None:
            continue
        forward = candidate.__dict__.get("forward") or type(candidate).forward
        function = getattr(forward, "__func__", forward)
        if (getattr(function, "__module__", "") or "").startswith("liger_kernel"):
            raise IncompatibleOptionsError(
                f"megatrain: the forward of {type(candidate).__name__} is Liger-Kernel's fused linear cross-entropy "
                f"({function.__module__}.{function.__qualname__}): it reads lm_head.weight, the fp32 master in host "
                "RAM, outside megatrain's streamed head unit (host compute, a race with the background update). "
                "Fix: apply Liger with fused_linear_cross_entropy=False (megatrain's chunked loss computes the same "
                "loss inside the head unit without materializing the logits), or TrainingArguments("
                "use_liger_kernel=True), which megatrain configures so."
            )


def check_compile_dropout(model: nn.Module) -> None:
    """``compile=True`` is refused with dropout (before the model is touched)."""
    from ..errors import IncompatibleOptionsError

    dropout = dropout_modules(model)
    if dropout:
        raise IncompatibleOptionsError(
            f"MegaTrainConfig(compile=True) (TrainingArguments(torch_compile=True)) with dropout in the model "
            f"({', '.join(dropout[:3])}{', ...' if len(dropout) > 3 else ''}): a compiled layer draws its random "
            "masks with other kernels than eager (inductor's own generator), so its recompute and the loss would not "
            "be those of the eager model. Fix: set the model's dropout probabilities to 0 (e.g. "
            "attention_dropout=0.0, as most fine-tuning recipes do), or leave compile off."
        )


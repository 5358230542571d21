"""Memory plan: how many bytes a training run needs, per tier, before anything is allocated.

Why: megatrain keeps every trainable tensor in host RAM (fp32 masters, fp32 gradient
accumulators, fp32 AdamW moments, a compute-dtype staging copy) and streams one unit at a time to
the GPU. Host RAM, not GPU memory, bounds the model size, and running out of it half-way through
allocating 100+ GiB of pinned buffers (or in the first optimizer step) is slow and obscure. This
module answers, from the model's shape alone:

* the host bytes of each tier, exactly as :mod:`megatrain_hf.store` and
  :mod:`megatrain_hf.optimizer` lay them out (per-parameter 64-byte alignment included);
* an estimate of the GPU bytes (weight slots, activation checkpoints, one layer's recompute
  working set, weight gradients, logits), which does not grow with depth except for the
  per-layer activation checkpoints;
* whether it fits this machine (:func:`check_host_memory` raises ``MemoryError`` with the
  arithmetic and the fix), and the largest model that would (:func:`largest_model`).

Host layout, per unit (embedding, each decoder layer, final norm, lm_head; a tied lm_head is the
embedding and is counted once), as the store builds it:

==================  =====================================================================
trainable param     fp32 master 4 B + fp32 grad accumulator 4 B + AdamW exp_avg 4 B
                    + exp_avg_sq 4 B = 16 B, plus a compute-dtype staging copy (2 B in bf16)
                    for matrices (ndim >= 2) of decoder layers and lm_head. Embedding tables
                    and 1-D vectors (norm weights, biases) travel in fp32 straight from the
                    master: no staging. Compute fp32: no staging at all.
frozen param        one copy in its wire dtype (2 B for bf16 matrices, 4 B otherwise), no
                    gradient, no optimizer state (PEFT / LoRA base weights).
alignment           every parameter starts on a 64-byte boundary inside its flat (16 elements).
pinning             ``cudaHostRegister`` on ordinary memory: no power-of-two rounding.
==================  =====================================================================

The command-line front end is :func:`estimate_main` (``megatrain estimate --model llama-7b``).
See docs/memory.md for worked examples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Iterable

from .loss import chunk_tokens as loss_chunk

import psutil
import torch

from .store import wire_dtype

logger = logging.getLogger(__name__)

GiB = 2**30

_ALIGN_ELEMS = 16  # must match megatrain_hf.store._ALIGN_ELEMS (tests/test_memory.py checks it)

DEFAULT_HEADROOM_BYTES = 2 * GiB
"""Host RAM left free on top of the plan: the Python process, torch, the tokenizer, the data
loader and the OS page cache need some."""

GPU_RUNTIME_ALLOWANCE_BYTES = 1 * GiB
"""Fixed GPU allowance for the CUDA context, cuBLAS/cuDNN workspaces and allocator slack."""

_COMPUTE_BYTES = {"bf16": 2, "bfloat16": 2, "fp32": 4, "float32": 4}
_DTYPE_BY_NAME = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Linear layers of a Llama-style decoder layer that LoRA can adapt (PEFT's module names)."""

_TIER_LABELS = {
    "master": "fp32 master weights",
    "grad": "fp32 gradient accumulators",
    "exp_avg": "AdamW exp_avg (fp32)",
    "exp_avg_sq": "AdamW exp_avg_sq (fp32)",
    "staging": "compute-dtype staging copies",
    "frozen": "frozen weights (wire dtype)",
}


def _aligned(n: int) -> int:
    return (n + _ALIGN_ELEMS - 1) // _ALIGN_ELEMS * _ALIGN_ELEMS


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


# ---------------------------------------------------------------------------------------- shape
@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """The numbers that size a Llama-style decoder-only causal LM (Llama, Mistral, Qwen2/3, Gemma 1-3)."""

    hidden: int
    """Width of the residual stream (``hidden_size``)."""
    intermediate: int
    """Width of the gated MLP (``intermediate_size``): gate, up and down projections."""
    layers: int
    """Number of decoder layers (``num_hidden_layers``)."""
    heads: int
    """Attention (query) heads (``num_attention_heads``)."""
    kv_heads: int
    """Key/value heads (``num_key_value_heads``); fewer than ``heads`` means GQA."""
    vocab: int
    """Vocabulary size (``vocab_size``): rows of the embedding table and of lm_head."""
    tied: bool = False
    """lm_head shares the embedding table (``tie_word_embeddings``): one tensor, counted once."""
    head_dim: int | None = None
    """Per-head width; ``None`` means ``hidden // heads`` (Qwen3/Gemma set it explicitly)."""
    attention_bias: bool = False
    """q/k/v projections have biases (Qwen2 always; Llama/Qwen3/Gemma when ``attention_bias``)."""
    o_proj_bias: bool = False
    """o_proj has a bias too (Llama-family ``attention_bias=True``; not Qwen2)."""
    mlp_bias: bool = False
    """gate/up/down projections have biases (Llama ``mlp_bias``)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (Qwen3, Gemma3): two vectors of ``head_dim`` per layer."""
    norms_per_layer: int = 2
    """RMSNorms of width ``hidden`` per decoder layer (2 for Llama/Qwen/Gemma, 4 for Gemma2/3)."""
    name: str = ""
    """Label shown in tables (a preset name or the config's path)."""

    def __post_init__(self) -> None:
        for f in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"):
            value = getattr(self, f)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{f}={value!r}: must be a positive integer")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim < 1):
            raise ValueError(f"ModelShape.head_dim={self.head_dim!r}: must be a positive integer or None")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(
                f"ModelShape hidden={self.hidden} is not divisible by heads={self.heads}; "
                "set head_dim explicitly."
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"ModelShape heads={self.heads} is not a multiple of kv_heads={self.kv_heads} (GQA groups "
                "must be equal); allowed: any kv_heads dividing heads."
            )

    # -------------------------------------------------------------- derived sizes
    @property
    def dim_head(self) -> int:
        """The per-head width actually used."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.dim_head

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim_head

    def linears(self) -> dict[str, tuple[int, int, bool]]:
        """``{name: (in_features, out_features, has_bias)}`` of one decoder layer's linears."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim, self.attention_bias),
            "k_proj": (h, self.kv_dim, self.attention_bias),
            "v_proj": (h, self.kv_dim, self.attention_bias),
            "o_proj": (self.q_dim, h, self.o_proj_bias),
            "gate_proj": (h, i, self.mlp_bias),
            "up_proj": (h, i, self.mlp_bias),
            "down_proj": (i, h, self.mlp_bias),
        }

    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        n = sum(fi * fo + (fo if bias else 0) for fi, fo, bias in self.linears().values())
        n += self.norms_per_layer * self.hidden
        if self.qk_norm:
            n += 2 * self.dim_head
        return n

    def params(self) -> int:
        """Exact parameter count: embedding + layers + final norm + lm_head (unless tied)."""
        table = self.vocab * self.hidden
        return table + self.layers * self.layer_params() + self.hidden + (0 if self.tied else table)

    def with_layers(self, layers: int) -> "ModelShape":
        """The same width with another depth."""
        return dataclasses.replace(self, layers=layers, name=f"{self.name or 'model'}@{layers}L")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"params": self.params()}

    # -------------------------------------------------------------- from a HF config
    @classmethod
    def from_hf_config(cls, config: Any, name: str = "") -> "ModelShape":
        """Shape of a transformers config (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``,
        ``Qwen3Config``, ``GemmaConfig``, ``Gemma2Config``, ``Gemma3TextConfig``...) or of the
        plain dict of a ``config.json``. Duck-typed on the attribute names; a multimodal config
        is read through its ``text_config``.
        """
        if isinstance(config, dict):
            config = types.SimpleNamespace(**config)
        text = getattr(config, "text_config", None)
        if getattr(config, "hidden_size", None) is None and text is not None:
            config = types.SimpleNamespace(**text) if isinstance(text, dict) else text
        model_type = str(getattr(config, "model_type", "") or "")
        for moe in ("num_local_experts", "num_experts", "n_routed_experts"):
            if getattr(config, moe, None):
                raise ValueError(
                    f"config of model_type={model_type!r} has {moe}={getattr(config, moe)}: mixture-of-experts "
                    "models are not modelled by the memory planner (nor supported by megatrain yet)."
                )
        required = {
            "hidden": "hidden_size",
            "intermediate": "intermediate_size",
            "layers": "num_hidden_layers",
            "heads": "num_attention_heads",
            "vocab": "vocab_size",
        }
        values: dict[str, Any] = {}
        missing = []
        for key, attr in required.items():
            value = getattr(config, attr, None)
            if value is None:
                missing.append(attr)
            values[key] = value
        if missing:
            raise ValueError(
                f"config (model_type={model_type!r}) lacks {missing}; the memory planner reads Llama-style "
                f"configs with {sorted(required.values())}. Fix: pass the config.json of a decoder-only "
                "causal LM (Llama, Mistral, Qwen2/3, Gemma) or use a preset."
            )
        kv = getattr(config, "num_key_value_heads", None) or values["heads"]
        tied_default = model_type.startswith("gemma")  # transformers' class defaults
        attn_bias = bool(getattr(config, "attention_bias", False))
        qwen2 = model_type.startswith("qwen2")
        head_dim = getattr(config, "head_dim", None)
        if head_dim is not None and head_dim * values["heads"] == values["hidden"]:
            head_dim = None  # the default; keeps presets and configs comparable
        return cls(
            **values,
            kv_heads=kv,
            tied=bool(getattr(config, "tie_word_embeddings", tied_default)),
            head_dim=head_dim,
            attention_bias=attn_bias or qwen2,
            o_proj_bias=attn_bias and not qwen2,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3", "gemma3_text"),
            norms_per_layer=4 if model_type in ("gemma2", "gemma3", "gemma3_text") else 2,
            name=name or str(getattr(config, "_name_or_path", "") or model_type),
        )


def _preset(name: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, **kw) -> ModelShape:
    return ModelShape(
        hidden=hidden, intermediate=inter, layers=layers, heads=heads, kv_heads=kv, vocab=vocab, name=name, **kw
    )


PRESETS: dict[str, ModelShape] = {
    p.name: p
    for p in (
        _preset("tiny", 64, 128, 2, 4, 2, 128),  # the tests' tiny Llama (untied)
        _preset("llama-1.36b", 2048, 5632, 24, 16, 16, 32000),
        _preset("llama-3.14b", 3072, 8192, 26, 24, 24, 32000),
        _preset("llama-7b", 4096, 11008, 32, 32, 32, 32000),  # Llama-2-7B: 6.74 B
        _preset("llama-13b", 5120, 13824, 40, 40, 40, 32000),  # Llama-2-13B: 13.0 B
        _preset("qwen2.5-14b", 5120, 13824, 48, 40, 8, 152064, attention_bias=True),  # 14.8 B
        _preset("llama-70b", 8192, 28672, 80, 64, 8, 32000),  # Llama-2-70B: 69.0 B
    )
}
"""Named shapes for planning without a config.json (``--model llama-7b``)."""


# ---------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class _Tensor:
    numel: int
    matrix: bool  # ndim >= 2
    trainable: bool


@dataclass(frozen=True)
class _UnitLayout:
    kind: str  # "embedding" | "layer" | "norm" | "head"
    tensors: tuple[_Tensor, ...]
    reads_embedding: bool = False  # a tied head computes with the embedding's fp32 flat


def _layout(shape: ModelShape, lora_rank: int | None, lora_targets: Iterable[str]) -> list[_UnitLayout]:
    """The units as the store sees them (one layer layout; every layer is identical)."""
    lora = lora_rank is not None
    full = not lora
    table = shape.vocab * shape.hidden
    layer: list[_Tensor] = []
    for lname, (fi, fo, bias) in shape.linears().items():
        layer.append(_Tensor(fi * fo, True, full))
        if bias:
            layer.append(_Tensor(fo, False, full))
        if lora and lname in lora_targets:
            # LoRA matrices travel in fp32 like vectors (store.wire_dtype): matrix=False here
            layer.append(_Tensor(lora_rank * fi, False, True))  # lora_A: (r, in)
            layer.append(_Tensor(fo * lora_rank, False, True))  # lora_B: (out, r)
    if shape.qk_norm:
        layer += [_Tensor(shape.dim_head, False, full)] * 2
    layer += [_Tensor(shape.hidden, False, full)] * shape.norms_per_layer
    units = [_UnitLayout("embedding", (_Tensor(table, True, full),))]
    units += [_UnitLayout("layer", tuple(layer))] * shape.layers
    units.append(_UnitLayout("norm", (_Tensor(shape.hidden, False, full),)))
    if shape.tied:
        units.append(_UnitLayout("head", (), reads_embedding=True))
    else:
        units.append(_UnitLayout("head", (_Tensor(table, True, full),)))
    return units


def _wire_bytes(t: _Tensor, kind: str, compute_bytes: int) -> int:
    """Bytes per element on the link: matrices outside the embedding in the compute dtype, else fp32."""
    return compute_bytes if t.matrix and kind != "embedding" else 4


def _host_tiers(units: list[_UnitLayout], compute_bytes: int) -> dict[str, int]:
    trainable = staging = frozen = 0
    for unit in units:
        for t in unit.tensors:
            n = _aligned(t.numel)
            wire = _wire_bytes(t, unit.kind, compute_bytes)
            if t.trainable:
                trainable += n
                if wire != 4:
                    staging += n * wire
            else:
                frozen += n * wire
    return {
        "master": 4 * trainable,
        "grad": 4 * trainable,
        "exp_avg": 4 * trainable,
        "exp_avg_sq": 4 * trainable,
        "staging": staging,
        "frozen": frozen,
    }


def host_breakdown_for_units(
    units: list[tuple[str, torch.nn.Module]] | list[torch.nn.Module],
    *,
    compute_dtype: torch.dtype | str,
    staging: bool = True,
    embedding_units: frozenset[int] = frozenset({0}),
    optimizer_state: bool = True,
) -> dict[str, int]:
    """Exact host bytes per tier for real modules, walked the way ``HostStore`` walks them.

    For the engine: call it with the same ``units`` / ``embedding_units`` it hands the store, then
    :func:`check_host_memory` with ``sum(breakdown.values())`` before allocating. ``staging``:
    whether the store keeps a compute-dtype copy (``HostStore`` does unless compute is fp32 on
    the CPU); ``optimizer_state``: count ``HostAdamW``'s two fp32 moments per trainable element.
    Tied parameters (same tensor in two units) are counted once, frozen ones
    (``requires_grad=False``) in their wire dtype only.
    """
    dtype = _DTYPE_BY_NAME.get(compute_dtype) if isinstance(compute_dtype, str) else compute_dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"compute_dtype={compute_dtype!r} is not supported; allowed: torch.bfloat16, torch.float32 "
            f"or one of {sorted(_DTYPE_BY_NAME)}."
        )
    seen: set[int] = set()
    trainable = low_precision = frozen = 0
    for u, item in enumerate(units):
        module = item[1] if isinstance(item, tuple) else item
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in seen:  # tied: lives in the first unit that has it
                continue
            seen.add(id(p))
            n = _aligned(p.numel())
            wire = wire_dtype(p, dtype, u in embedding_units, name)  # the store's own rule
            if p.requires_grad:
                trainable += n
                low_precision += n if wire != torch.float32 else 0
            else:
                frozen += n * torch.empty((), dtype=wire).element_size()
    moments = 4 * trainable if optimizer_state else 0
    return {
        "master": 4 * trainable,
        "grad": 4 * trainable,
        "exp_avg": moments,
        "exp_avg_sq": moments,
        "staging": low_precision * torch.empty((), dtype=dtype).element_size() if staging else 0,
        "frozen": frozen,
    }



# ---------------------------------------------------------------------------------------- plan
@dataclass(kw_only=True)
class MemoryPlan:
    """Bytes per memory tier of one training configuration. Build with :func:`plan_memory`.

    Host numbers are exact for the store's layout. GPU numbers are an estimate, summed over
    items that do not all peak at the same moment (so on the safe side), assuming SDPA/flash
    attention (no ``seq x seq`` score matrix; ``attn_implementation="eager"`` needs
    ``micro_batch * heads * seq^2 * ~6 B`` more) and a Llama-style layer. Only
    ``gpu_checkpoints`` grows with the number of layers.
    """

    shape: ModelShape
    """The model planned for."""
    seq_len: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per micro-batch (per forward/backward)."""
    grad_accum: int
    """Micro-batches per optimizer step."""
    micro_batches_in_flight: int
    """Micro-batches whose activation checkpoints live on the GPU at once: 1 for the per-micro-batch
    schedule, ``grad_accum`` for the layer-major schedule."""
    compute_dtype: str
    """``"bf16"`` or ``"fp32"``: dtype of the streamed matrices and of the compute."""
    lora_rank: int | None
    """LoRA rank when only adapters train (base weights frozen); ``None`` for full fine-tuning."""
    total_params: int
    """Every parameter of the model (tied counted once), adapters included."""
    trainable_params: int
    """Parameters with master, gradient and AdamW state."""
    frozen_params: int
    """Parameters held once in their wire dtype (LoRA base weights)."""

    host_master: int
    """fp32 master weights: 4 B per trainable parameter."""
    host_grad: int
    """fp32 gradient accumulators: 4 B per trainable parameter."""
    host_exp_avg: int
    """AdamW first moment, fp32: 4 B per trainable parameter."""
    host_exp_avg_sq: int
    """AdamW second moment, fp32: 4 B per trainable parameter."""
    host_staging: int
    """Compute-dtype copy of trainable matrices of layers and lm_head (2 B each in bf16, none in fp32)."""
    host_frozen: int
    """Frozen weights in their wire dtype (2 B for bf16 matrices, 4 B for vectors/embedding/fp32)."""

    gpu_weight_slots: int
    """Two slots of the largest unit's weights in wire dtype: the unit computing + the one prefetched."""
    gpu_checkpoints: int
    """Activation checkpoints: one fp32 ``tokens x hidden`` tensor per decoder layer (plus the final
    norm's and lm_head's inputs) per micro-batch in flight. The only item that grows with depth."""
    gpu_layer_working_set: int
    """Recomputing one decoder layer with grad: q/k/v, attention output, MLP gate/up/activation
    intermediates in the compute dtype, the fp32 residual-stream/norm tensors and the fp32
    gradients flowing in and out, for ``micro_batch * seq_len`` tokens."""
    gpu_weight_grads: int
    """Gradients of the largest unit's trainable weights, counted in fp32 (an upper bound: autograd
    returns them in the wire dtype and each is converted to fp32 on the device before its D2H)."""
    gpu_logits: int
    """Loss: logits in the compute dtype (kept in the model output) + fp32 log-probabilities + two
    fp32 gradients, ``tokens x vocab`` each."""
    gpu_runtime: int
    """Fixed allowance: CUDA context, cuBLAS workspaces, allocator slack."""

    # -------------------------------------------------------------- totals
    @property
    def host_total(self) -> int:
        """All host bytes of the store and the optimizer."""
        return sum(self.host_breakdown().values())

    @property
    def gpu_total(self) -> int:
        """Estimated peak GPU bytes (sum of the items)."""
        return sum(self.gpu_breakdown().values())

    @property
    def bytes_per_trainable_param(self) -> float:
        """Host bytes of the trainable tiers (master, grad, moments, staging) per trainable parameter:
        16 in fp32, ~18 in bf16 (16 + 2 for the staging copy of the matrices)."""
        trainable = self.host_total - self.host_frozen
        return trainable / self.trainable_params if self.trainable_params else 0.0

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch

    def host_breakdown(self) -> dict[str, int]:
        """``{tier: bytes}`` for :func:`check_host_memory`."""
        return {
            "master": self.host_master,
            "grad": self.host_grad,
            "exp_avg": self.host_exp_avg,
            "exp_avg_sq": self.host_exp_avg_sq,
            "staging": self.host_staging,
            "frozen": self.host_frozen,
        }

    def gpu_breakdown(self) -> dict[str, int]:
        return {
            "weight_slots": self.gpu_weight_slots,
            "checkpoints": self.gpu_checkpoints,
            "layer_working_set": self.gpu_layer_working_set,
            "weight_grads": self.gpu_weight_grads,
            "logits": self.gpu_logits,
            "runtime": self.gpu_runtime,
        }

    def check_host(self, available: int | None = None, headroom_bytes: int = DEFAULT_HEADROOM_BYTES) -> int:
        """:func:`check_host_memory` for this plan; returns the bytes to spare."""
        return check_host_memory(self.host_total, self.host_breakdown(), available, headroom_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = self.shape.to_dict()
        d["host_total"] = self.host_total
        d["gpu_total"] = self.gpu_total
        d["bytes_per_trainable_param"] = self.bytes_per_trainable_param
        return d

    def table(self) -> str:
        """A readable, aligned text table (GiB, and bytes per parameter for the host tiers)."""
        s = self.shape
        tokens = self.tokens_per_micro_batch
        lora = f", LoRA r={self.lora_rank}" if self.lora_rank is not None else ""
        lines = [
            f"memory plan: {s.name or 'model'}  ({self.total_params / 1e9:.2f} B params, "
            f"{self.trainable_params / 1e9:.2f} B trainable{lora}), compute {self.compute_dtype}",
            f"  shape: hidden {s.hidden}, intermediate {s.intermediate}, {s.layers} layers, heads {s.heads}/"
            f"{s.kv_heads} kv, vocab {s.vocab}{', tied' if s.tied else ''}",
            f"  batch: seq {self.seq_len} x micro-batch {self.micro_batch} = {tokens} tokens, grad-accum "
            f"{self.grad_accum} ({self.micro_batches_in_flight} micro-batch(es) in flight)",
            "",
        ]
        w = 44
        per = self.total_params or 1
        lines.append(f"{'HOST RAM (pinned, exact)':<{w}}{'GiB':>9}{'B/param':>9}")
        labels = dict(_TIER_LABELS)
        labels["staging"] = f"{self.compute_dtype} staging copies (matrices)"
        for key, value in self.host_breakdown().items():
            lines.append(f"  {labels[key]:<{w - 2}}{_gib(value):>9}{value / per:>9.2f}")
        lines.append(f"  {'total':<{w - 2}}{_gib(self.host_total):>9}{self.host_total / per:>9.2f}")
        lines.append("")
        lines.append(f"{'GPU (estimate)':<{w}}{'GiB':>9}")
        n_ckpt = s.layers + 2
        gpu_labels = {
            "weight_slots": "weight slots (2 x largest unit, wire dtype)",
            "checkpoints": f"checkpoints ({n_ckpt} units x {self.micro_batches_in_flight} micro-batch)",
            "layer_working_set": "one layer's recompute working set",
            "weight_grads": "weight grads of largest unit (fp32)",
            "logits": "logits + loss (tokens or one chunk x vocab)",
            "runtime": "CUDA context + workspaces (allowance)",
        }
        for key, value in self.gpu_breakdown().items():
            lines.append(f"  {gpu_labels[key]:<{w - 2}}{_gib(value):>9}")
        lines.append(f"  {'total':<{w - 2}}{_gib(self.gpu_total):>9}")
        return "\n".join(lines)


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}")
    return value


def plan_memory(
    shape: ModelShape,
    *,
    seq_len: int,
    micro_batch: int,
    grad_accum: int = 1,
    compute_dtype: str = "bf16",
    layer_major: bool = True,
    chunked_loss: bool = True,
    loss_chunk_tokens: int | None = None,
    lora_rank: int | None = None,
    lora_targets: Iterable[str] = LORA_TARGETS,
) -> MemoryPlan:
    """Plan the host tiers (exact) and the GPU items (estimate) of training ``shape``.

    ``compute_dtype``: ``"bf16"`` or ``"fp32"`` (aliases ``bfloat16``/``float32``).
    ``layer_major``: all ``grad_accum`` micro-batches of a step go through each layer together,
    so their activation checkpoints are all on the GPU (otherwise one micro-batch at a time).
    ``lora_rank``: plan a LoRA run (adapters of rank ``lora_rank`` on ``lora_targets`` of every
    layer are trainable, every base weight frozen) instead of full fine-tuning.
    """
    _check_int("seq_len", seq_len)
    _check_int("micro_batch", micro_batch)
    _check_int("grad_accum", grad_accum)
    if compute_dtype not in _COMPUTE_BYTES:
        raise ValueError(
            f"compute_dtype={compute_dtype!r} is not supported; allowed: {sorted(_COMPUTE_BYTES)}. "
            "fp16 is not supported by megatrain (use bf16)."
        )
    lora_targets = tuple(lora_targets)
    if lora_rank is not None:
        _check_int("lora_rank", lora_rank)
        unknown = sorted(set(lora_targets) - set(LORA_TARGETS))
        if unknown or not lora_targets:
            raise ValueError(
                f"lora_targets={list(lora_targets)!r}: unknown or empty ({unknown}); allowed: a non-empty "
                f"subset of {list(LORA_TARGETS)}."
            )
    cbytes = _COMPUTE_BYTES[compute_dtype]
    dtype_name = "bf16" if cbytes == 2 else "fp32"
    units = _layout(shape, lora_rank, lora_targets)
    tiers = _host_tiers(units, cbytes)

    trainable = sum(t.numel for u in units for t in u.tensors if t.trainable)
    frozen = sum(t.numel for u in units for t in u.tensors if not t.trainable)

    # GPU ------------------------------------------------------------------------------------
    embed_wire = sum(_aligned(t.numel) * 4 for t in units[0].tensors)

    def wire(unit: _UnitLayout) -> int:
        own = sum(_aligned(t.numel) * _wire_bytes(t, unit.kind, cbytes) for t in unit.tensors)
        return own + (embed_wire if unit.reads_embedding else 0)

    def grads(unit: _UnitLayout) -> int:
        n = sum(_aligned(t.numel) for t in unit.tensors if t.trainable)
        if unit.reads_embedding and units[0].tensors[0].trainable:
            n += _aligned(units[0].tensors[0].numel)
        return 4 * n

    distinct = units[:2] + units[-2:]  # embedding, one layer, norm, head
    tokens = seq_len * micro_batch
    in_flight = grad_accum if layer_major else 1
    h, i = shape.hidden, shape.intermediate
    per_token = cbytes * (2 * h + 2 * shape.q_dim + 2 * shape.kv_dim + 4 * i) + 4 * (6 * h)
    plan = MemoryPlan(
        shape=shape,
        seq_len=seq_len,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        micro_batches_in_flight=in_flight,
        compute_dtype=dtype_name,
        lora_rank=lora_rank,
        total_params=trainable + frozen,
        trainable_params=trainable,
        frozen_params=frozen,
        host_master=tiers["master"],
        host_grad=tiers["grad"],
        host_exp_avg=tiers["exp_avg"],
        host_exp_avg_sq=tiers["exp_avg_sq"],
        host_staging=tiers["staging"],
        host_frozen=tiers["frozen"],
        gpu_weight_slots=2 * max(wire(u) for u in distinct),
        gpu_checkpoints=(shape.layers + 2) * in_flight * tokens * h * 4,
        gpu_layer_working_set=tokens * per_token,
        gpu_weight_grads=max(grads(u) for u in distinct),
        # chunked loss: one chunk's logits at a time; else every in-flight micro-batch's logits and
        # log-probs wait for the backward (layer-major: the step's one backward)
        gpu_logits=(min(tokens, loss_chunk(loss_chunk_tokens, shape.vocab)) if chunked_loss else in_flight * tokens)
        * shape.vocab * (cbytes + 12),
        gpu_runtime=GPU_RUNTIME_ALLOWANCE_BYTES,
    )
    logger.debug("memory plan for %s: host %.2f GiB, GPU %.2f GiB", shape.name, plan.host_total / GiB,
                 plan.gpu_total / GiB)
    return plan


# ---------------------------------------------------------------------------------------- checks
def available_host_bytes() -> int:
    """Host RAM available to a new allocation now (``psutil.virtual_memory().available``)."""
    return int(psutil.virtual_memory().available)


def check_host_memory(
    needed_bytes: int,
    breakdown: dict[str, int],
    available: int | None = None,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
) -> int:
    """Raise ``MemoryError`` (with the arithmetic and the fix) unless ``needed_bytes`` plus
    ``headroom_bytes`` fit in ``available`` (default: :func:`available_host_bytes`).

    ``breakdown`` maps tier names (``master``, ``grad``, ``exp_avg``, ``exp_avg_sq``, ``staging``,
    ``frozen`` or any label) to bytes; it is shown in the message. Returns the bytes to spare.
    """
    _check_int("needed_bytes", needed_bytes, 0)
    _check_int("headroom_bytes", headroom_bytes, 0)
    if available is None:
        available = available_host_bytes()
    spare = available - needed_bytes - headroom_bytes
    if spare >= 0:
        logger.info(
            "host memory: %.2f GiB needed + %.2f GiB headroom <= %.2f GiB available (%.2f GiB to spare)",
            needed_bytes / GiB, headroom_bytes / GiB, available / GiB, spare / GiB,
        )
        return spare
    width = max([len(_TIER_LABELS.get(k, k)) for k in breakdown] + [28])
    rows = [f"  {_TIER_LABELS.get(k, k):<{width}} {_gib(v):>9} GiB" for k, v in breakdown.items()]
    listed = sum(breakdown.values())
    if listed != needed_bytes:
        rows.append(f"  {'other':<{width}} {_gib(needed_bytes - listed):>9} GiB")
    rows += [
        f"  {'= needed':<{width}} {_gib(needed_bytes):>9} GiB",
        f"  {'+ headroom (process, data, OS)':<{width}} {_gib(headroom_bytes):>9} GiB",
        f"  {'= required':<{width}} {_gib(needed_bytes + headroom_bytes):>9} GiB",
        f"  {'available now':<{width}} {_gib(available):>9} GiB",
        f"  {'short by':<{width}} {_gib(-spare):>9} GiB",
    ]
    message = (
        f"megatrain needs {_gib(needed_bytes)} GiB of host RAM (+ {_gib(headroom_bytes)} GiB headroom) but only "
        f"{_gib(available)} GiB is available:\n" + "\n".join(rows) + "\n"
        "Fix: train a smaller model (fewer layers or a smaller preset; `megatrain estimate` prints the "
        "largest that fits), use LoRA/PEFT (frozen base weights cost 2 B/param in bf16 instead of ~18 B), "
        "free RAM held by other processes, or use a machine with more RAM."
    )
    raise MemoryError(message)


# ---------------------------------------------------------------------------------------- what fits
@dataclass(kw_only=True)
class ModelFit:
    """The largest models whose host plan fits a RAM budget. Build with :func:`largest_model`."""

    available_bytes: int
    """The RAM budget planned against."""
    headroom_bytes: int
    """Kept free on top of the plan."""
    base: ModelShape
    """The shape that was scaled."""
    deepest: ModelShape | None
    """``base`` with the most layers that fit (width unchanged), ``None`` if not even one layer fits."""
    widest: ModelShape | None
    """``base``'s depth at the largest width that fits (head width and GQA ratio kept), or ``None``."""
    deepest_host_bytes: int = 0
    """Host plan of ``deepest``."""
    widest_host_bytes: int = 0
    """Host plan of ``widest``."""

    def describe(self) -> str:
        budget = f"{_gib(self.available_bytes)} GiB (- {_gib(self.headroom_bytes)} GiB headroom)"
        parts = [f"in {budget}, at the width of {self.base.name or 'the base'}:"]
        if self.deepest is None:
            parts.append("  not even one layer fits")
        else:
            parts.append(
                f"  deepest: {self.deepest.layers} layers = {self.deepest.params() / 1e9:.2f} B params "
                f"({_gib(self.deepest_host_bytes)} GiB host)"
            )
        if self.widest is not None:
            w = self.widest
            parts.append(
                f"  widest at {w.layers} layers: hidden {w.hidden}, intermediate {w.intermediate}, heads "
                f"{w.heads}/{w.kv_heads} = {w.params() / 1e9:.2f} B params ({_gib(self.widest_host_bytes)} GiB host)"
            )
        return "\n".join(parts)


def _host_total(shape: ModelShape, compute_dtype: str, lora_rank: int | None) -> int:
    return sum(_host_tiers(_layout(shape, lora_rank, LORA_TARGETS), _COMPUTE_BYTES[compute_dtype]).values())


def largest_model(
    available_bytes: int,
    *,
    base: ModelShape = PRESETS["llama-7b"],
    compute_dtype: str = "bf16",
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    lora_rank: int | None = None,
) -> ModelFit:
    """The largest depth and the largest width of ``base`` whose host plan fits ``available_bytes``.

    Host RAM is the binding limit (the GPU side does not grow with depth, except for the
    activation checkpoints). Depth: host bytes are ``fixed + layers * per_layer`` (embedding,
    final norm and lm_head are the fixed part), so the deepest model is
    ``(budget - fixed) // per_layer`` layers. Width: at ``base.layers``, the hidden size grows in
    steps of ``head_dim * (heads // kv_heads)`` (whole GQA groups of the same head width), the
    intermediate size in proportion (rounded to 256); host bytes grow monotonically with it, so
    a bisection finds the widest.
    """
    _check_int("available_bytes", available_bytes, 0)
    if compute_dtype not in _COMPUTE_BYTES:
        raise ValueError(f"compute_dtype={compute_dtype!r}; allowed: {sorted(_COMPUTE_BYTES)}")
    budget = available_bytes - headroom_bytes
    one, two = (_host_total(base.with_layers(n), compute_dtype, lora_rank) for n in (1, 2))
    per_layer = two - one
    fixed = one - per_layer
    layers = (budget - fixed) // per_layer if budget > fixed else 0
    deepest = base.with_layers(int(layers)) if layers >= 1 else None

    group = base.heads // base.kv_heads
    step = base.dim_head * group

    def widened(k: int) -> ModelShape:
        hidden = k * step
        inter = max(256, round(base.intermediate * hidden / base.hidden / 256) * 256)
        heads = hidden // base.dim_head
        return dataclasses.replace(
            base,
            hidden=hidden,
            intermediate=inter,
            heads=heads,
            kv_heads=heads // group,
            head_dim=base.head_dim,
            name=f"{base.name or 'model'}@hidden{hidden}",
        )

    def fits(k: int) -> bool:
        return _host_total(widened(k), compute_dtype, lora_rank) <= budget

    widest = None
    if fits(1):
        lo, hi = 1, 2
        while fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        widest = widened(lo)
    return ModelFit(
        available_bytes=available_bytes,
        headroom_bytes=headroom_bytes,
        base=base,
        deepest=deepest,
        widest=widest,
        deepest_host_bytes=_host_total(deepest, compute_dtype, lora_rank) if deepest else 0,
        widest_host_bytes=_host_total(widest, compute_dtype, lora_rank) if widest else 0,
    )


def largest_preset(
    available_bytes: int,
    *,
    compute_dtype: str = "bf16",
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    lora_rank: int | None = None,
) -> str | None:
    """Name of the real-size preset with the most parameters whose host plan fits, or ``None``
    (the test preset ``tiny`` is not considered)."""
    fitting = [
        (shape.params(), name)
        for name, shape in PRESETS.items()
        if name != "tiny" and _host_total(shape, compute_dtype, lora_rank) + headroom_bytes <= available_bytes
    ]
    return max(fitting)[1] if fitting else None


# ---------------------------------------------------------------------------------------- CLI
def resolve_model(model: str) -> ModelShape:
    """A preset name, a directory holding ``config.json``, or a ``config.json`` file -> shape."""
    if model in PRESETS:
        return PRESETS[model]
    path = model
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--model {model!r} is a directory without config.json; pass a model directory.")
    if not os.path.isfile(path):
        raise ValueError(
            f"--model {model!r} is neither a preset nor a path; presets: {sorted(PRESETS)}; or pass a "
            "directory containing config.json or a config.json file (for a Hub model, download its "
            "config.json first, e.g. `hf download <repo> config.json --local-dir <dir>`)."
        )
    return ModelShape.from_hf_config(_read_config(path), name=model)


def _read_config(path: str) -> Any:
    """The transformers config of a config.json (class defaults applied), or its raw dict."""
    with open(path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); pass a model's config.json.") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not a config object.")
    try:
        from transformers import AutoConfig  # lazy: only this path needs transformers

        return AutoConfig.from_pretrained(path) if "model_type" in raw else raw
    except Exception as exc:  # unknown model_type, old transformers: fall back to the raw dict
        logger.info("transformers could not build a config from %s (%s); reading it as plain JSON", path, exc)
        return raw


def estimate_main(argv: list[str] | None = None) -> int:
    """``megatrain estimate``: print the memory plan of a model and what fits this machine."""
    parser = argparse.ArgumentParser(
        prog="megatrain estimate",
        description="Host RAM (exact) and GPU memory (estimate) needed to train a model with megatrain.",
    )
    parser.add_argument("--model", required=True,
                        help=f"preset ({', '.join(PRESETS)}), a model directory with config.json, or a config.json")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="compute dtype (default bf16)")
    parser.add_argument("--layer-major", action=argparse.BooleanOptionalAction, default=True,
                        help="all grad-accum micro-batches in flight (layer-major schedule, Trainer's default "
                             "unless the model has dropout; --no-layer-major: one at a time)")
    parser.add_argument("--chunked-loss", action=argparse.BooleanOptionalAction, default=True,
                        help="head + loss chunk by chunk (the default under plain Trainer; --no-chunked-loss: "
                             "full logits, e.g. Trainer subclasses)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=None, help="tokens per loss chunk (default: auto)")
    parser.add_argument("--lora-rank", type=int, default=None, help="plan LoRA of this rank on all linears")
    parser.add_argument("--host-gib", type=float, default=None,
                        help="plan against this much RAM instead of this machine's available RAM")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--chart", default=None, metavar="PNG", help="also write a bar chart of the plan")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help is 0, usage errors are 2
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    try:
        shape = resolve_model(args.model)
        plan = plan_memory(
            shape,
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
            grad_accum=args.grad_accum,
            compute_dtype=args.dtype,
            layer_major=args.layer_major,
            chunked_loss=args.chunked_loss,
            loss_chunk_tokens=args.loss_chunk_tokens,
            lora_rank=args.lora_rank,
        )
    except ValueError as exc:
        print(f"megatrain estimate: error: {exc}", file=sys.stderr)
        return 2
    if args.host_gib is not None:
        available, source = int(args.host_gib * GiB), "given by --host-gib"
    else:
        available, source = available_host_bytes(), "available on this machine now"
    required = plan.host_total + DEFAULT_HEADROOM_BYTES
    fits = required <= available
    fit = largest_model(available, base=shape, compute_dtype=plan.compute_dtype, lora_rank=args.lora_rank)
    preset = largest_preset(available, compute_dtype=plan.compute_dtype, lora_rank=args.lora_rank)
    gpu_available = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    if args.json:
        print(json.dumps({
            "plan": plan.to_dict(),
            "host_available_bytes": available,
            "host_required_bytes": required,
            "headroom_bytes": DEFAULT_HEADROOM_BYTES,
            "fits_host": fits,
            "gpu_available_bytes": gpu_available,
            "fits_gpu": None if gpu_available is None else plan.gpu_total <= gpu_available,
            "largest_preset": preset,
            "max_layers": fit.deepest.layers if fit.deepest else 0,
            "max_layers_params": fit.deepest.params() if fit.deepest else 0,
            "widest_hidden": fit.widest.hidden if fit.widest else None,
        }, indent=2))
        return 0
    print(plan.table())
    print()
    if args.chart:
        write_chart(plan, args.chart)
        print(f"chart written to {args.chart}")
    verdict = "fits" if fits else "does NOT fit"
    print(f"host RAM {source}: {_gib(available)} GiB; plan {_gib(plan.host_total)} + headroom "
          f"{_gib(DEFAULT_HEADROOM_BYTES)} = {_gib(required)} GiB -> {verdict}"
          + ("" if fits else f" (short by {_gib(required - available)} GiB)"))
    if gpu_available is not None:
        gpu_fits = "fits" if plan.gpu_total <= gpu_available else "does NOT fit"
        print(f"GPU 0: {_gib(gpu_available)} GiB; estimate {_gib(plan.gpu_total)} GiB -> {gpu_fits}")
    else:
        print(f"GPU: none visible here; the estimate above is {_gib(plan.gpu_total)} GiB")
    mode = f"LoRA r={args.lora_rank}, " if args.lora_rank is not None else ""
    print(f"largest preset that fits ({mode}{plan.compute_dtype}): {preset or 'none'}")
    print(fit.describe())
    if not fits:
        lora_hint = "" if args.lora_rank is not None else ", --lora-rank (LoRA)"
        print(f"to fit: fewer layers / a smaller model{lora_hint}, or more RAM")
    return 0


__all__ = [
    "ModelShape",
    "PRESETS",
    "MemoryPlan",
    "ModelFit",
    "plan_memory",
    "host_breakdown_for_units",
    "available_host_bytes",
    "check_host_memory",
    "largest_model",
    "largest_preset",
    "resolve_model",
    "estimate_main",
    "LORA_TARGETS",
    "DEFAULT_HEADROOM_BYTES",
]


def write_chart(plan: MemoryPlan, path: str) -> None:
    """A PNG with two stacked bars: host RAM per tier and GPU memory per item (GiB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    breakdowns = (plan.host_breakdown(), plan.gpu_breakdown())
    scale = max(sum(b.values()) for b in breakdowns) / GiB
    for x, breakdown in enumerate(breakdowns):
        bottom = 0.0
        for name, nbytes in breakdown.items():
            value = nbytes / GiB
            if value <= 0:
                continue
            ax.bar(x, value, bottom=bottom, label=name)
            if value > 0.04 * scale:
                ax.text(x, bottom + value / 2, f"{name} {value:.1f}", ha="center", va="center", fontsize=7)
            bottom += value
        ax.text(x, bottom, f"{bottom:.1f} GiB", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([0, 1], ["host RAM", "GPU"])
    ax.set_ylabel("GiB")
    ax.set_title(f"{plan.shape.name or 'model'}: seq {plan.seq_len} x {plan.micro_batch} x {plan.grad_accum}, "
                 f"{plan.compute_dtype}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

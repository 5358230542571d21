"""Model shapes: the numbers that size a decoder-only causal LM, presets, and reading a config.json."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import types
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

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


def model_config(model: str):
    """The config of ``model`` -- a directory holding ``config.json``, or a ``config.json`` file --
    as transformers reads it (class defaults applied), or its raw dict."""
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
    return _read_config(path)


def resolve_model(model: str) -> ModelShape:
    """A preset name, a directory holding ``config.json``, or a ``config.json`` file -> shape."""
    if model in PRESETS:
        return PRESETS[model]
    return ModelShape.from_hf_config(model_config(model), name=model)


def format_count(n: int) -> str:
    """A count with three significant digits and a unit: ``1.23 B``, ``45.6 M``, ``789 K``, ``512``."""
    if n < 0:
        return "-" + format_count(-n)
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale * 0.9995:  # 999.5 K and up rounds to 1.00 M, not to "1000 K"
            value = n / scale
            digits = 2 if value < 9.995 else 1 if value < 99.95 else 0
            return f"{value:.{digits}f} {unit}"
    return str(n)


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

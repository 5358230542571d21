"""Model shapes: the numbers that size a decoder-only causal LM, presets, and reading a config.json."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import types
from dataclasses import dataclass
from typing import Any

from ..errors import MegatrainConfigError, UnsupportedModelError

logger = logging.getLogger(__name__)

_TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text", "cohere", "starcoder2", "smollm3")
"""Model types whose transformers config class ties lm_head to the embedding unless told otherwise."""
_FULL_QK_NORM = ("olmo2", "olmoe", "cohere")
"""Model types whose q/k norms span every head (``heads * head_dim`` and ``kv_heads * head_dim``)."""
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """The numbers that size a decoder-only causal LM with the Llama layout (Llama, Mistral, Qwen2/3,
    Gemma 1-3, Granite, SmolLM3) or one of its variants: fused projections (Phi-3), full-width q/k
    norms (OLMo 2, OLMoE, Cohere), a plain MLP and LayerNorms with biases (Starcoder2), routed
    experts (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE)."""

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
    """Norms of width ``hidden`` per decoder layer (2 for Llama/Qwen/Gemma, 4 for Gemma2/3, 1 for
    Cohere's parallel block)."""
    qk_norm_full: bool = False
    """The q/k norms span every head: ``q_dim`` and ``kv_dim`` elements (OLMo 2, OLMoE, Cohere)
    instead of ``head_dim`` each."""
    norm_bias: bool = False
    """Every norm (final one included) has a bias beside its weight (Starcoder2's LayerNorms)."""
    fused_qkv: bool = False
    """q, k and v are one ``qkv_proj`` (Phi-3)."""
    fused_gate_up: bool = False
    """gate and up are one ``gate_up_proj`` (Phi-3)."""
    gated_mlp: bool = True
    """The MLP is gate/up/down; ``False``: ``c_fc`` and ``c_proj`` only (Starcoder2)."""
    experts: int = 0
    """Routed experts per mixture-of-experts layer (0: a dense model). Each layer holds all of them:
    a router (``experts x hidden``) and two fused tensors, ``gate_up_proj`` (``experts x
    2 expert_intermediate x hidden``) and ``down_proj`` (``experts x hidden x expert_intermediate``)."""
    expert_intermediate: int = 0
    """Width of one expert's gated MLP (``moe_intermediate_size``; Mixtral's and OLMoE's
    ``intermediate_size``)."""
    experts_per_token: int = 0
    """Experts each token is routed to (``num_experts_per_tok``); sizes no tensor."""
    shared_expert_intermediate: int = 0
    """Width of Qwen2-MoE's shared expert (a gated MLP every token takes, with a ``hidden x 1`` gate)."""
    dense_layers: tuple[int, ...] = ()
    """Layers of a mixture-of-experts model with a dense MLP of width ``intermediate`` instead
    (Qwen2/3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``)."""
    experts_kernel: str = "grouped_mm"
    """The kernel transformers computes the routed experts with (``experts_implementation``; its
    default ``grouped_mm``): whether they cross the link in fp32 under bf16 compute follows from it
    and ``MegaTrainConfig.experts_dtype`` (``core/layout.experts_in_fp32``)."""
    positions: int = 0
    """Rows of a learned position table, a second embedding unit (GPT-2's ``wpe``); 0: none (rotary)."""
    name: str = ""
    """Label shown in tables (a preset name or the config's path)."""

    def __post_init__(self) -> None:
        for f in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"):
            value = getattr(self, f)
            if not isinstance(value, int) or value < 1:
                raise MegatrainConfigError(f"ModelShape.{f}={value!r}: must be a positive integer")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim < 1):
            raise MegatrainConfigError(f"ModelShape.head_dim={self.head_dim!r}: must be a positive integer or None")
        if self.head_dim is None and self.hidden % self.heads:
            raise MegatrainConfigError(
                f"ModelShape hidden={self.hidden} is not divisible by heads={self.heads}; "
                "set head_dim explicitly."
            )
        if self.experts and (not isinstance(self.expert_intermediate, int) or self.expert_intermediate < 1):
            raise MegatrainConfigError(
                f"ModelShape experts={self.experts} needs expert_intermediate >= 1 (got {self.expert_intermediate!r})"
            )
        if self.heads % self.kv_heads:
            raise MegatrainConfigError(
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

    def is_moe_layer(self, layer: int) -> bool:
        return self.experts > 0 and layer not in self.dense_layers

    def linears(self, layer: int = 0) -> dict[str, tuple[int, int, bool]]:
        """``{name: (in_features, out_features, has_bias)}`` of decoder layer ``layer``'s linears
        (in a mixture-of-experts layer: attention and the shared expert; see :meth:`expert_tensors`)."""
        h = self.hidden
        out: dict[str, tuple[int, int, bool]] = {}
        if self.fused_qkv:
            out["qkv_proj"] = (h, self.q_dim + 2 * self.kv_dim, self.attention_bias)
        else:
            out.update(q_proj=(h, self.q_dim, self.attention_bias), k_proj=(h, self.kv_dim, self.attention_bias),
                       v_proj=(h, self.kv_dim, self.attention_bias))
        out["o_proj"] = (self.q_dim, h, self.o_proj_bias)
        if not self.is_moe_layer(layer):
            out.update(self._mlp(self.intermediate, self.mlp_bias))
        elif self.shared_expert_intermediate:
            out.update({f"shared_expert.{k}": v for k, v in self._mlp(self.shared_expert_intermediate, False).items()})
            out["shared_expert_gate"] = (h, 1, False)
        return out

    def _mlp(self, i: int, bias: bool) -> dict[str, tuple[int, int, bool]]:
        h = self.hidden
        if not self.gated_mlp:
            return {"c_fc": (h, i, bias), "c_proj": (i, h, bias)}
        gate_up = {"gate_up_proj": (h, 2 * i, bias)} if self.fused_gate_up else {
            "gate_proj": (h, i, bias), "up_proj": (h, i, bias)}
        return {**gate_up, "down_proj": (i, h, bias)}

    def expert_tensors(self, layer: int = 0) -> dict[str, int]:
        """``{name: elements}`` of layer ``layer``'s router and routed experts (empty when dense)."""
        if not self.is_moe_layer(layer):
            return {}
        e, h, i = self.experts, self.hidden, self.expert_intermediate
        return {"gate.weight": e * h, "experts.gate_up_proj": e * 2 * i * h, "experts.down_proj": e * h * i}

    def norm_vectors(self) -> list[int]:
        """Elements of each norm vector of one decoder layer (weights, biases, q/k norms)."""
        vectors = [self.hidden] * (self.norms_per_layer * (2 if self.norm_bias else 1))
        if self.qk_norm:
            vectors += [self.q_dim, self.kv_dim] if self.qk_norm_full else [self.dim_head] * 2
        return vectors

    def layer_params(self, layer: int = 0) -> int:
        """Parameters of decoder layer ``layer`` (all alike, but the dense layers of an MoE model)."""
        n = sum(fi * fo + (fo if bias else 0) for fi, fo, bias in self.linears(layer).values())
        return n + sum(self.expert_tensors(layer).values()) + sum(self.norm_vectors())

    def params(self) -> int:
        """Exact parameter count: embedding + layers + final norm + lm_head (unless tied)."""
        table = self.vocab * self.hidden
        final_norm = self.hidden * (2 if self.norm_bias else 1)
        layers = sum(self.layer_params(layer) for layer in range(self.layers))
        return table + self.positions * self.hidden + layers + final_norm + (0 if self.tied else table)

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
        if model_type == "gpt2":
            return cls._from_gpt2(config, name)
        moe = _moe_fields(config, model_type)
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
            raise UnsupportedModelError(
                f"config (model_type={model_type!r}) lacks {missing}; the memory planner reads Llama-style "
                f"configs with {sorted(required.values())}. Fix: pass the config.json of a decoder-only "
                "causal LM (Llama, Mistral, Qwen2/3, Gemma) or use a preset."
            )
        kv = getattr(config, "num_key_value_heads", None) or values["heads"]
        attn_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        o_bias = attn_bias
        if model_type == "qwen2":
            attn_bias, o_bias = True, False
        elif model_type == "qwen2_moe":
            attn_bias, o_bias = bool(getattr(config, "qkv_bias", True)), False
        elif model_type == "starcoder2":
            attn_bias = o_bias = mlp_bias = bool(getattr(config, "use_bias", True))
        head_dim = getattr(config, "head_dim", None)
        if head_dim is not None and head_dim * values["heads"] == values["hidden"]:
            head_dim = None  # the default; keeps presets and configs comparable
        qk_norm = model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text", "olmo2", "olmoe") or (
            model_type == "cohere" and bool(getattr(config, "use_qk_norm", False)))
        return cls(
            **values,
            kv_heads=kv,
            tied=bool(getattr(config, "tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
            head_dim=head_dim,
            attention_bias=attn_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            qk_norm_full=model_type in _FULL_QK_NORM,
            norms_per_layer={"gemma2": 4, "gemma3": 4, "gemma3_text": 4, "cohere": 1}.get(model_type, 2),
            norm_bias=model_type == "starcoder2",
            fused_qkv=model_type == "phi3",
            fused_gate_up=model_type == "phi3",
            gated_mlp=model_type != "starcoder2",
            **moe,
            name=name or str(getattr(config, "_name_or_path", "") or model_type),
        )


    @classmethod
    def _from_gpt2(cls, config: Any, name: str) -> "ModelShape":
        """GPT-2: fused ``c_attn`` and every linear with a bias, a plain MLP of width ``n_inner``
        (default 4 x ``n_embd``), LayerNorms with biases, learned positions, tied head."""
        def get(key: str) -> Any:
            value = getattr(config, key, None)
            if value is None:
                raise UnsupportedModelError(f"GPT-2 config lacks {key!r}; pass a GPT2Config's config.json.")
            return value

        hidden = get("n_embd")
        return cls(hidden=hidden, intermediate=getattr(config, "n_inner", None) or 4 * hidden, layers=get("n_layer"),
                   heads=get("n_head"), kv_heads=get("n_head"), vocab=get("vocab_size"),
                   tied=bool(getattr(config, "tie_word_embeddings", True)), attention_bias=True, o_proj_bias=True,
                   mlp_bias=True, fused_qkv=True, gated_mlp=False, norm_bias=True, positions=get("n_positions"),
                   name=name or str(getattr(config, "_name_or_path", "") or "gpt2"))


def _moe_fields(config: Any, model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a config (none for a dense one); refuses layouts not modelled."""
    key = next((k for k in _EXPERT_KEYS if getattr(config, k, None)), None)
    if key is None:
        return {}
    if model_type not in ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe"):
        raise UnsupportedModelError(
            f"config of model_type={model_type!r} has {key}={getattr(config, key)}: the memory planner models "
            "the experts of mixtral, olmoe, qwen2_moe and qwen3_moe only (router, fused gate_up_proj and "
            "down_proj, Qwen2-MoE's shared expert). Fix: plan a supported family, or a dense shape of equal size."
        )
    layers = getattr(config, "num_hidden_layers", 0) or 0
    dense: tuple[int, ...] = ()
    width = getattr(config, "intermediate_size", None)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        width = getattr(config, "moe_intermediate_size", None)
        only = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    shared = getattr(config, "shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    kernel = getattr(config, "_experts_implementation", None) or getattr(config, "experts_implementation", None)
    return dict(experts=getattr(config, key), expert_intermediate=width or 0,
                experts_per_token=getattr(config, "num_experts_per_tok", 0) or 0,
                shared_expert_intermediate=shared or 0, dense_layers=dense,
                **({"experts_kernel": kernel} if isinstance(kernel, str) else {}))


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
        _preset("llama3-8b", 4096, 14336, 32, 32, 8, 128256),  # Llama-3/3.1-8B: 8.03 B
        _preset("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, attention_bias=True),  # Qwen2.5-7B: 7.62 B
        _preset("qwen2.5-14b", 5120, 13824, 48, 40, 8, 152064, attention_bias=True),  # 14.8 B
        _preset("llama-70b", 8192, 28672, 80, 64, 8, 32000),  # Llama-2-70B: 69.0 B
        _preset("llama-3-70b", 8192, 28672, 80, 64, 8, 128256),  # Llama-3-70B: 70.6 B
        _preset("mistral-large-123b", 12288, 28672, 88, 96, 8, 32768),  # Mistral-Large-2: 122.6 B
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
            raise MegatrainConfigError(f"--model {model!r} is a directory without config.json; pass a model directory.")
    if not os.path.isfile(path):
        raise MegatrainConfigError(
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
            raise MegatrainConfigError(f"{path} is not valid JSON ({exc}); pass a model's config.json.") from exc
    if not isinstance(raw, dict):
        raise MegatrainConfigError(f"{path} holds a JSON {type(raw).__name__}, not a config object.")
    try:
        from transformers import AutoConfig  # lazy: only this path needs transformers

        return AutoConfig.from_pretrained(path) if "model_type" in raw else raw
    except Exception as exc:  # unknown model_type, old transformers: fall back to the raw dict
        logger.info("transformers could not build a config from %s (%s); reading it as plain JSON", path, exc)
        return raw

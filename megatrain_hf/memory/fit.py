"""What fits a RAM budget: the deepest and widest model of a shape, the largest preset."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import MegatrainConfigError
from .host import DEFAULT_HEADROOM_BYTES, _check_int, gib
from .activations import checkpoint_bytes
from .plan import _COMPUTE_BYTES, _DTYPE_BY_NAME, LORA_TARGETS, _host_tiers, _layout
from .shapes import PRESETS, ModelShape


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
        budget = f"{gib(self.available_bytes)} GiB (- {gib(self.headroom_bytes)} GiB headroom)"
        parts = [f"in {budget}, at the width of {self.base.name or 'the base'}:"]
        if self.deepest is None:
            parts.append("  not even one layer fits")
        else:
            parts.append(
                f"  deepest: {self.deepest.layers} layers = {self.deepest.params() / 1e9:.2f} B params "
                f"({gib(self.deepest_host_bytes)} GiB host)"
            )
        if self.widest is not None:
            w = self.widest
            parts.append(
                f"  widest at {w.layers} layers: hidden {w.hidden}, intermediate {w.intermediate}, heads "
                f"{w.heads}/{w.kv_heads} = {w.params() / 1e9:.2f} B params ({gib(self.widest_host_bytes)} GiB host)"
            )
        return "\n".join(parts)


def _host_total(shape: ModelShape, compute_dtype: str, lora_rank: int | None, host_staging: bool = True,
                offload_tokens: int = 0, base_quantization: str = "none", optimizer_state: str = "fp32",
                grad_dtype: str = "fp32") -> int:
    tiers = _host_tiers(_layout(shape, lora_rank, LORA_TARGETS, base_quantization), _DTYPE_BY_NAME[compute_dtype],
                        host_staging, optimizer_state, _DTYPE_BY_NAME[grad_dtype])
    return sum(tiers.values()) + checkpoint_bytes(offload_tokens, shape.hidden, shape.layers)


def largest_model(
    available_bytes: int,
    *,
    base: ModelShape = PRESETS["llama-7b"],
    compute_dtype: str = "bf16",
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    lora_rank: int | None = None,
    host_staging: bool = True,
    offload_tokens: int = 0,
    base_quantization: str = "none",
    optimizer_state: str = "fp32",
    grad_dtype: str = "fp32",
) -> ModelFit:
    """The largest depth and the largest width of ``base`` whose host plan fits ``available_bytes``.

    Host RAM is the binding limit (the GPU side does not grow with depth, except for the
    activation checkpoints). Depth: host bytes are ``fixed + layers * per_layer`` (embedding,
    final norm and lm_head are the fixed part), so the deepest model is
    ``(budget - fixed) // per_layer`` layers. Width: at ``base.layers``, the hidden size grows in
    steps of ``head_dim * (heads // kv_heads)`` (whole GQA groups of the same head width), the
    intermediate size in proportion (rounded to 256); host bytes grow monotonically with it, so
    a bisection finds the widest.

    ``host_staging`` and ``offload_tokens`` (tokens whose activation checkpoints live in host RAM:
    sequence x micro-batch x micro-batches in flight, with ``offload_checkpoints``) plan what
    :func:`plan_memory` plans with the same options (``base_quantization`` too).
    """
    _check_int("available_bytes", available_bytes, 0)
    if compute_dtype not in _COMPUTE_BYTES:
        raise MegatrainConfigError(f"compute_dtype={compute_dtype!r}; allowed: {sorted(_COMPUTE_BYTES)}")
    budget = available_bytes - headroom_bytes

    def total(shape: ModelShape) -> int:
        return _host_total(shape, compute_dtype, lora_rank, host_staging, offload_tokens, base_quantization,
                           optimizer_state, grad_dtype)

    one, two = (total(base.with_layers(n)) for n in (1, 2))
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
        return total(widened(k)) <= budget

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
        deepest_host_bytes=total(deepest) if deepest else 0,
        widest_host_bytes=total(widest) if widest else 0,
    )


def largest_preset(
    available_bytes: int,
    *,
    compute_dtype: str = "bf16",
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    lora_rank: int | None = None,
    host_staging: bool = True,
    offload_tokens: int = 0,
    base_quantization: str = "none",
    optimizer_state: str = "fp32",
    grad_dtype: str = "fp32",
) -> str | None:
    """Name of the real-size preset with the most parameters whose host plan fits, or ``None``
    (the test preset ``tiny`` is not considered); options as in :func:`largest_model`."""
    fitting = [
        (shape.params(), name)
        for name, shape in PRESETS.items()
        if name != "tiny"
        and _host_total(shape, compute_dtype, lora_rank, host_staging, offload_tokens, base_quantization,
                        optimizer_state, grad_dtype) + headroom_bytes
        <= available_bytes
    ]
    return max(fitting)[1] if fitting else None

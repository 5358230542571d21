"""Memory: how many bytes a training run needs, per tier, before anything is allocated.

megatrain keeps every trainable tensor in host RAM (fp32 masters, fp32 gradient accumulators, fp32
AdamW moments, a compute-dtype staging copy) and streams one unit at a time to the GPU, so host
RAM, not GPU memory, bounds the model size. This package answers, from the model's shape alone,
how many bytes each tier needs (exactly as ``core/layout.py`` lays them out) and what the GPU
needs (an estimate that does not grow with depth except for the activation checkpoints)
(``plan.py``), what fits (``fit.py``), and before allocating whether the real model fits this
machine (``host.py``); ``budget.py`` sizes the layer-major schedule to a GPU memory budget while
training. ``megatrain estimate`` is ``cli.py``. See docs/memory.md.

Per trainable parameter: fp32 master 4 B + fp32 gradient accumulator 4 B + AdamW exp_avg 4 B +
exp_avg_sq 4 B = 16 B, plus 2 B of bf16 staging copy for the matrices of decoder layers and the
head (not for embedding tables and 1-D vectors, which travel in fp32 from the masters). Frozen
parameters (LoRA base weights): one copy in the wire dtype. Every tensor starts on a 64-byte
boundary of its flat; pinning registers ordinary memory (no power-of-two rounding).
"""

from __future__ import annotations

from .fit import ModelFit, largest_model, largest_preset
from .host import (
    DEFAULT_HEADROOM_BYTES,
    GiB,
    available_host_bytes,
    check_host_memory,
    host_breakdown_for_units,
)
from .plan import GPU_RUNTIME_ALLOWANCE_BYTES, LORA_TARGETS, MemoryPlan, plan_memory
from .shapes import PRESETS, ModelShape, resolve_model

__all__ = [
    "DEFAULT_HEADROOM_BYTES", "GPU_RUNTIME_ALLOWANCE_BYTES", "LORA_TARGETS", "GiB", "MemoryPlan", "ModelFit",
    "ModelShape", "PRESETS", "available_host_bytes", "check_host_memory", "host_breakdown_for_units",
    "largest_model", "largest_preset", "plan_memory", "resolve_model",
]

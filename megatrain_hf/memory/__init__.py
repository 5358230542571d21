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

from .cli import estimate_main, write_chart
from .plan import (  # noqa: F401 (_ALIGN_ELEMS: tests check it against the store's)
    _ALIGN_ELEMS,
    DEFAULT_HEADROOM_BYTES,
    GPU_RUNTIME_ALLOWANCE_BYTES,
    LORA_TARGETS,
    GiB,
    MemoryPlan,
    ModelFit,
    available_host_bytes,
    check_host_memory,
    host_breakdown_for_units,
    largest_model,
    largest_preset,
    plan_memory,
)
from .shapes import PRESETS, ModelShape, resolve_model

__all__ = [
    "DEFAULT_HEADROOM_BYTES", "GPU_RUNTIME_ALLOWANCE_BYTES", "LORA_TARGETS", "GiB", "MemoryPlan", "ModelFit",
    "ModelShape", "PRESETS", "available_host_bytes", "check_host_memory", "estimate_main", "host_breakdown_for_units",
    "largest_model", "largest_preset", "plan_memory", "resolve_model", "write_chart",
]

"""The runtime's options (part of ``MegaTrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class RuntimeOptions:
    layer_major: bool | Literal["auto"] = "auto"
    """Gradient accumulation order under Trainer with `gradient_accumulation_steps > 1`: `True`
    runs all micro-batches of an optimizer step through each layer before the next (each layer
    uploaded twice per step instead of twice per micro-batch, its gradients summed on the GPU and
    downloaded once); `False` runs them one after another as plain Trainer does. `"auto"`: layer-major
    unless the model has dropout (its random masks would then be drawn in a different order than
    plain Trainer draws them), a parameter has tensor hooks (they run once per micro-batch), or the
    Trainer subclass overrides `training_step` (its per-call state would see another order).
    Activation checkpoints of all micro-batches of a step are alive at once on the GPU (see
    docs/memory.md)."""

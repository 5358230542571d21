"""Which weights ``base_quantization`` quantizes: the frozen base weights of PEFT-wrapped Linear layers.

A LoRA layer of PEFT (``peft.tuners.lora.Linear``) keeps the layer it wraps as ``base_layer`` and
its adapters as ``lora_A`` / ``lora_B``; its ``base_layer.weight`` is what :func:`quantized_weights`
selects (told apart by those attributes, without importing PEFT). Everything else -- adapters,
``modules_to_save`` copies, norms, embeddings, biases, the head -- stays as it is. Refused, each
with the fix: a scheme the store does not have, a model PEFT did not wrap, a base weight that is
trainable (a full fine-tune) or tied to another parameter.

The store quantizes while it fills its flats (``core/frozen_formats.py``); for a model built by
``megatrain_hf.from_pretrained`` :func:`checkpoint_ranges` reads each base weight from its
checkpoint in chunks, so the weight never exists unquantized in full.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..errors import IncompatibleOptionsError, MegatrainConfigError, UnsupportedModelError
from ..core.frozen_formats import SCHEMES
from .shards import ShardReader, Stored

PEFT_WRAP_HINT = (
    "wrap the model with peft.get_peft_model(model, peft.LoraConfig(target_modules=[...])) before the "
    "Trainer (or attach()), or set MegaTrainConfig(base_quantization='none')"
)


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every PEFT LoRA layer wrapping an ``nn.Linear``."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "base_layer", None), nn.Linear) and hasattr(m, "lora_A")]


def quantized_weights(model: nn.Module, scheme: str, stored: dict[int, str] | None = None) -> dict[int, str]:
    """``id(weight) -> scheme`` of the base weights ``scheme`` quantizes (empty for ``"none"``);
    ``stored``: the weights a checkpoint holds quantized by bitsandbytes (``id -> its scheme``), which
    must be such base weights, quantized with ``scheme``."""
    schemes = set((stored or {}).values())
    if schemes and schemes != {scheme}:
        raise IncompatibleOptionsError(
            f"megatrain: the checkpoint holds weights quantized by bitsandbytes as {sorted(schemes)} but "
            f"base_quantization={scheme!r}. Fix: MegaTrainConfig(base_quantization={sorted(schemes)[0]!r}) "
            "(the stored weights are read as they are), or load the unquantized checkpoint."
        )
    if scheme == "none":
        return {}
    if scheme not in SCHEMES:
        raise MegatrainConfigError(f"MegaTrainConfig.base_quantization={scheme!r}; allowed: 'none', "
                                   + ", ".join(repr(s) for s in SCHEMES) + ".")
    layers = lora_layers(model)
    name = type(model).__name__
    if not layers:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        raise IncompatibleOptionsError(
            f"megatrain: base_quantization={scheme!r} quantizes the frozen base weights of PEFT-wrapped Linear "
            f"layers (LoRA), but no module of this {name} is wrapped by PEFT ({trainable / 1e6:.1f}M trainable "
            f"parameters: a full fine-tune keeps fp32 masters of every weight, which cannot be quantized). "
            f"Fix: {PEFT_WRAP_HINT}."
        )
    owners: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    chosen: dict[int, str] = {}
    for layer_name, layer in layers:
        weight = layer.base_layer.weight
        if weight.requires_grad:
            raise IncompatibleOptionsError(
                f"megatrain: base_quantization={scheme!r} but {layer_name}.base_layer.weight is trainable "
                "(requires_grad=True): a quantized base is frozen, only the LoRA adapters (and modules_to_save) "
                "train. Fix: freeze the base weights (peft.get_peft_model does) or set "
                "MegaTrainConfig(base_quantization='none') to train them in fp32."
            )
        if owners.get(id(weight), 0) > 1:
            raise IncompatibleOptionsError(
                f"megatrain: base_quantization={scheme!r} but {layer_name}.base_layer.weight is tied to another "
                "parameter (e.g. an lm_head tied to the input embedding), which would read it unquantized. "
                "Fix: leave that module out of LoraConfig(target_modules=...) or untie the weights."
            )
        chosen[id(weight)] = scheme
    outside = [n for n, p in model.named_parameters() if id(p) in (stored or {}) and id(p) not in chosen]
    if outside:
        raise UnsupportedModelError(
            f"megatrain: {outside[:3]} are stored quantized by bitsandbytes but are not the base weight of a PEFT "
            f"LoRA layer. Fix: add their modules to LoraConfig(target_modules=...)."
        )
    return chosen


def checkpoint_ranges(reader: ShardReader, stored_of: Callable[[torch.Tensor], Stored | None]):
    """``ranges(tensor)`` for the host store: reads elements of a checkpoint tensor, cast to fp32."""

    def ranges(tensor: torch.Tensor) -> Callable[[int, int, torch.Tensor], None] | None:
        stored = stored_of(tensor)
        if stored is None:
            return None
        size = stored.dtype.itemsize

        def read(first: int, n: int, dest: torch.Tensor) -> None:
            part = Stored(stored.path, stored.dtype, (n,), stored.start + first * size,
                          stored.start + (first + n) * size)
            reader.read_into(part, dest)

        return read

    return ranges

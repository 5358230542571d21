"""A model's units as the host store will lay them out, planned from its shape alone.

The same layout rule as the store's (``core/layout.py``): wire dtypes, alignment, the quantized
LoRA base (``core/frozen_formats.py``), so the plan and the store cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from ..core.layout import TensorSpec, UnitSizes, aligned, experts_in_fp32, lay_out, wire_dtype
from .host_tiers import host_tiers
from ..core.frozen_formats import quant_format
from .shapes import ModelShape

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Linear layers of a Llama-style decoder layer that LoRA can adapt (PEFT's module names)."""


@dataclass(frozen=True)
class _Tensor:
    numel: int
    matrix: bool  # ndim >= 2
    trainable: bool
    lora: bool = False  # a LoRA matrix (fp32 on the wire, whatever its shape)
    quant: str | None = None  # a base weight stored quantized with this scheme ...
    rows_cols: tuple[int, int] = (0, 0)  # ... of this (out, in) shape
    fp32: bool = False  # fp32 on the wire whatever its shape (routed experts whose kernel ignores autocast)


@dataclass(frozen=True)
class _UnitLayout:
    kind: str  # "embedding" | "layer" | "norm" | "head"
    tensors: tuple[_Tensor, ...]
    reads_embedding: bool = False  # a tied head computes with the embedding's fp32 flat

    def specs(self, compute_dtype: torch.dtype) -> list[TensorSpec]:
        """The tensors as the store lays them out, wire dtype by the store's own rule."""
        return [
            TensorSpec(quant_format(t.quant, t.rows_cols, compute_dtype).nbytes, False, torch.uint8) if t.quant else
            TensorSpec(t.numel, t.trainable, wire_dtype(torch.float32, 2 if t.matrix else 1, compute_dtype,
                                                          embedding=self.kind == "embedding",
                                                          name="lora_A.weight" if t.lora else "", fp32=t.fp32))
            for t in self.tensors
        ]


def _layer_layout(shape: ModelShape, layer: int, lora_rank: int | None, lora_targets: Iterable[str],
                  base_quantization: str = "none", experts_fp32: bool = False) -> _UnitLayout:
    lora = lora_rank is not None
    full = not lora
    tensors: list[_Tensor] = []
    for lname, (fi, fo, bias) in shape.linears(layer).items():
        adapted = lora and lname in lora_targets
        quant = base_quantization if adapted and base_quantization != "none" else None
        if quant and quant_format(quant, (fo, fi), torch.bfloat16) is None:
            quant = None  # not whole blocks: the store keeps it unquantized too
        tensors.append(_Tensor(fi * fo, True, full, quant=quant, rows_cols=(fo, fi)))
        if bias:
            tensors.append(_Tensor(fo, False, full))
        if adapted:
            tensors.append(_Tensor(lora_rank * fi, True, True, lora=True))  # lora_A: (r, in)
            tensors.append(_Tensor(fo * lora_rank, True, True, lora=True))  # lora_B: (out, r)
    tensors += [_Tensor(n, True, full, fp32=experts_fp32 and name.startswith("experts."))  # router, experts
                for name, n in shape.expert_tensors(layer).items()]
    tensors += [_Tensor(n, False, full) for n in shape.norm_vectors()]
    return _UnitLayout("layer", tuple(tensors))


def _layout(shape: ModelShape, lora_rank: int | None, lora_targets: Iterable[str],
            base_quantization: str = "none", experts_dtype: str = "auto") -> list[_UnitLayout]:
    """The units as the store sees them (all layers alike, but an MoE model's dense layers);
    ``base_quantization``: the LoRA-adapted base weights are stored with that scheme; ``experts_dtype``:
    ``MegaTrainConfig.experts_dtype`` (the routed experts in fp32 where it and ``shape.experts_kernel`` say so)."""
    full = lora_rank is None
    experts_fp32 = experts_in_fp32(shape.experts_kernel if shape.experts else None, experts_dtype)
    table = shape.vocab * shape.hidden
    layouts: dict[bool, _UnitLayout] = {}  # a layer's layout depends only on whether it routes experts
    for layer in range(shape.layers):
        if shape.is_moe_layer(layer) not in layouts:
            layouts[shape.is_moe_layer(layer)] = _layer_layout(shape, layer, lora_rank, lora_targets,
                                                               base_quantization, experts_fp32)
    units = [_UnitLayout("embedding", (_Tensor(table, True, full),))]
    if shape.positions:  # learned positions: a second lookup table
        units.append(_UnitLayout("embedding", (_Tensor(shape.positions * shape.hidden, True, full),)))
    units += [layouts[shape.is_moe_layer(layer)] for layer in range(shape.layers)]
    final_norm = [_Tensor(shape.hidden, False, full)] * (2 if shape.norm_bias else 1)
    units.append(_UnitLayout("norm", tuple(final_norm)))
    if shape.tied:
        units.append(_UnitLayout("head", (), reads_embedding=True))
    else:
        units.append(_UnitLayout("head", (_Tensor(table, True, full),)))
    return units


def _wire_bytes(unit: _UnitLayout, compute_dtype: torch.dtype) -> int:
    """Bytes of a unit's own tensors on the link."""
    return sum(aligned(s.numel) * s.wire.itemsize for s in unit.specs(compute_dtype))


def _host_tiers(units: list[_UnitLayout], compute_dtype: torch.dtype, host_staging: bool = True,
                optimizer_state: str = "fp32", grad_dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Host bytes per tier; without ``host_staging`` the fp32 masters are sent and rounded on the device;
    ``optimizer_state``: the moments' format (docs/optimizer-state.md)."""
    return host_tiers([lay_out(u.specs(compute_dtype)) for u in units], compute_dtype, staging=host_staging,
                      optimizer_state=optimizer_state, grad_dtype=grad_dtype)




def shape_sizes(shape: ModelShape, compute_dtype: torch.dtype, lora_rank: int | None = None,
                base_quantization: str = "none", experts_dtype: str = "auto") -> list[UnitSizes]:
    """Each unit's flats of a model of ``shape`` as the host store would lay them out: the training plan's
    layout input where there is no model (``megatrain estimate``)."""
    return [lay_out(u.specs(compute_dtype))
            for u in _layout(shape, lora_rank, LORA_TARGETS, base_quantization, experts_dtype)]

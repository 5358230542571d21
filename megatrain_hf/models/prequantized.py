"""Checkpoint weights that bitsandbytes already quantized, read as stored into the quantized flats.

A ``save_pretrained`` folder of a model quantized with ``BitsAndBytesConfig`` holds, per quantized
Linear weight ``W`` (bitsandbytes' ``QuantState.as_dict(packed=True)`` and ``Int8Params``):

* NF4 (``load_in_4bit``): ``W`` (packed codes, uint8), ``W.absmax`` (uint8 codes of the absmaxes),
  ``W.quant_map``, ``W.nested_absmax``, ``W.nested_quant_map`` and ``W.quant_state.bitsandbytes__nf4``
  (a JSON of the rest: shape, blocksizes, ``nested_offset``);
* int8 (``load_in_8bit``): ``W`` (``CB``, int8, the weight's shape) and ``<module>.SCB`` (fp32 per row).

These are exactly the pieces of ``core/frozen_formats.py``'s layout, so they are copied byte for byte: the
weights dequantize to what bitsandbytes dequantizes them to. Only the layouts ``core/frozen_formats.py`` has
are taken (NF4 with blocksize 64 and double quantization of blocksize 256, bitsandbytes' code
tables); any other is refused with its values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..errors import UnsupportedModelError
from ..core.frozen_formats import BLOCK, BLOCK2, QuantFormat, _pieces, dynamic_map, table
from .shards import ShardReader, Stored

NF4_STATE = ".quant_state.bitsandbytes__nf4"


@dataclass
class Prequantized:
    """One checkpoint weight stored quantized by bitsandbytes."""

    scheme: str  # "nf4" | "int8"
    shape: tuple[int, ...]  # the weight's own shape
    pieces: dict[str, Stored]
    offset: float = 0.0  # nf4: the double quantization's offset
    keys: tuple[str, ...] = ()  # every checkpoint key it uses

    def fill(self, fmt: QuantFormat, raw: torch.Tensor, reader: ShardReader) -> None:
        """Copy the stored pieces into ``raw``, the weight's byte range laid out by ``fmt``."""
        views = _pieces(fmt, raw)
        if self.scheme == "int8":
            reader.read_into(self.pieces["codes"], views[0])
            reader.read_into(self.pieces["scb"], views[1])
            return
        for name, view in zip(("codes", "absmax", "nested_absmax"), views[:3]):
            reader.read_into(self.pieces[name], view)
        views[3].fill_(self.offset)


def _refuse(key: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"megatrain: {key} is stored quantized by bitsandbytes with {what}; megatrain reads NF4 with blocksize 64 "
        "and double quantization (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
        "bnb_4bit_use_double_quant=True)) or LLM.int8 (load_in_8bit=True). Fix: load the unquantized checkpoint "
        "instead and set MegaTrainConfig(base_quantization='nf4'), which quantizes it the same way."
    )


def _values(reader: ShardReader, stored: Stored) -> torch.Tensor:
    out = torch.empty(stored.shape, dtype=stored.dtype)
    reader.read_into(stored, out)
    return out


def find(tensors: dict[str, Stored], key: str, reader: ShardReader) -> Prequantized | None:
    """The bitsandbytes-quantized weight stored under ``key``, or None if ``key`` is stored plainly."""
    if key + NF4_STATE in tensors:
        meta = json.loads(bytes(_values(reader, tensors[key + NF4_STATE]).tolist()).decode())
        names = {"absmax": ".absmax", "quant_map": ".quant_map", "nested_absmax": ".nested_absmax",
                 "nested_quant_map": ".nested_quant_map"}
        missing = [key + s for s in names.values() if key + s not in tensors]
        if missing or meta.get("blocksize") != BLOCK or meta.get("nested_blocksize") != BLOCK2:
            raise _refuse(key, f"blocksize {meta.get('blocksize')}, nested blocksize {meta.get('nested_blocksize')}"
                          + (f", missing {missing}" if missing else ""))
        if not torch.equal(_values(reader, tensors[key + ".quant_map"]), table("nf4")) or not torch.equal(
                _values(reader, tensors[key + ".nested_quant_map"]), dynamic_map()):
            raise _refuse(key, "code tables other than its NF4 and dynamic maps")
        pieces = {"codes": tensors[key], **{n: tensors[key + names[n]] for n in ("absmax", "nested_absmax")}}
        keys = (key, key + NF4_STATE, *(key + s for s in names.values()))
        return Prequantized("nf4", tuple(meta["shape"]), pieces, float(meta["nested_offset"]), keys)
    module = key[: -len("weight")] if key.endswith("weight") else None
    if module is not None and module + "SCB" in tensors and tensors[key].dtype == torch.int8:
        keys = tuple(k for k in (key, module + "SCB", module + "weight_format") if k in tensors)
        return Prequantized("int8", tensors[key].shape, {"codes": tensors[key], "scb": tensors[module + "SCB"]},
                            keys=keys)
    return None

"""How the host store lays out a unit's parameters: one entry per tensor (tied ones once, in the
first unit that has them), the kind (trainable, frozen, buffer), the wire dtype, a frozen matrix's
quantized format, and each unit's flat sizes (``layout.lay_out``)."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..errors import UnsupportedModelError
from .layout import Entry, Kind, TensorSpec, UnitSizes, lay_out, wire_dtype
from .frozen_formats import quant_format

logger = logging.getLogger("megatrain_hf.core.store")  # the store's messages, whichever module lays out


def plan_units(units: list[tuple[str, torch.nn.Module]], embedding_units: frozenset[int], compute_dtype: torch.dtype,
               frozen_storage: Callable[[torch.dtype], torch.dtype],
               quantize: Callable[[torch.Tensor], str | None] | None,
               fp32_params: frozenset[int] = frozenset(),
               ) -> tuple[list[list[Entry]], list[UnitSizes], dict[int, tuple[int, Entry]]]:
    """The units' entries, their flat sizes, and each parameter's home ``id(param) -> (unit, entry)``;
    ``fp32_params``: ids of parameters that cross the link in fp32 whatever their shape (``wire_dtype``'s
    ``fp32``)."""
    all_sizes, all_entries, param_home = [], [], {}
    for u, (unit_name, module) in enumerate(units):
        entries: list[Entry] = []
        fresh: list[tuple[Entry, TensorSpec]] = []
        for name, param in module.named_parameters(remove_duplicate=False):
            home = param_home.get(id(param))
            if home is not None:  # tied: lives in an earlier unit's flat
                owner, first = home
                entries.append(Entry(name, param, first.kind, owner, first.wire, first.offset, param.shape))
                continue
            if param.device.type != "cpu":
                raise UnsupportedModelError(
                    f"parameter {unit_name}.{name} is on {param.device}; megatrain needs the model "
                    "on the CPU (host RAM is its home). Load it without device_map / .to('cuda'), "
                    "e.g. AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)."
                )
            kind = Kind.TRAINABLE if param.requires_grad else Kind.FROZEN
            wire = wire_dtype(param.dtype, param.ndim, compute_dtype, embedding=u in embedding_units, name=name,
                              fp32=id(param) in fp32_params)
            scheme = quantize(param) if kind is Kind.FROZEN and quantize is not None else None
            fmt = quant_format(scheme, tuple(param.shape), wire) if scheme is not None else None
            if scheme is not None and fmt is None:
                logger.info("megatrain: %s.%s %s is kept unquantized (%s takes matrices of a whole "
                            "number of blocks)", unit_name, name, tuple(param.shape), scheme)
            entry = Entry(name, param, kind, u, wire if fmt is None else torch.uint8, 0, param.shape, fmt)
            param_home[id(param)] = (u, entry)
            entries.append(entry)
            if fmt is not None:
                fresh.append((entry, TensorSpec(fmt.nbytes, False, torch.uint8)))
                continue
            stored = wire if kind is Kind.TRAINABLE else frozen_storage(wire)
            fresh.append((entry, TensorSpec(param.numel(), kind is Kind.TRAINABLE, stored)))
        sizes = lay_out([spec for _, spec in fresh])
        for entry, spec in fresh:
            entry.offset = spec.offset
        for name, buf in module.named_buffers():
            entries.append(Entry(name, buf, Kind.BUFFER, u, buf.dtype, 0, buf.shape))
        all_entries.append(entries)
        all_sizes.append(sizes)
    return all_entries, all_sizes, param_home

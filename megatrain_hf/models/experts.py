"""Routed experts: which modules compute them, with which kernel, and so in which dtype they travel.

transformers' mixture-of-experts families keep each layer's experts as fused 3-D tensors
(``experts.gate_up_proj``: experts x 2 I x H, ``experts.down_proj``) on a module that dispatches on
``config._experts_implementation`` (its ``@use_experts_implementation``): ``"grouped_mm"`` by default,
``"batched_mm"``, ``"eager"``, or a kernel registered by the user. The default kernel is not
autocast-enabled and casts its input to the weights' dtype, so plain ``bf16=True`` training computes
the experts with the fp32 masters; sending them in bf16 like every other matrix would change the
arithmetic. Which kernels follow autocast is the wire-dtype rule's (``core/layout.py``); this module
finds the experts of a model and their kernel, and the plan decides (``plan.py``,
``MegaTrainConfig.experts_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.layout import EXPERTS_KERNELS_FOLLOWING_AUTOCAST


@dataclass(frozen=True)
class RoutedExperts:
    """The routed experts of a model's units."""

    kernel: str | None  # the experts kernel (one that ignores autocast where the modules differ); None: no experts
    params: frozenset[int]  # ids of the parameters of the experts modules whose kernel ignores autocast
    modules: int = 0  # experts modules found


def experts_kernel_of(module: torch.nn.Module) -> str | None:
    """The kernel ``module`` computes its experts with, if it is a routed-experts module: it dispatches
    on its config's ``_experts_implementation`` and holds fused 3-D expert tensors itself."""
    kernel = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if not isinstance(kernel, str):
        return None
    if not any(p.ndim >= 3 for p in module.parameters(recurse=False)):
        return None
    return kernel


def routed_experts(units: list[tuple[str, torch.nn.Module]]) -> RoutedExperts:
    """The experts modules of ``units`` (``(name, module)``): their kernel, and the parameters that plain bf16
    training computes in fp32 (every parameter of a module whose kernel does not follow autocast: the
    fused tensors and their biases)."""
    kernels: list[str] = []
    params: set[int] = set()
    for _, unit in units:
        for module in unit.modules():
            kernel = experts_kernel_of(module)
            if kernel is None:
                continue
            kernels.append(kernel)
            if kernel not in EXPERTS_KERNELS_FOLLOWING_AUTOCAST:
                params.update(id(p) for p in module.parameters(recurse=False))
    ignoring = [k for k in kernels if k not in EXPERTS_KERNELS_FOLLOWING_AUTOCAST]
    kernel = ignoring[0] if ignoring else kernels[0] if kernels else None
    return RoutedExperts(kernel, frozenset(params), len(kernels))

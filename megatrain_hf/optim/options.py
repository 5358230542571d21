"""The optimizer's options (part of ``MegaTrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from .moment_formats import MODES, unknown_state


def _check_state(name: str, value) -> None:
    if not isinstance(value, str) or value not in MODES:
        raise unknown_state(value, f"MegaTrainConfig.{name}")


@dataclass(kw_only=True)
class OptimizerOptions:
    replace_adamw: bool = True
    """When the Trainer builds `torch.optim.AdamW` (any `optim="adamw_torch*"`), replace it by
    `HostAdamW` with the same groups and hyper-parameters: same math, state kept in per-layer host
    flats next to the masters, updated in the background while the next forward runs. Other
    optimizers, and an optimizer you pass yourself together with its scheduler
    (`Trainer(optimizers=(opt, sched))`), are kept as they are and step synchronously."""

    host_adamw_kernel: Literal["auto", "native", "torch"] = "auto"
    """Kernel of the host AdamW update: `"native"` (megatrain's C++ kernel, built on first use with
    the system compiler: clip, AdamW and the bf16 staging copy in one pass over memory; results
    equal torch's fused kernel up to one rounding on a few elements), `"torch"` (torch's fused CPU
    AdamW, bitwise like `torch.optim.AdamW(fused=True)`), `"auto"`: native when computing on CUDA
    (torch's, with a warning, if it cannot be built), torch on the CPU."""

    optimizer_state: Annotated[Literal["fp32", "bf16", "8bit", "4bit"], _check_state] = "fp32"
    """How HostAdamW keeps `exp_avg` / `exp_avg_sq` in host RAM (docs/optimizer-state.md):
    `"fp32"` (exact, 8 B/param), `"bf16"` (4 B/param, rounded to nearest even each step),
    `"8bit"` (blockwise dynamic quantization, blocks of 256 with an fp32 scale each, as
    bitsandbytes' 8-bit optimizers: ~2.03 B/param), `"4bit"` (blocks of 128, as torchao's 4-bit
    AdamW: ~1.06 B/param). The moments are expanded only inside the update (one fused pass of the
    native kernel). Needs the AdamW that megatrain replaces: another optimizer is refused;
    `device_update` is refused with it. `megatrain_hf.init(optimizer_compression=True)` means `"8bit"`."""

    device_update: bool = False
    """EXPERIMENTAL. Let the GPU take a share of HostAdamW's update: each step's units are split, in
    forward order, between the host worker and a device worker by the rates both reached in the last
    step; the device keeps its units' fp32 gradients from backward to their update. Same formula; on
    CUDA the GPU's units differ from the host kernel's in the last bit. Costs GPU memory: the kept
    gradients (4 B per parameter of its share, at most a tenth of the GPU's memory; none under
    `max_gpu_memory`) and up to three pieces of state in flight. Worth it only when the update is
    exposed (little gradient accumulation): see docs/benchmarks.md."""

    def resolve_host_adamw_kernel(self, device: torch.device) -> str:
        if self.host_adamw_kernel == "auto":
            return "native" if device.type == "cuda" else "torch"
        return self.host_adamw_kernel

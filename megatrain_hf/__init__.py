"""megatrain_hf: full fine-tuning of models larger than the GPU, from the HF Trainer, by one flag.

Host RAM holds every trainable tensor (fp32 masters, gradients, AdamW state); the GPU computes
one streamed layer at a time. ``import megatrain_hf`` needs neither CUDA nor transformers' Trainer:
the Trainer/Accelerate integrations load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from . import errors
from .config import MegaTrainConfig
from .engine import Engine, attach, engine_of, gather_state_dict, load
from .errors import *  # noqa: F403 (the typed exceptions: megatrain_hf.MegatrainConfigError, ...)
from .stats import EngineStats

__version__ = "0.1.0"

_LAZY = {
    "MegaTrainPlugin": "megatrain_hf.integrations.trainer",
    "enable": "megatrain_hf.integrations.trainer",
    "disable": "megatrain_hf.integrations.trainer",
    "init": "megatrain_hf.integrations.trainer",
    "Trainer": "megatrain_hf.integrations.trainer",
    "MegaTrainAccelerator": "megatrain_hf.integrations.accelerate",
    "HostAdamW": "megatrain_hf.optim.host_adamw",
    "register_family": "megatrain_hf.models.families",
    "from_pretrained": "megatrain_hf.models.loading",
    "from_config": "megatrain_hf.models.random_init",
}

__all__ = ["MegaTrainConfig", "Engine", "EngineStats", "attach", "engine_of", "gather_state_dict", "load", "__version__",
           *errors.__all__, *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megatrain_hf' has no attribute {name!r}")
    return getattr(import_module(module), name)

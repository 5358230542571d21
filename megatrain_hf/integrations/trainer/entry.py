"""``megatrain_hf.init()`` and ``megatrain_hf.Trainer``: the two names a training script needs.

Example::

    import megatrain_hf as mt
    mt.init(max_vram_gb=80)
    model = mt.from_pretrained("path/to/model")     # or AutoModelForCausalLM.from_pretrained(..., dtype=torch.float32)
    trainer = mt.Trainer(model=model, train_dataset=ds, args=TrainingArguments(...))
    trainer.train()

``init()`` builds one ``MegaTrainConfig`` from its arguments and enables it (``enable()``: every
``transformers.Trainer`` built afterwards trains with megatrain, subclasses such as TRL's included).
``Trainer`` is ``transformers.Trainer`` with a ``MegaTrainPlugin`` of that config (of the defaults
when none is enabled) among its plugins, unless one was passed. Both are thin: the options, their
validation and the plugin are the ones of ``MegaTrainConfig`` / ``MegaTrainPlugin``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import transformers

from ...errors import MegatrainConfigError
from ...config import MegaTrainConfig
from .init_wrap import _INIT_SIGNATURE, _find_plugin, enable, enabled_config
from .plugin import MegaTrainPlugin

_INIT_NAMES = ("offload_dir", "max_vram_gb", "optimizer_compression")


def _vram_bytes(max_vram_gb: Any) -> int:
    if isinstance(max_vram_gb, bool) or not isinstance(max_vram_gb, (int, float)) or not max_vram_gb > 0:
        raise MegatrainConfigError(
            f"megatrain_hf.init(max_vram_gb={max_vram_gb!r}): must be a number of GB > 0 (10**9 bytes), "
            "e.g. max_vram_gb=80; or leave it unset for no GPU memory budget.")
    return int(max_vram_gb * 10**9)


_COMPRESSION = {True: "8bit", False: "fp32", "bf16": "bf16", "8bit": "8bit", "4bit": "4bit"}


def _compression(value: Any) -> str:
    if (isinstance(value, bool) or isinstance(value, str)) and value in _COMPRESSION:
        return _COMPRESSION[value]
    raise MegatrainConfigError(
        f"megatrain_hf.init(optimizer_compression={value!r}): allowed: True (8-bit moments), False (fp32), "
        "'bf16', '8bit' or '4bit' (docs/optimizer-state.md). Fix: e.g. optimizer_compression=True."
    )


def config_options(offload_dir: Any = None, max_vram_gb: Any = None, optimizer_compression: Any = False,
                   **options: Any) -> dict[str, Any]:
    """``init()``'s arguments as ``MegaTrainConfig`` fields (its own names mapped here, and only here)."""
    if offload_dir is not None:
        if "offload_dir" in options:
            raise MegatrainConfigError(
                f"megatrain_hf.init(): got offload_dir twice ({offload_dir!r} and {options['offload_dir']!r})")
        options["offload_dir"] = offload_dir  # MegaTrainConfig validates it (an existing, writable directory)
    if optimizer_compression is not False:
        if "optimizer_state" in options:
            raise MegatrainConfigError(
                f"megatrain_hf.init(): got optimizer_compression={optimizer_compression!r} and "
                f"optimizer_state={options['optimizer_state']!r}, which set the same thing; pass one.")
        options["optimizer_state"] = _compression(optimizer_compression)
    if max_vram_gb is not None:
        if "max_gpu_memory" in options:
            raise MegatrainConfigError(f"megatrain_hf.init(): got max_vram_gb={max_vram_gb!r} and max_gpu_memory="
                                       f"{options['max_gpu_memory']!r}, which set the same budget; pass one.")
        options["max_gpu_memory"] = _vram_bytes(max_vram_gb)
    return options


def init(offload_dir: str | None = None, max_vram_gb: float | None = None, optimizer_compression: bool | str = False,
         **options: Any) -> MegaTrainConfig:
    """Train every ``Trainer`` built from now on with megatrain; return the config.

    ``max_vram_gb``: the GPU memory budget in GB (10**9 bytes; ``MegaTrainConfig.max_gpu_memory``).
    ``optimizer_compression``: compressed AdamW moments in host RAM (``MegaTrainConfig.optimizer_state``,
    docs/optimizer-state.md): ``True`` means ``"8bit"``, ``False`` ``"fp32"`` (exact, the default), or
    one of ``"bf16"``, ``"8bit"``, ``"4bit"``.
    ``offload_dir``: a directory on a local disk for the disk tier (``MegaTrainConfig.offload_dir``; where the
    AdamW moments go is ``offload_state``'s choice, docs/disk-tier.md). Any other keyword is a
    ``MegaTrainConfig`` field (docs/configuration.md),
    e.g. ``init(compute_dtype="bf16", layer_major=False)``; an unknown one is refused. Calling ``init()``
    again replaces the config; ``megatrain_hf.disable()`` stops it.
    """
    known = {f.name for f in dataclasses.fields(MegaTrainConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise MegatrainConfigError(
            f"megatrain_hf.init() got unknown option(s) {unknown}; allowed: {list(_INIT_NAMES)} and the "
            f"MegaTrainConfig fields {sorted(known)} (docs/configuration.md)."
        )
    config = MegaTrainConfig(**config_options(offload_dir, max_vram_gb, optimizer_compression, **options))
    enable(config)
    return config


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that trains with megatrain.

    A ``MegaTrainPlugin`` of the enabled config (``init()``'s or ``enable()``'s; ``MegaTrainConfig()``
    when none is) joins its plugins, unless ``callbacks=`` or ``plugins=`` holds one already (that one
    is used). Everything
    else -- arguments, methods, subclassing -- is ``transformers.Trainer``'s.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        plugins = list(kwargs.pop("plugins", None) or [])
        callbacks = _INIT_SIGNATURE.bind_partial(self, *args, **kwargs).arguments.get("callbacks")
        if _find_plugin(plugins, callbacks) is None:
            plugins.append(MegaTrainPlugin(enabled_config() or MegaTrainConfig()))
        super().__init__(*args, plugins=plugins, **kwargs)

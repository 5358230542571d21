"""The one class-level change: a wrap of ``Trainer.__init__``, installed on first use.

``Trainer`` has no ``plugins=`` argument and its callbacks start after ``Trainer.__init__`` has
already moved the model to the device (too late for a model that does not fit). So the first
``MegaTrainPlugin()`` (or ``enable()``) wraps ``Trainer.__init__`` once; ``uninstall()`` restores
it. The wrap is inert for a Trainer built without a plugin (and without ``enable()``): it calls
the original with the same arguments. With a plugin -- in ``callbacks=`` or ``plugins=`` -- it
validates the ``TrainingArguments`` and attaches the engine to the model before the original
``__init__`` runs (with ``model_init=``, every model the Trainer builds is attached as it is
built), then binds the plugin to the new Trainer (``overrides.py``). Trainer subclasses (TRL's)
go through the same path.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import TYPE_CHECKING, Any

from transformers import Trainer

from ...errors import MegatrainConfigError
from ...config import MegaTrainConfig

if TYPE_CHECKING:
    from .plugin import MegaTrainPlugin

PLUGIN: "type[MegaTrainPlugin] | None" = None
"""The plugin class, registered by the package (``__init__.py``): this module never imports ``plugin.py``,
which imports it."""

logger = logging.getLogger(__name__)

_original_init = None
_enabled_config: MegaTrainConfig | None = None
# Trainer.__init__'s own signature, read before anything wraps it (a wrapper taking *args, **kwargs
# would hide where `model` and `callbacks` are)
_INIT_SIGNATURE = inspect.signature(Trainer.__init__)


def _find_plugin(plugins, callbacks) -> "MegaTrainPlugin | None":
    found = [p for p in list(plugins or []) + list(callbacks or []) if isinstance(p, PLUGIN)]
    unique = list({id(p): p for p in found}.values())
    if len(unique) > 1:
        raise MegatrainConfigError(f"got {len(unique)} MegaTrainPlugin instances; pass one.")
    return unique[0] if unique else None


def _patched_init(self, *args, **kwargs):
    plugins = kwargs.pop("plugins", None)
    for p in plugins or []:
        if not isinstance(p, PLUGIN):
            raise TypeError(
                f"Trainer(plugins=...) accepts MegaTrainPlugin instances (added by megatrain_hf), got "
                f"{type(p).__name__}. Pass callbacks through callbacks=."
            )
    params = _INIT_SIGNATURE.bind_partial(self, *args, **kwargs).arguments
    params.pop("self")
    plugin = _find_plugin(plugins, params.get("callbacks"))
    if plugin is None and _enabled_config is not None:
        plugin = PLUGIN(_enabled_config)
    if plugin is None:
        return _original_init(self, *args, **kwargs)

    from ..trl import check_trl_trainer

    check_trl_trainer(self)  # a TRL trainer: its trl version is one megatrain trains exactly (before attaching)
    callbacks = list(params.get("callbacks") or [])
    if not any(c is plugin for c in callbacks):
        callbacks.append(plugin)
    params["callbacks"] = callbacks
    if params.get("args") is None:
        from transformers import TrainingArguments

        params["args"] = TrainingArguments(output_dir="tmp_trainer")
    model = params.get("model")
    if model is None and params.get("model_init") is not None:
        params["model_init"] = plugin.attaching(params["model_init"], params["args"])
        attached = None
    else:
        attached = plugin.attach_to(model, params["args"])
    try:
        _original_init(self, **params)
    except BaseException:
        plugin.release(attached)
        raise
    plugin.bind(self)


def install() -> None:
    """Wrap ``Trainer.__init__`` (idempotent). Inert for Trainers built without megatrain."""
    global _original_init
    if _original_init is not None:
        return
    _original_init = Trainer.__init__
    Trainer.__init__ = functools.wraps(_original_init)(_patched_init)


def uninstall() -> None:
    """Restore the original ``Trainer.__init__``."""
    global _original_init
    if _original_init is None:
        return
    Trainer.__init__ = _original_init
    _original_init = None


def enable(config: MegaTrainConfig | None = None, **overrides: Any) -> None:
    """Every ``Trainer`` built from now on trains with megatrain (notebooks, scripts you do not edit)."""
    global _enabled_config
    if config is not None and overrides:
        raise TypeError("pass either a MegaTrainConfig or keyword overrides, not both")
    install()
    _enabled_config = config if config is not None else MegaTrainConfig(**overrides)


def disable() -> None:
    """Stop attaching megatrain to new Trainers (already attached models stay attached)."""
    global _enabled_config
    _enabled_config = None


def is_enabled() -> bool:
    return _enabled_config is not None


def enabled_config() -> MegaTrainConfig | None:
    """The config of ``enable()`` / ``init()`` while enabled, else None."""
    return _enabled_config

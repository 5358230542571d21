"""Hugging Face ``Trainer`` integration: ``MegaTrainPlugin``, ``enable()`` / ``disable()``, ``init()`` / ``Trainer``.

``init_wrap.py`` wraps ``Trainer.__init__`` (on first use), ``plugin.py`` is the callback,
``overrides.py`` the per-instance overrides, ``layer_major.py`` the accumulation driver,
``saving.py`` the optimizer state and atomic checkpoint folders, ``entry.py`` the two-name
entry (``init()`` and the ``Trainer`` subclass).
"""

from . import init_wrap
from .entry import Trainer, init
from .init_wrap import disable, enable, install, is_enabled, uninstall
from .plugin import MegaTrainPlugin

init_wrap.PLUGIN = MegaTrainPlugin  # (init_wrap never imports plugin.py, which imports it)
from ..reach import finish_pending as _boot_pending

_boot_pending(enable, is_enabled)  # megatrain's boot in a child process (integrations/reach.py)

__all__ = ["MegaTrainPlugin", "Trainer", "disable", "enable", "init", "install", "is_enabled", "uninstall"]

"""The autocast state a deferred computation must run under again."""

from __future__ import annotations

import torch


def autocast_state(device_type: str) -> tuple[bool, torch.dtype, bool]:
    """(enabled, dtype, cache_enabled) of autocast on ``device_type`` in this thread: what a deferred
    computation (a recompute, a coroutine's call run by the driver, a tile's backward) must run under again."""
    return (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled())

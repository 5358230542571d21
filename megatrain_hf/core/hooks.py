"""Which modules of the units carry user hooks: forward, pre-forward or backward hooks not known to be
deterministic, and torch's global module hooks. Layer-major accumulation reads it (hooks may draw random
numbers in another order), and the streamed backward (a backward hook may keep the gradient it sees)."""

from __future__ import annotations

from torch import nn

_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_DETERMINISTIC_HOOKS = ("megatrain_hf.", "transformers.utils.output_capturing")
"""Where the module hooks known not to draw random numbers are defined: megatrain's own (placement,
sequence length, guards) and HF's output capture (``output_attentions``, ``output_hidden_states``)."""


def _hook_origin(hook) -> str:
    hook = getattr(hook, "func", hook)  # functools.partial
    return getattr(hook, "__module__", None) or ""


def hooked_modules(units: list[tuple[str, nn.Module]]) -> list[str]:
    """The units' modules (each unit and its sub-modules, by ``(name, module)`` of the unit) with
    forward, pre-forward or backward hooks that may draw random numbers (any hook not known to be
    deterministic), and torch's global module hooks: sources of randomness in a unit's forward or
    backward that layer-major accumulation would run in another order."""
    from torch.nn.modules import module as torch_module

    def user_hooks(table) -> bool:
        return any(not _hook_origin(h).startswith(_DETERMINISTIC_HOOKS) for h in (table or {}).values())

    found = [f"{'.'.join(filter(None, (unit, name)))}.{attr}" for unit, root in units
             for name, module in root.named_modules() for attr in _MODULE_HOOKS if user_hooks(module.__dict__.get(attr))]
    found += [f"torch global {attr}" for attr in _MODULE_HOOKS if user_hooks(getattr(torch_module, f"_global{attr}"))]
    return found

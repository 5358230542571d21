"""Stateless layer templates: one weight-less copy of each distinct unit structure.

A template is a deep copy of a real unit (decoder layer, embedding, ...) whose parameters and
buffers are meta tensors: it costs no memory. Units of the same structure (same module types,
same parameter names, shapes, dtypes and trainability) share one template. To compute unit ``u``
the engine *binds* the template: it writes the device tensors of ``u`` into the template's
parameter slots (views, no copy) and mirrors the real unit's plain attributes (``layer_idx``,
``training``, sliding window, PEFT adapter switches, ...) so the template behaves exactly as the
real module would. HF's own activation checkpointing is never used inside a template: the
engine owns recompute (HF's recompute would read the real module's host parameters).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

# nn.Module machinery that must not be mirrored from the real module into the template.
_MODULE_INTERNALS = frozenset(
    {
        "_parameters",
        "_buffers",
        "_non_persistent_buffers_set",
        "_modules",
        "_backward_pre_hooks",
        "_backward_hooks",
        "_is_full_backward_hook",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "forward",  # the engine replaces the real unit's forward; the template keeps its class's
        "gradient_checkpointing",  # forced off in templates, see module docstring
        "_gradient_checkpointing_func",
        "_hf_hook",
        "_old_forward",
    }
)


def structure_key(module: nn.Module) -> tuple:
    """What two units must share to use one template."""
    mods = tuple((name, type(m)) for name, m in module.named_modules())
    params = tuple(
        (name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in module.named_parameters(remove_duplicate=False)
    )
    bufs = tuple((name, tuple(b.shape), b.dtype) for name, b in module.named_buffers())
    return mods, params, bufs


def _meta_copy(module: nn.Module) -> nn.Module:
    memo: dict[int, object] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    for m in module.modules():
        for value in vars(m).values():
            # Share configs and other non-module objects that are not ours to duplicate.
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                memo[id(value)] = value
    template = copy.deepcopy(module, memo)
    template.__dict__.pop("forward", None)
    for m in template.modules():
        if "gradient_checkpointing" in vars(m) or hasattr(type(m), "gradient_checkpointing"):
            m.gradient_checkpointing = False
    return template


@dataclass
class _Slot:
    module: nn.Module  # the template submodule that owns the tensor
    attr: str  # its name there
    is_buffer: bool


class Template:
    """A weight-less module plus the slots that binding fills."""

    def __init__(self, module: nn.Module) -> None:
        self.module = _meta_copy(module)
        self.slots: dict[str, _Slot] = {}
        named = dict(self.module.named_modules())
        for name, _ in module.named_parameters(remove_duplicate=False):
            owner, _, attr = name.rpartition(".")
            self.slots[name] = _Slot(named[owner], attr, False)
        for name, _ in module.named_buffers():
            owner, _, attr = name.rpartition(".")
            self.slots[name] = _Slot(named[owner], attr, True)
        self._template_modules = [m for _, m in self.module.named_modules()]

    def mirror_pairs(self, real: nn.Module) -> list[tuple[nn.Module, nn.Module, tuple[str, ...]]]:
        """Precomputed (template submodule, real submodule, attribute names) to mirror at bind."""
        pairs = []
        for t_mod, (_, r_mod) in zip(self._template_modules, real.named_modules()):
            keys = tuple(k for k in vars(r_mod) if k not in _MODULE_INTERNALS)
            pairs.append((t_mod, r_mod, keys))
        return pairs

    def bind(
        self,
        tensors: dict[str, torch.Tensor],
        mirror: list[tuple[nn.Module, nn.Module, tuple[str, ...]]],
    ) -> nn.Module:
        """Point every slot at ``tensors[name]`` and mirror the real unit's state; returns the module."""
        for t_mod, r_mod, keys in mirror:
            r_vars = r_mod.__dict__
            t_vars = t_mod.__dict__
            for k in keys:
                t_vars[k] = r_vars[k]
        for name, slot in self.slots.items():
            table = slot.module._buffers if slot.is_buffer else slot.module._parameters
            table[slot.attr] = tensors[name]
        return self.module

    def unbind(self) -> None:
        """Drop references to device tensors so their memory can be reused."""
        for slot in self.slots.values():
            table = slot.module._buffers if slot.is_buffer else slot.module._parameters
            table[slot.attr] = None


class TemplateCache:
    """One template per distinct structure."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, Template] = {}

    def get(self, module: nn.Module) -> Template:
        key = structure_key(module)
        template = self._by_key.get(key)
        if template is None:
            template = Template(module)
            self._by_key[key] = template
        return template

    def __len__(self) -> int:
        return len(self._by_key)

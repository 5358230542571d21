"""Callables that a unit's modules carry and that would compute with the real module: rebound or refused.

Binding mirrors a real unit's plain attributes onto its template (``template.py``). A plain attribute that
is a callable holding the real module -- a method bound with ``types.MethodType`` to a real sub-module
(axolotl's LoRA kernels: ``self_attn.apply_qkv``, ``self_attn.apply_o``), a ``functools.partial`` of one,
a closure whose cells hold one, a per-instance ``forward`` -- would compute with the real module's host
parameters instead of the streamed ones: their gradients would never reach the engine (axolotl's attention
``lora_B`` stayed 0, silently), and on a GPU they would be host tensors. A per-instance ``forward`` was
worse: a template keeps its class's ``forward``, so the kernel the user asked for did not run at all.

At attach, :func:`resolve` looks at every such value once, as deep as callables reach (bound methods'
``__self__`` and ``__func__``, partials' function and arguments, closures' cells and defaults, callable
objects' attributes, containers' items):

* a method bound to a module of the unit (``__self__``), a partial whose direct argument is one, and a
  plain attribute that is one are **rebound** to the template's counterpart: the same function on the
  template computes exactly what it computes on the real module, with the streamed weights;
* anything else that reaches a module of the unit, or any parameter the engine streams (this unit's or
  another's), is **refused** with :class:`UnitCallableError`, naming the attribute, the tool that usually
  sets it and the fix;
* everything else (functions of plain values, the config, activation modules outside the model) is
  mirrored as it is.

The template mirrors a changed attribute by resolving it again (the result is cached by identity).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UnitCallableError

_DEPTH = 6  # how deep a callable's references are followed


# (function module prefix, attribute or function name) -> (what sets it, the fix)
_KNOWN = (
    ("axolotl", "apply_qkv", "axolotl's LoRA kernels", "lora_qkv_kernel: false in the axolotl config"),
    ("axolotl", "apply_in_proj_fused", "axolotl's LoRA kernels", "lora_qkv_kernel: false in the axolotl config"),
    ("axolotl", "apply_o", "axolotl's LoRA kernels", "lora_o_kernel: false in the axolotl config"),
    ("axolotl", "apply_out_proj", "axolotl's LoRA kernels", "lora_o_kernel: false in the axolotl config"),
    ("axolotl", "apply_lora_mlp", "axolotl's LoRA kernels", "lora_mlp_kernel: false in the axolotl config"),
    ("axolotl", "apply_lora_embedding", "axolotl's LoRA kernels",
     "lora_embedding_kernel: false in the axolotl config"),
    ("axolotl", "", "axolotl", "turn off the axolotl option that patches this module"),
    ("liger_kernel", "", "Liger-Kernel's per-instance patching",
     "apply Liger-Kernel to the model class (apply_liger_kernel_to_*) before the model is built"),
    ("unsloth", "", "Unsloth", "train without Unsloth's patches"),
)


@dataclass
class UnitRefs:
    """What of the model a callable must not hold: the unit's modules (real id -> template module) and the
    ids of every parameter the engine streams."""

    modules: dict[int, nn.Module]
    streamed: frozenset[int]
    unit: str = "the unit"
    holders: bool = True
    """Whether any other module holding a streamed parameter counts too (for a unit: yes; for the model's own
    forward, which reaches the units through their streamed forwards: no)."""

    def hit(self, obj: object) -> str | None:
        """What ``obj`` itself is, if it is a thing of the model a callable must not hold, else None."""
        if isinstance(obj, nn.Module):
            if id(obj) in self.modules:
                return f"module {type(obj).__name__} of {self.unit}"
            if self.holders and any(id(p) in self.streamed for p in obj.parameters()):
                return f"module {type(obj).__name__}, which holds streamed parameters"
        elif isinstance(obj, torch.Tensor) and id(obj) in self.streamed:
            return f"a streamed parameter of shape {tuple(obj.shape)}"
        return None


def _children(obj: object) -> list[tuple[str, object]]:
    """(how it is reached, object) for what a callable or container holds."""
    if isinstance(obj, types.MethodType):
        return [("__self__", obj.__self__), ("__func__", obj.__func__)]
    if isinstance(obj, functools.partial):
        return ([("func", obj.func)] + [(f"args[{i}]", a) for i, a in enumerate(obj.args)]
                + [(f"keywords[{k!r}]", v) for k, v in obj.keywords.items()])
    if isinstance(obj, types.FunctionType):
        cells = zip(obj.__code__.co_freevars, obj.__closure__ or ())
        out = []
        for name, cell in cells:
            try:
                out.append((f"closure cell {name!r}", cell.cell_contents))
            except ValueError:  # an empty cell
                continue
        out += [(f"default {i}", d) for i, d in enumerate(obj.__defaults__ or ())]
        out += [(f"default {k!r}", d) for k, d in (obj.__kwdefaults__ or {}).items()]
        return out
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if (callable(obj) and not isinstance(obj, (type, nn.Module, torch.Tensor, types.BuiltinFunctionType,
                                                types.ModuleType)) and hasattr(obj, "__dict__")):
        return [(f".{k}", v) for k, v in vars(obj).items()]  # a callable object's own state
    return []


def find_reference(obj: object, refs: UnitRefs, depth: int = _DEPTH, seen: set[int] | None = None) -> str | None:
    """How ``obj`` reaches a module of the unit or a streamed parameter (a path), or None."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return None
    seen.add(id(obj))
    what = refs.hit(obj)
    if what is not None:
        return what
    for how, child in _children(obj):
        found = find_reference(child, refs, depth - 1, seen)
        if found is not None:
            return f"{how} -> {found}"
    return None


def _rebound(value: object, refs: UnitRefs) -> object | None:
    """``value`` computing with the template instead of the real module, where that is exact, else None."""
    if isinstance(value, nn.Module):
        return refs.modules.get(id(value))
    if isinstance(value, types.MethodType) and id(value.__self__) in refs.modules:
        if find_reference(value.__func__, refs) is None:
            return types.MethodType(value.__func__, refs.modules[id(value.__self__)])
        return None
    if isinstance(value, functools.partial):
        if find_reference(value.func, refs) is not None:
            return None
        args = [refs.modules.get(id(a), a) for a in value.args]
        keywords = {k: refs.modules.get(id(v), v) for k, v in value.keywords.items()}
        if any(find_reference(a, refs) is not None for a in (*args, *keywords.values())):
            return None  # (a template module reaches nothing: its tensors are meta or the streamed views)
        return functools.partial(value.func, *args, **keywords)
    return None


def _function_of(value: object) -> object:
    while isinstance(value, (types.MethodType, functools.partial)):
        value = value.__func__ if isinstance(value, types.MethodType) else value.func
    return value


def _tool_and_fix(attr: str, value: object) -> tuple[str, str]:
    function = _function_of(value)
    module = getattr(function, "__module__", None) or ""
    name = getattr(function, "__name__", "")
    for prefix, key, tool, fix in _KNOWN:
        if module.split(".")[0] == prefix and (not key or key == attr or name.startswith(key)):
            return tool, fix
    return (f"code in {module or 'an unknown module'}",
            "set it on the module's class instead (a class attribute or method binds to the template), or leave it "
            "unset while training with megatrain")


def resolve(value: object, attr: str, owner: str, refs: UnitRefs) -> object:
    """What the template mirrors for the real module's attribute ``attr`` = ``value`` (see module docstring).

    ``owner`` names the real sub-module (``model.layers.0.self_attn``) for the error.
    """
    if not (callable(value) or isinstance(value, (list, tuple, dict, set, frozenset, torch.Tensor))):
        return value  # a plain value: no code that could hold a module
    path = find_reference(value, refs)
    if path is None:
        return value
    rebound = _rebound(value, refs)
    if rebound is not None:
        return rebound
    tool, fix = _tool_and_fix(attr, value)
    function = _function_of(value)
    qualname = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', type(function).__name__)}"
    raise UnitCallableError(
        f"megatrain: {owner}.{attr} ({type(value).__name__} {qualname}) computes with the real module, not the "
        f"streamed one: it holds {path}. Under megatrain the unit runs on a weight-less copy bound to the streamed "
        f"weights; this callable would read the host parameters (their gradients would be lost) and megatrain "
        f"cannot rebind it exactly (only a method bound to a module of the unit, or a partial whose direct argument "
        f"is one, can be). It is usually set by {tool}. Fix: {fix}."
    )

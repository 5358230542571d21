"""Stateless layer templates: one weight-less copy of each distinct unit structure.

A template is a deep copy of a real unit (decoder layer, embedding, ...) whose parameters and
buffers are meta tensors: it costs no memory. Units of the same structure (same module types,
same parameter names, shapes, dtypes and trainability) share one template. To compute unit ``u``
the engine *binds* the template: it writes the device tensors of ``u`` into the template's
parameter *slots* (views, no copy) and mirrors the real unit's plain attributes (``layer_idx``,
``training``, sliding window, PEFT adapter switches, ...) so that the template behaves exactly as
the real module would.

Hooks: a template carries none of its own (a deep copy would carry the real modules' hooks into
every layer that shares it). The real unit's own hooks run in its ``__call__`` as usual, since
the engine replaces only its ``forward``; the hooks of the real unit's *sub-modules* (a user's hook
on ``layers[0].mlp``, HF's output-capture hooks on the attention modules and MoE routers) are
mirrored onto the template's sub-modules while it computes that unit. In the forward of a training
call every hook runs once; the backward's recompute runs again only the forward (pre-)hooks that
changed a value in the forward (returned something), so that the recomputed graph is the forward's,
while hooks that only observe fire once, as they do in a plain forward. Backward hooks of
sub-modules run in the recompute, the only pass with a graph.

What a sub-module's forward hook receives as the output may be kept and differentiated outside
the unit (HF adds the router logits it captures to the loss: the MoE auxiliary loss). So every
floating-point tensor of such an output is *seen*: :attr:`HookRecord.seen` lists them, in the order
the hooks received them, in the forward and again in the recompute (where an observing hook is not
called, only seen); the streamed call makes them outputs of its autograd node and differentiates
the recomputed ones with the gradients they received (``runtime/streamed_call.py``).

HF's own activation checkpointing is never used inside a template: the engine owns recompute
(HF's would read the real module's host parameters).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from .unit_callables import UnitRefs, resolve

_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
# nn.Module machinery that must not be mirrored from the real module into the template.
_MODULE_INTERNALS = frozenset(
    {
        "_parameters",
        "_buffers",
        "_non_persistent_buffers_set",
        "_modules",
        "_is_full_backward_hook",
        *_HOOK_DICTS,
        "forward",  # the engine replaces the real unit's forward; the template keeps its class's
        "gradient_checkpointing",  # forced off in templates, see module docstring
        "_gradient_checkpointing_func",
        "_hf_hook",
        "_old_forward",
        "__getstate__",  # the engine's pickling guard on real modules
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


def _is_shared_config(value: object) -> bool:
    """HF model configs: shared with the real module, never duplicated (duck-typed: no transformers import)."""
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


def _meta_copy(module: nn.Module) -> nn.Module:
    memo: dict[int, object] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    for m in module.modules():
        for name in (*_HOOK_DICTS, "forward", "__getstate__"):  # never copied: see module docstring
            value = vars(m).get(name)
            if value is not None:
                memo[id(value)] = OrderedDict() if name in _HOOK_DICTS else None
        for value in vars(m).values():
            if _is_shared_config(value):
                memo[id(value)] = value
    template = copy.deepcopy(module, memo)
    for m in template.modules():
        for name in ("forward", "__getstate__"):
            if vars(m).get(name, 0) is None:
                del m.__dict__[name]
        for name in _HOOK_DICTS:
            if name in vars(m):
                m.__dict__[name] = OrderedDict()
        m.__dict__["_is_full_backward_hook"] = None
        if "gradient_checkpointing" in vars(m) or hasattr(type(m), "gradient_checkpointing"):
            m.gradient_checkpointing = False
    return template


@dataclass
class _Slot:
    module: nn.Module  # the template submodule that owns the tensor
    attr: str  # its name there
    is_buffer: bool


@dataclass
class Mirror:
    """What binding copies from one real unit: (template submodule, real submodule, plain attribute
    names) per submodule, the root first; the attributes that hold code (callables, containers) are
    mirrored through :func:`unit_callables.resolve` (``checked``), the rest as they are."""

    pairs: list[tuple[nn.Module, nn.Module, tuple[str, ...]]]
    checked: list[tuple[str, ...]] = field(default_factory=list)
    """Per pair, the attributes mirrored through ``resolve`` (a sub-module's ``forward`` always is)."""
    refs: UnitRefs | None = None
    resolved: dict[tuple[int, str], tuple[object, object]] = field(default_factory=dict)
    """(pair index, attribute) -> (the real value, what the template gets), by identity of the real value."""
    root_forward: object = None
    """The real root's own instance ``forward`` at attach, rebound (the engine replaces the real one)."""
    names: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    """Per pair, how many attributes the real sub-module had when its names were sorted (a change: sorted again)."""
    ignored: list[frozenset] = field(default_factory=list)
    """Per pair, the attributes the engine itself set on the real sub-module after attach (never mirrored)."""

    def seal(self) -> None:
        """The engine has patched the real modules: what it added is its own, not the model's (ignored)."""
        for i, (_, real, keys) in enumerate(self.pairs):
            self.ignored[i] = frozenset(vars(real)) - set(keys) - set(self.checked[i]) - _MODULE_INTERNALS
            self.counts[i] = len(vars(real))

    def value(self, i: int, key: str, real: object) -> object:
        """What the template mirrors for ``real`` = the real sub-module ``i``'s ``key`` (resolved once per value)."""
        cached = self.resolved.get((i, key))
        if cached is not None and cached[0] is real:
            return cached[1]
        value = resolve(real, key, self.names[i], self.refs)
        self.resolved[(i, key)] = (real, value)
        return value


@dataclass
class HookRecord:
    """A training call's record of its sub-modules' forward hooks (see module docstring)."""

    modifying: set[tuple[int, int]] = field(default_factory=set)
    """The (pre-)hooks that changed a value or drew random numbers in the forward, by (submodule index,
    hook id): the ones the recompute runs again."""
    seen: list[torch.Tensor] = field(default_factory=list)
    """The floating-point tensors the forward hooks received as outputs during the current compute,
    each once, in order (the runner takes and clears it after each compute)."""

    def see(self, output) -> None:
        for t in _tensors_of(output):
            if t.is_floating_point() and not any(t is s for s in self.seen):
                self.seen.append(t)


def _tensors_of(value) -> list[torch.Tensor]:
    """The tensors of a module output: a tensor, or those of a tuple / list / dict (one level deep, as
    hooks index outputs)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _rng_states() -> list[torch.Tensor]:
    """The default generators' states (CPU, and the current CUDA device once CUDA is in use)."""
    states = [torch.default_generator.get_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _recording(hook, key: tuple[int, int], record: HookRecord, forward_hook: bool):
    def run(*args, **kwargs):
        if forward_hook:  # the output is the hook's last positional argument
            record.see(args[-1])
        before = _rng_states()
        result = hook(*args, **kwargs)
        # a hook that changed a value, or drew random numbers (the ops after it in the recompute, which
        # starts from the forward's RNG state, must draw what they drew in the forward), runs again there
        if result is not None or any(not torch.equal(a, b) for a, b in zip(before, _rng_states())):
            record.modifying.add(key)
        return result

    return run


def _seeing(hook, record: HookRecord):
    """A forward hook of the recompute: the output it receives is seen, then the hook runs if it
    changed a value in the forward (``hook`` is not None)."""

    def run(*args, **kwargs):
        record.see(args[-1])
        return hook(*args, **kwargs) if hook is not None else None

    return run


def _classify(mirror: Mirror, i: int) -> tuple[str, ...]:
    """Sort the real sub-module ``i``'s attributes into plain ones and those mirrored through ``resolve``
    (resolved now: refused here rather than at a step); returns the plain ones."""
    t_mod, r_mod, old = mirror.pairs[i]
    old = {*old, *mirror.checked[i]}
    r_vars = vars(r_mod)
    keys, checked = [], []
    for k, v in r_vars.items():
        if k in _MODULE_INTERNALS or k in mirror.ignored[i]:
            continue
        (checked if callable(v) or isinstance(v, (list, tuple, dict, set, frozenset, torch.Tensor))
         else keys).append(k)
    for k in checked:
        mirror.value(i, k, r_vars[k])
    if i and "forward" in r_vars:
        mirror.value(i, "forward", r_vars["forward"])
    for k in old - set(keys) - set(checked):
        t_mod.__dict__.pop(k, None)  # removed from the real module since: not mirrored any more
    mirror.pairs[i] = (t_mod, r_mod, tuple(keys))
    mirror.checked[i] = tuple(checked)
    mirror.counts[i] = len(r_vars)
    return tuple(keys)


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

    def mirror_of(self, real: nn.Module, streamed: frozenset[int] = frozenset(), name: str = "unit") -> Mirror:
        """Precomputed pairs to mirror at bind; every callable the real unit's modules carry is resolved
        now (``unit_callables.py``): rebound to the template, or refused with ``UnitCallableError``.

        ``streamed``: the ids of every parameter the engine streams (this unit's and the others');
        ``name``: the unit's name in the model, for messages.
        """
        named = list(real.named_modules())
        refs = UnitRefs({id(r): t for t, (_, r) in zip(self._template_modules, named)},
                        frozenset(streamed) | {id(p) for p in real.parameters()}, name)
        mirror = Mirror([], refs=refs, names=[f"{name}.{n}" if n else name for n, _ in named])
        for i, (t_mod, (_, r_mod)) in enumerate(zip(self._template_modules, named)):
            mirror.pairs.append((t_mod, r_mod, ()))
            mirror.checked.append(())
            mirror.counts.append(-1)
            mirror.ignored.append(frozenset())
            _classify(mirror, i)
        # before the engine replaces it: the unit's own instance forward
        self.adopt_root_forward(mirror, vars(real).get("forward"))
        return mirror

    @staticmethod
    def adopt_root_forward(mirror: Mirror, own) -> None:
        """``own``: the real unit's instance ``forward`` set after attach (None: its class's), rebound like one
        found at attach."""
        mirror.root_forward = None if own is None else resolve(own, "forward", mirror.names[0], mirror.refs)

    def bind(self, tensors: dict[str, torch.Tensor], mirror: Mirror, hooks: HookRecord | None = None,
             recompute: bool = False, without_hooks: bool = False) -> nn.Module:
        """Point every slot at ``tensors[name]`` and mirror the real unit's state; returns the module.

        ``hooks``: the call's record of modifying hooks (see module docstring); ``recompute``:
        binding for the backward's recompute (with grad); ``without_hooks``: the sub-modules get no
        hooks (a compiled call whose hooks are all inactive, ``runtime/compiled.py``).
        """
        for i, (t_mod, r_mod, keys) in enumerate(mirror.pairs):
            r_vars = r_mod.__dict__
            t_vars = t_mod.__dict__
            if len(r_vars) != mirror.counts[i]:  # attributes set or removed since attach (instance patching)
                keys = _classify(mirror, i)
            for k in keys:
                t_vars[k] = r_vars[k]
            for k in mirror.checked[i]:
                t_vars[k] = mirror.value(i, k, r_vars[k])
            if i:  # sub-modules: their hooks (the root's ran in the real unit's __call__), their own forward
                if without_hooks:
                    if any(t_vars.get(name) for name in _HOOK_DICTS):
                        for name in _HOOK_DICTS:
                            t_vars[name] = OrderedDict()
                else:
                    self._mirror_hooks(i, t_vars, r_vars, hooks, recompute)
                forward = r_vars.get("forward")
                if forward is not None:
                    t_vars["forward"] = mirror.value(i, "forward", forward)
                elif "forward" in t_vars:  # another unit sharing the template had one
                    del t_vars["forward"]
            elif mirror.root_forward is not None:
                t_vars["forward"] = mirror.root_forward
            elif "forward" in t_vars:
                del t_vars["forward"]
        for name, slot in self.slots.items():
            table = slot.module._buffers if slot.is_buffer else slot.module._parameters
            table[slot.attr] = tensors[name]
        return self.module

    @staticmethod
    def _mirror_hooks(i: int, t_vars: dict, r_vars: dict, record: HookRecord | None, recompute: bool) -> None:
        if not any(r_vars.get(name) for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                                                  "_backward_pre_hooks")):
            if any(t_vars.get(name) for name in _HOOK_DICTS):
                for name in _HOOK_DICTS:
                    t_vars[name] = OrderedDict()
            return
        for name in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            t_vars[name] = r_vars[name]
        for name in _FORWARD_HOOKS:
            real = r_vars[name]
            forward_hook = name == "_forward_hooks"
            if record is None:  # a call without a recompute (no grad): every hook, once
                t_vars[name] = real
            elif not recompute:
                t_vars[name] = OrderedDict(
                    (hid, _recording(h, (i, hid), record, forward_hook)) for hid, h in real.items()
                )
            elif forward_hook:  # every hook's output seen again, only the modifying ones run
                t_vars[name] = OrderedDict(
                    (hid, _seeing(h if (i, hid) in record.modifying else None, record)) for hid, h in real.items()
                )
            else:
                t_vars[name] = OrderedDict((hid, h) for hid, h in real.items() if (i, hid) in record.modifying)
        for name in ("_backward_pre_hooks", "_backward_hooks"):
            t_vars[name] = r_vars[name] if recompute else OrderedDict()
        t_vars["_is_full_backward_hook"] = r_vars.get("_is_full_backward_hook") if recompute else None

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

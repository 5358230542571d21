"""Patcher: every change megatrain makes to an object it does not own, with its undo.

Changes are instance-level only -- an attribute in the object's ``__dict__`` (a class stays
untouched), an item of a module's ``_buffers``, a hook handle -- and :meth:`Patcher.undo` reverts
them in reverse order, leaving alone an attribute somebody replaced since (e.g. TRL patching a
forward on top of ours).

A patched ``nn.Module`` also pickles clean: ``torch.save(model)`` and ``copy.deepcopy(model)``
see the module as it would be without megatrain (no engine, no replaced forward, no hooks of
ours, original buffers). The guard is an instance ``__getstate__`` (which pickle and deepcopy look
up on the instance before the class's), calling ``before_pickle`` first (the engine waits for its
background update there, so the copy holds finished weights).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

_MISSING = object()


@dataclass
class _ObjectPatches:
    attrs: dict[str, Any] = field(default_factory=dict)  # name -> value before the first patch (or _MISSING)
    items: list[tuple[str, Any, Any]] = field(default_factory=list)  # (dict attribute, key, value before the first)
    hooks: list[Any] = field(default_factory=list)  # RemovableHandle


class Patcher:
    def __init__(self, before_pickle: Callable[[], None] | None = None) -> None:
        self._undo: list[Callable[[], None]] = []
        self._patches: dict[int, tuple[weakref.ref, _ObjectPatches]] = {}
        self._before_pickle = before_pickle

    # ------------------------------------------------------------------ changes
    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """``obj.name = value`` as an instance attribute, until :meth:`undo`."""
        patches = self._of(obj)
        old = vars(obj).get(name, _MISSING)
        patches.attrs.setdefault(name, old)
        obj.__dict__[name] = value

        def undo() -> None:
            if obj.__dict__.get(name, _MISSING) is not value:
                return  # replaced since: leave the newer one
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = old

        self._undo.append(undo)

    def set_item(self, obj: nn.Module, table: str, key: str, value: Any) -> None:
        """``getattr(obj, table)[key] = value`` (e.g. a module's ``_buffers``), until :meth:`undo`."""
        mapping = getattr(obj, table)
        old = mapping[key]
        items = self._of(obj).items
        if not any(t == table and k == key for t, k, _ in items):  # a pickle holds the value before the first
            items.append((table, key, old))
        mapping[key] = value
        self._undo.append(lambda: mapping.__setitem__(key, old))

    def hook(self, obj: Any, handle: Any) -> None:
        """A hook ``handle`` registered on ``obj`` (removed at :meth:`undo`, left out when pickled)."""
        self._of(obj).hooks.append(handle)
        self._undo.append(handle.remove)

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at :meth:`undo` (changes that are not attributes, items or hooks)."""
        self._undo.append(fn)

    @contextlib.contextmanager
    def temporarily(self, obj: Any, name: str, value: Any):
        """``obj.name = value`` as an instance attribute for the duration of the ``with`` block."""
        old = vars(obj).get(name, _MISSING)
        obj.__dict__[name] = value
        try:
            yield
        finally:
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = old

    def undo(self) -> None:
        undo, self._undo = self._undo, []
        for fn in reversed(undo):
            fn()
        for ref, _ in self._patches.values():
            obj = ref()
            if obj is not None and getattr(obj.__dict__.get("__getstate__"), "_megatrain_guard", False):
                del obj.__dict__["__getstate__"]
        self._patches.clear()

    # ------------------------------------------------------------------ pickling guard
    def _of(self, obj: Any) -> _ObjectPatches:
        entry = self._patches.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        patches = _ObjectPatches()
        self._patches[id(obj)] = (weakref.ref(obj), patches)
        if isinstance(obj, nn.Module) and "__getstate__" not in vars(obj):
            obj.__dict__["__getstate__"] = self._guard(obj, patches)
        return patches

    def _guard(self, obj: nn.Module, patches: _ObjectPatches) -> Callable[[], dict]:
        ref = weakref.ref(obj)
        before = self._before_pickle

        def __getstate__() -> dict:
            module = ref()
            if before is not None:
                before()
            state = type(module).__getstate__(module)
            state.pop("__getstate__", None)
            for name, old in patches.attrs.items():
                if old is _MISSING:
                    state.pop(name, None)
                else:
                    state[name] = old
            for table, key, old in patches.items:
                state[table] = type(state[table])(state[table])
                state[table][key] = old
            live = vars(module)
            for handle in patches.hooks:
                refs = (handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ()))
                dicts = [d for d in (r() for r in refs) if d is not None]
                for name, value in live.items():
                    if isinstance(value, dict) and any(value is d for d in dicts) and name in state:
                        state[name] = type(value)((k, v) for k, v in state[name].items() if k != handle.id)
            return state

        __getstate__._megatrain_guard = True
        return __getstate__

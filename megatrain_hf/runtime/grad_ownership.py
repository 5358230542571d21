"""Which incoming gradients of a streamed backward megatrain owns alone (and may write into).

A streamed unit's backward receives the gradient of its output (``grad_out``), which autograd's
engine hands over from the node that consumed the output: usually the next unit's streamed backward,
whose return value (the gradient of its input) megatrain computed. A tiled decoder layer can then
write its input's gradient into ``grad_out``, tile by tile after reading it (``runtime/tiling.py``,
``ResidualGrad.into``), instead of into the storage of its recomputed output, which it frees at once:
one full-length fp32 ``tokens x hidden`` less at the attention kernel's backward (issue 34).

Writing into a tensor someone else reads corrupts it, so ``grad_out`` is written into only when it is
proven to be megatrain's alone (:meth:`GradOwnership.owns`); anything unproven keeps the earlier path
(the output's storage), which is exact whoever holds the gradient:

* it is the very tensor (same object) another streamed backward of this pass returned and handed
  over (:meth:`GradOwnership.hand`), with no other contribution: autograd summing a second path's
  gradient into the output's gradient, a hook returning another tensor, a dtype or device cast, all
  give another object. A returned gradient is handed over only if it shares no storage with a
  gradient megatrain did not own (its own ``grad_out`` when that was not owned, a seen output's);
* no tensor hook was registered on the unit's output: :func:`watch_output` gives the output an
  empty hook table at once (``Tensor.register_hook`` adds to the existing one), read in the
  backward whether or not the output is still alive; a live output that retains its gradient is
  refused too (``retain_grad`` copies today, not promised);
* no module hook could see it: no backward hook of any origin on any module of the model (units,
  their sub-modules and containers; torch's global ones) -- a full backward hook gets the gradient
  itself -- and no forward hook but megatrain's and transformers' output capture on the units (a
  forward hook may register tensor hooks on what it sees; ``core/hooks.hooked_modules``). Read once
  per backward pass;
* no other tensor shares its storage (a stored ``detach()`` or view, a weight's gradient still
  being copied out), and it is contiguous and no view itself.

Not seen: a hook put on the autograd node itself (``out.grad_fn.register_prehook``), which torch gives
no way to list. Megatrain's own ``grad_out`` of zeros (the output reached no loss) is always owned.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, Iterable

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ..core.hooks import hooked_modules

_BACKWARD_HOOKS = ("_backward_hooks", "_backward_pre_hooks")


def watch_output(out: torch.Tensor) -> None:
    """Give a streamed call's output (its ``grad_fn`` is the call's node) an empty tensor-hook table the
    node keeps, so the backward can tell whether anyone registered a hook on it (module docstring)."""
    node = out.grad_fn
    if node is None or out._backward_hooks is not None:
        return
    table: OrderedDict = OrderedDict()
    out._backward_hooks = table
    node._register_hook_dict(out)  # what Tensor.register_hook does on its first hook
    node.tensor_hooks = table
    node.output_ref = weakref.ref(out)


def _sole_storage_holder(t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) == 2  # ``t``'s and ``storage``'s references


def _shares_storage(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return (isinstance(b, torch.Tensor) and a.untyped_storage().nbytes() > 0
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def backward_hooks_anywhere(modules: Iterable[nn.Module]) -> bool:
    """Whether any of ``modules`` (and their sub-modules) or torch's globals has a backward hook."""
    if any(getattr(torch_module, f"_global{attr}") for attr in _BACKWARD_HOOKS):
        return True
    return any(m.__dict__.get(attr) for root in modules for m in root.modules() for attr in _BACKWARD_HOOKS)


class GradOwnership:
    """The gradients streamed backwards handed over in the current backward pass (module docstring)."""

    def __init__(self, units: list, roots: Callable[[], list[nn.Module]] | None = None) -> None:
        self.units = units  # the runner's units (``.name``, ``.module``)
        self.roots = roots  # the model's modules beyond the units (containers), set by the engine
        self.enabled = True  # False: never owned (tests compare the two paths)
        self._handed: list[torch.Tensor] = []
        self._hooks_free: bool | None = None  # read at the pass's first streamed backward

    def clear(self) -> None:
        """A backward pass starts or ends: nothing handed over, the hooks read again."""
        self._handed.clear()
        self._hooks_free = None

    def _no_hooks(self) -> bool:
        if self._hooks_free is None:
            modules = [u.module for u in self.units] + (list(self.roots()) if self.roots is not None else [])
            self._hooks_free = (not backward_hooks_anywhere(modules)
                                and not hooked_modules([(u.name, u.module) for u in self.units]))
        return self._hooks_free

    def owns(self, node, grad_out: torch.Tensor) -> bool:
        """Whether ``grad_out``, the gradient ``node`` (a streamed call's autograd node) received for its
        output, is megatrain's alone; taken off the handed list either way."""
        handed = next((i for i, t in enumerate(self._handed) if t is grad_out), None)
        if handed is None:
            return False
        del self._handed[handed]
        if not self.enabled or getattr(node, "tensor_hooks", None) is None or node.tensor_hooks:
            return False
        out = node.output_ref()
        if out is not None and out.retains_grad:
            return False
        if grad_out._base is not None or not grad_out.is_contiguous() or not _sole_storage_holder(grad_out):
            return False
        return self._no_hooks()

    def hand(self, grad_x: torch.Tensor | None, grad_out: torch.Tensor | None, owned: bool,
             grad_seen: tuple = ()) -> None:
        """A streamed backward returns ``grad_x``: megatrain's to hand over unless it shares storage with a
        gradient megatrain did not own (``grad_out`` unless ``owned``, the seen outputs' gradients)."""
        if not self.enabled or not isinstance(grad_x, torch.Tensor) or not grad_x.is_floating_point():
            return
        if not owned and _shares_storage(grad_x, grad_out):
            return
        if any(_shares_storage(grad_x, g) for g in grad_seen):
            return
        self._handed.append(grad_x)

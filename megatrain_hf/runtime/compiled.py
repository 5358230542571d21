"""Regional compilation: ``torch.compile`` of the layer templates, shared by every layer.

With ``MegaTrainConfig(compile=True)`` (``TrainingArguments(torch_compile=True)`` under Trainer) the
``forward`` of every template that two or more units share -- the decoder layers -- runs compiled,
as accelerate's ``compile_regions`` and torchtitan's per-block ``torch.compile`` do. A template is one
module whose parameter *slots* are rebound to each layer's streamed tensors (``core/template.py``);
dynamo treats a module's parameters as graph inputs, so the graph compiled for the first layer is
reused by all of them: one compile per (shape, grad mode, autocast state), for the no-grad forward
and for the backward's recompute (with grad: AOTAutograd's joint graph, whose backward
``autograd.grad`` then runs).

A call runs eagerly instead (exactly as without compile) where compiling could change what it
does:

* its unit has a structure of its own (embedding, final norm, head: small, run once per step), an
  instance ``forward`` of its own or on a sub-module (a client's kernel), or an embedding table
  (its gradient is computed in place, ``runtime/grads_in_place.py``);
* its MLP runs over sequence tiles (``runtime/tiling.py``);
* a sub-module carries a forward or backward hook other than transformers' output-capturing hook
  while that hook is inactive (no ``output_hidden_states``/``output_attentions``/router logits being
  collected): an active hook records what it receives (``HookRecord``) per call.

The decision is taken once per call (``Call.compiled``): its recompute runs the same way as its
forward. Inactive output-capturing hooks are left out of a compiled call: they return at once
without touching anything.

Counted (cumulative since attach; ``megatrain/compile_*`` metrics): graphs compiled, graph breaks
(``torch._dynamo.utils.counters["graph_break"]``), recompiles (graphs compiled by a call after the
first of its template and grad mode: a guard failed, e.g. a new shape) and calls run eagerly.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _inactive_capture_hook(hook: Callable) -> bool:
    """transformers' output-capturing hook while it collects nothing: no collector, or one without the hook's
    key (``output_hidden_states``/``output_attentions``/router logits not asked for); it returns at once.

    Recognised by its name, the module global it reads (``transformers.utils.output_capturing``) and its
    closure's ``key``, without importing transformers."""
    if getattr(hook, "__name__", None) != "output_capturing_hook":
        return False
    collector = getattr(hook, "__globals__", {}).get("_active_collector")
    get = getattr(collector, "get", None)
    if get is None:
        return False
    collected = get()
    if collected is None:
        return True
    cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ()))
    key = cells.get("key")
    try:
        return key is not None and key.cell_contents not in collected
    except (ValueError, TypeError):  # an empty cell, a collector that is not a mapping
        return False


def hooks_inactive(mirror) -> bool:
    """Whether every hook of the real unit's sub-modules is an inactive output-capturing hook."""
    for _, real, _ in mirror.pairs[1:]:
        r_vars = real.__dict__
        for name in _HOOK_DICTS:
            hooks = r_vars.get(name)
            if hooks and not all(_inactive_capture_hook(h) for h in hooks.values()):
                return False
    return True


class RegionCompiler:
    """The compiled ``forward`` of each shared template and what compiling cost (see module docstring)."""

    def __init__(self, backend: str = "inductor", mode: str | None = None) -> None:
        self.backend = backend
        self.mode = mode
        self.graphs = 0  # graphs the backend compiled for the templates
        self.graph_breaks = 0
        self.recompiles = 0
        self.compiled_calls = 0
        self.eager_calls = 0  # calls of eligible units that ran eagerly (tiles, active hooks)
        self._forwards: dict[Callable, Callable] = {}
        self._called: set[tuple] = set()
        self._eligible: dict[int, bool] = {}

    def set_units(self, units: list) -> None:
        """Decide which units may run compiled (their structure: see module docstring)."""
        shared: dict[int, int] = {}
        for unit in units:
            shared[id(unit.template)] = shared.get(id(unit.template), 0) + 1
        for unit in units:
            own_forward = unit.mirror.root_forward is not None or any(
                "forward" in vars(real) for _, real, _ in unit.mirror.pairs[1:])
            self._eligible[unit.index] = (shared[id(unit.template)] > 1 and not unit.embeddings and not own_forward)
        logger.info("megatrain: compiling %d of %d units' templates (backend %s, mode %s)",
                    sum(self._eligible.values()), len(units), self.backend, self.mode)

    @classmethod
    def for_units(cls, backend: str, mode: str | None, units) -> "RegionCompiler":
        """The compiler of ``compile=True`` for the engine's ``units`` (which of them run compiled)."""
        compiler = cls(backend, mode)
        compiler.set_units(units)
        return compiler

    def applies(self, unit, kernel: Any, tile: int | None) -> bool:
        """Whether this call of ``unit`` runs compiled (decided once, at its forward)."""
        if not self._eligible.get(unit.index, False) or kernel is not None:
            return False
        if tile is not None or not hooks_inactive(unit.mirror):
            self.eager_calls += 1
            return False
        return True

    def forward_of(self, module: nn.Module) -> Callable:
        """The compiled ``forward`` of ``module``'s class (one per class: dynamo keys on the code)."""
        fn = type(module).forward
        compiled = self._forwards.get(fn)
        if compiled is None:
            compiled = torch.compile(fn, backend=self.backend, mode=self.mode)
            self._forwards[fn] = compiled
        return compiled

    def run(self, module: nn.Module, x: torch.Tensor, args: tuple, kwargs: dict, input_key: str | None):
        """``module.forward`` on the call's arguments, compiled; what it compiled is counted."""
        from torch._dynamo.utils import counters

        forward = self.forward_of(module)
        graphs = counters["stats"]["unique_graphs"]
        breaks = sum(counters["graph_break"].values())
        if input_key is None:
            out = forward(module, x, *args, **kwargs)
        else:
            out = forward(module, *args, **{input_key: x}, **kwargs)
        new = counters["stats"]["unique_graphs"] - graphs
        self.graphs += new
        self.graph_breaks += sum(counters["graph_break"].values()) - breaks
        key = (id(module), torch.is_grad_enabled())
        if key in self._called:
            self.recompiles += new
        self._called.add(key)
        self.compiled_calls += 1
        return out

    def metrics(self) -> dict[str, float]:
        return {"megatrain/compile_graphs": float(self.graphs),
                "megatrain/compile_graph_breaks": float(self.graph_breaks),
                "megatrain/compile_recompiles": float(self.recompiles),
                "megatrain/compile_eager_calls": float(self.eager_calls)}

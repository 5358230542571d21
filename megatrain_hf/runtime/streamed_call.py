"""The streamed call of one unit: forward without a graph, backward by recompute.

A unit's new ``forward`` runs :class:`StreamedUnit`, an ``autograd.Function`` whose forward
fetches the unit's weights, computes its template under ``no_grad`` and saves only its input (the
activation checkpoint); its backward fetches the weights again, restores the forward's CPU/CUDA
RNG state (dropout draws the same mask) and autocast state, recomputes with grad and calls
``torch.autograd.grad(out, [input, *weights], grad_out)``. The input's gradient goes back to
autograd; the weights' gradients go to the gradient sink. A requires-grad scalar, the *anchor*,
is an input of every streamed call, so backward reaches units whose input carries no grad (the
embedding, frozen embeddings under PEFT). Calls without grad (evaluation, ``generate()``) fetch
and compute, keep nothing. Training calls never write a KV cache.

Tensors the unit computed and its sub-modules' forward hooks received (``HookRecord.seen``: HF's
captured router logits, which the MoE auxiliary loss differentiates) are further outputs of the
autograd node: a hook keeps exactly the tensor the node returns, so what it kept is part of the
graph; the backward differentiates the recomputed ones, at the same positions, with the gradients
they received, together with the unit's output. Inputs, weights and buffers of the unit are never
such outputs.

Trainability is read at every call: a parameter whose ``requires_grad`` was turned off since
attach (progressive freezing) gets no gradient, as in plain training; one frozen at attach cannot
be unfrozen (it has no fp32 master) and is refused.

Every pass that reaches a streamed backward has one callback queued on autograd's engine (keyed by
its graph task): when the pass ends it waits for the gradient sink, so ``loss.backward()`` returns
with every ``param.grad`` complete.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..errors import StreamedCallError, UsageError
from ..core.grads import GradSink
from ..core.layout import Entry
from ..core.store import unfrozen_error
from ..core.streamer import Streamer
from ..core.template import HookRecord, Mirror, Template
from .autocast import autocast_state
from .activation_inputs import ActivationInputs, DeviceHome, HostHome
from .grad_ownership import GradOwnership, watch_output
from .grads_in_place import embedding_weights, embeddings_into, landing_regions
from .tiling import mlp_width, tileable_mlp, tiled, tiled_layer

logger = logging.getLogger(__name__)


@dataclass
class Unit:
    index: int
    name: str
    module: nn.Module
    template: Template
    mirror: Mirror
    trainable: list[Entry]  # every trainable tensor the unit computes with (a tied one included)
    frozen: list[Entry]
    embeddings: frozenset[str] = frozenset()  # names of its nn.Embedding weights (runtime/grads_in_place.py)

    def __post_init__(self) -> None:
        self.embeddings = embedding_weights(self.module)


@dataclass
class Call:
    """Everything a streamed call needs besides its differentiable input."""

    unit: int
    args: tuple  # positional arguments after the input
    kwargs: dict
    input_key: str | None  # None: the input was the first positional argument
    kernel: Any = None  # computes the unit instead of its template (the chunked head + loss)
    autocast: tuple | None = None  # (enabled, dtype, cache_enabled) on the compute device type
    cpu_rng: torch.Tensor | None = None
    dev_rng: torch.Tensor | None = None
    hooks: HookRecord = field(default_factory=HookRecord)
    seen_at: list[int] = field(default_factory=list)  # positions in HookRecord.seen that are node outputs
    seen_shapes: list[tuple] = field(default_factory=list)  # (number seen, shapes of those outputs)
    parent: Any = None  # checkpoint_interval > 1: the node whose output is this call's input (not kept)
    compiled: bool | None = None  # runs the compiled template (runtime/compiled.py); None: not decided yet


class StreamedUnit(torch.autograd.Function):
    """One unit call: output and a zero scalar *token* (layer-major ordering, see ``layer_major.py``)."""

    @staticmethod
    def forward(ctx, runner: "UnitRunner", call: Call, anchor: torch.Tensor, x: torch.Tensor):
        ctx.runner, ctx.call = runner, call
        ctx.set_materialize_grads(False)  # seen outputs nobody differentiates get no zeros
        ctx.parent, ctx.recomputed, call.parent = call.parent, None, None  # checkpoint_interval > 1
        ctx.ckpt = None
        if ctx.parent is None:
            runner.inputs.keep(ctx, x)  # the activation checkpoint of this unit (runtime/activation_inputs.py)
        tensors = runner.streamer.fetch(call.unit)
        out = runner.compute(call, x, tensors)
        seen = call.hooks.seen
        call.hooks.seen = []
        call.seen_at = _computed_positions(seen, (x, out, *tensors.values()), (call.args, call.kwargs))
        call.seen_shapes = [len(seen), *[tuple(seen[i].shape) for i in call.seen_at]]
        ctx.out_like = (out.shape, out.dtype, out.device)
        runner.streamer.prefetch(call.unit + 1)  # after the compute is queued: never delays it
        return (out, anchor.new_zeros(()), *[seen[i] for i in call.seen_at])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor | None, grad_token: torch.Tensor | None, *grad_seen):
        runner = ctx.runner
        group = runner.group
        if group is not None and not group.backward_open:
            raise UsageError(
                "megatrain: a backward pass started inside one micro-batch of a layer-major accumulation "
                "group, before the other micro-batches ran their forward. Inside Trainer.training_step call "
                "self.accelerator.backward(loss) (Trainer's own code does), in your own loop use "
                "engine.backward(loss); or turn the schedule off with MegaTrainConfig(layer_major=False)."
            )
        runner.at_backward_end()
        try:
            x = runner.inputs.input_of(ctx)
            if grad_out is None:  # the output reached no loss: zero gradients, as autograd materializes
                shape, dtype, device = ctx.out_like
                grad_out = torch.zeros(shape, dtype=dtype, device=device)
                owned = True
            else:  # megatrain's alone? Then a tiled layer writes its input's gradient into it
                owned = runner.ownership.owns(ctx, grad_out)
            grad_x = runner.recompute_backward(ctx.call, x, grad_out, grad_seen, owned)
            runner.ownership.hand(grad_x, grad_out, owned, grad_seen)
        except BaseException:
            runner.backward_failed()
            raise
        return None, None, None, grad_x


class UnitRunner:
    """Runs streamed calls of an engine's units (see module docstring).

    What a unit's call looks like is the model family's business, handed in: ``input_kwargs``, the
    keyword names under which a unit may receive its main input, and ``prepare_graph_call(unit name,
    module, args, kwargs) -> (args, kwargs)``, which checks and adapts a training call's other
    arguments (e.g. drops a KV cache).
    """

    def __init__(self, units: list[Unit], streamer: Streamer, grads: GradSink, stats, budget,
                 device: torch.device, compute_dtype: torch.dtype, input_kwargs: tuple[str, ...],
                 prepare_graph_call: Callable[[str, nn.Module, tuple, dict], tuple[tuple, dict]]) -> None:
        self.units = units
        self.input_kwargs = input_kwargs
        self.prepare_graph_call = prepare_graph_call
        self.streamer = streamer
        self.grads = grads
        self.stats = stats
        self.budget = budget
        self.device = device
        self.compute_dtype = compute_dtype
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self.group = None  # the layer-major Group in progress (runtime/layer_major.py)
        self.inputs = ActivationInputs(self)  # where each node's input comes from in its backward
        self._end_queued = None  # graph-task id of the pass whose end callback is queued
        # (tokens, hidden, intermediate width) -> tokens per MLP tile or None; set by the engine (None: never tiled)
        self.tile_policy: Callable[[int, int, int], int | None] | None = None
        # the family's layer recipe (models/layer_recipes.py): decoder layers tile whole; None: the MLP alone
        self.layer_recipe: Any = None
        self._declined: set[str] = set()  # reasons a layer ran without its recipe, logged once each
        self.on_sequence: Callable[[int], None] | None = None  # a training sequence's length (the engine's checks)
        self.compiler = None  # RegionCompiler (runtime/compiled.py) with compile=True; set by the engine
        # the incoming gradients megatrain owns alone (runtime/grad_ownership.py); the engine adds the model's roots
        self.ownership = GradOwnership(units)

    @property
    def offload(self):
        """The pinned pool of host-kept checkpoints (``CheckpointOffload``), or None (kept on the device)."""
        return self.inputs.offload

    @offload.setter
    def offload(self, pool) -> None:
        self.inputs.home = HostHome(pool) if pool is not None else DeviceHome(self.inputs.home.dtype)

    @property
    def checkpoint_interval(self) -> int:
        return self.inputs.interval

    @checkpoint_interval.setter
    def checkpoint_interval(self, k: int) -> None:
        self.inputs.interval = k

    # ------------------------------------------------------------------ calls
    def call(self, u: int, args: tuple, kwargs: dict, kernel: Any = None) -> torch.Tensor:
        unit = self.units[u]
        if args:
            x, rest, key = args[0], args[1:], None
        else:
            key = next((k for k in self.input_kwargs if k in kwargs), None)
            if key is None:
                raise StreamedCallError(f"streamed unit {unit.name} got no input tensor (kwargs: {sorted(kwargs)})")
            kwargs = dict(kwargs)
            x, rest = kwargs.pop(key), ()
        if not isinstance(x, torch.Tensor):
            raise StreamedCallError(f"streamed unit {unit.name} expects a tensor input, got {type(x).__name__}")
        grad_enabled = torch.is_grad_enabled()
        training = unit.module.training
        if grad_enabled:
            _check_unfrozen(unit)
        needs_graph = grad_enabled and (
            any(e.tensor.requires_grad for e in unit.trainable) or (x.is_floating_point() and x.requires_grad)
        )
        call = Call(u, rest, kwargs, key, kernel)
        if u == 0:
            if training and grad_enabled and not x.is_floating_point():
                seq = x.shape[-1] if x.dim() else 1
                self.stats.count_tokens(x.numel(), seq)
                self.budget.note_call(0, x.numel())
                if self.on_sequence is not None:
                    self.on_sequence(seq)
            self.inputs.start_chain()  # a micro-batch's forward starts a new chain
        if not needs_graph:
            out = self.compute(call, x, self.streamer.fetch(u), hooks=False)
            self.streamer.prefetch(u + 1)
            return out
        call.args, call.kwargs = self.prepare_graph_call(unit.name, unit.module, rest, kwargs)
        dev_type = self.device.type
        call.autocast = autocast_state(dev_type)
        if training:  # dropout may draw random numbers: replay them in backward
            call.cpu_rng = torch.get_rng_state()
            if dev_type == "cuda":
                call.dev_rng = torch.cuda.get_rng_state(self.device)
        group = self.group
        anchor = group.anchor_for_call(self.anchor) if group is not None else self.anchor
        position = self.inputs.position(call, x)
        out, token, *_ = StreamedUnit.apply(self, call, anchor, x)  # the seen outputs: kept by their hooks
        watch_output(out)  # before anyone else sees it: tensor hooks registered on it are seen in the backward
        self.inputs.produced(out, position)
        if self.offload is None and position == 0:
            self.budget.note_call(x.numel() * x.element_size(), 0)  # the checkpoint this call keeps
        if group is not None and group.record(token):
            self.grads.count_call(u)
        return out

    def _autocast(self, state: tuple | None):
        dev_type = self.device.type
        stack = contextlib.ExitStack()
        if state is not None:
            enabled, dtype, cache = state
            stack.enter_context(torch.autocast(dev_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
        if self.compute_dtype != torch.float32 and not torch.is_autocast_enabled(dev_type):
            # Low-precision weights next to fp32 vectors need autocast to mix in matmuls.
            stack.enter_context(torch.autocast(dev_type, dtype=self.compute_dtype))
        return stack

    def compute(self, call: Call, x: torch.Tensor, tensors: dict[str, torch.Tensor], hooks: bool = True,
                recompute: bool = False, grad_into: torch.Tensor | None = None) -> torch.Tensor:
        """The unit's output on ``x`` with ``tensors`` as its weights. ``grad_into``: in a recompute, the
        gradient the output will receive when megatrain owns it alone (``runtime/grad_ownership.py``): a
        tiled layer writes its input's gradient into it and frees its output's storage."""
        unit = self.units[call.unit]
        if call.kernel is not None:
            with self._autocast(None):
                out = call.kernel.forward(x, tensors)
            self.stats.forward_units += 1
            return out
        call.hooks.seen = []
        tile = self._tile_for(unit.module, x)  # the real unit: its own hooks and structure
        if call.compiled is None:  # decided at the forward; the recompute runs the same way
            # (training calls only: a call without a graph may carry a KV cache, per-layer state)
            call.compiled = hooks and self.compiler is not None and self.compiler.applies(unit, call.kernel, tile)
        module = unit.template.bind(tensors, unit.mirror, call.hooks if hooks else None, recompute,
                                    without_hooks=call.compiled)
        try:
            recipe = self._recipe_for(unit.name, module, call) if tile else None  # (tiled: never compiled)
            with self._autocast(None), tiled(module, tile if recipe is None else None) as tiling:
                self.stats.tiled_calls += tiling or recipe is not None
                # forward, not __call__: the real unit's __call__ already ran its own hooks
                if recipe is not None:
                    self.stats.tiled_layer_calls += 1
                    if recompute and grad_into is None and torch.is_grad_enabled():
                        self._unowned_gradient(unit.name)
                    out = tiled_layer(recipe, module, x, call.kwargs, tile, grad_into)
                elif call.compiled:
                    out = self.compiler.run(module, x, call.args, call.kwargs, call.input_key)
                elif call.input_key is None:
                    out = module.forward(x, *call.args, **call.kwargs)
                else:
                    out = module.forward(*call.args, **{call.input_key: x}, **call.kwargs)
        finally:
            unit.template.unbind()
        if not isinstance(out, torch.Tensor):
            raise StreamedCallError(
                f"streamed unit {unit.name} returned {type(out).__name__}; megatrain expects a tensor "
                "(transformers >= 5 decoder layers return one)."
            )
        self.stats.forward_units += 1
        return out

    def _tile_for(self, module: nn.Module, x: torch.Tensor) -> int | None:
        """Tokens per MLP tile for a call of ``module`` on ``x`` (None: untiled), by the tile policy."""
        if self.tile_policy is None or x.dim() < 2 or not x.is_floating_point():
            return None
        mlp = tileable_mlp(module)
        if mlp is None:
            return None
        return self.tile_policy(x.numel() // x.shape[-1], x.shape[-1], mlp_width(mlp))

    def _unowned_gradient(self, name: str) -> None:
        why = "incoming gradient not megatrain's alone"
        if why not in self._declined:
            self._declined.add(why)
            logger.info("megatrain: %s's incoming gradient may be held by someone else (a tensor hook on a layer's "
                        "output, retain_grad, a module backward hook; runtime/grad_ownership.py): the tiled layer "
                        "keeps its recomputed output for its input's gradient, one tokens x hidden tensor more "
                        "than the plan's working set (logged once)", name)

    def _recipe_for(self, name: str, module: nn.Module, call: Call):
        """The layer recipe that tiles ``module``'s call whole, or None (its MLP tiles alone; why: logged once)."""
        recipe = self.layer_recipe
        if recipe is None or call.input_key not in (None, "hidden_states"):
            return None
        why = recipe.why_not(module, call.args, call.kwargs)
        if why is not None and why not in self._declined:
            self._declined.add(why)
            logger.info("megatrain: %s runs with only its MLP sequence-tiled: %s", name, why)
        return recipe if why is None else None

    def recompute_backward(self, call: Call, x: torch.Tensor, grad_out: torch.Tensor,
                           grad_seen: tuple = (), owned: bool = False) -> torch.Tensor | None:
        """The unit's backward: recompute with grad, ``autograd.grad`` from its output (and seen outputs);
        the weights' gradients to the sink, the input's returned. ``owned``: ``grad_out`` is megatrain's
        alone, a tiled layer may write into it (otherwise nobody writes into it: a hook may hold it)."""
        unit = self.units[call.unit]
        with self.inputs.replayed_rng(call):
            tensors = self.streamer.fetch(call.unit)
            trained = [e for e in unit.trainable if e.tensor.requires_grad]
            leaves = []
            for e in trained:
                leaf = tensors[e.name].detach().requires_grad_(True)
                tensors[e.name] = leaf
                leaves.append(leaf)
            x_grad = x.is_floating_point() and x.requires_grad
            into = landing_regions(self.grads, call.unit, trained)  # the CPU path: computed in the accumulators
            if call.kernel is not None:  # the kernel recomputes chunk by chunk itself
                if call.unit > 0:
                    self.streamer.prefetch(call.unit - 1)
                landing = {"into": into} if into and getattr(call.kernel, "lands_in_place", False) else {}
                with self._autocast(call.autocast):
                    grad_x, sums = call.kernel.backward(x, tensors, [e.name for e in trained], grad_out, **landing)
                grads = (grad_x, *[sums.get(e.name) for e in trained])
                x_grad = True
            else:
                x_in = x.detach().requires_grad_(x_grad)
                into = {name: r for name, r in into.items() if name in unit.embeddings}
                with torch.enable_grad(), self._autocast(call.autocast), embeddings_into(tensors, into):
                    out = self.compute(call, x_in, tensors, recompute=True, grad_into=grad_out if owned else None)
                outputs, seeds = [out], [grad_out]
                if call.seen_at:
                    outputs, seeds = _with_seen(unit.name, call, outputs, seeds, grad_seen)
                if call.unit > 0:
                    self.streamer.prefetch(call.unit - 1)  # backward order; overlaps this unit's backward
                self.stats.forward_units -= 1  # a recompute is not a forward
                inputs = ([x_in] if x_grad else []) + leaves
                grads = torch.autograd.grad(outputs, inputs, seeds, allow_unused=True)
        grad_x = grads[0] if x_grad else None
        if leaves:
            self.grads.submit(call.unit, trained, list(grads[1 if x_grad else 0 :]))
        self.stats.backward_units += 1
        return grad_x

    def forward_again(self, call: Call, x: torch.Tensor) -> torch.Tensor:
        """A call's forward once more (no graph), with its RNG and autocast state: its output again."""
        with self.inputs.replayed_rng(call):
            with torch.no_grad(), self._autocast(call.autocast):
                # as a recompute: only the hooks that changed a value in the forward run again (others
                # would record twice, e.g. captured router logits)
                out = self.compute(call, x.detach(), self.streamer.fetch(call.unit), recompute=True)
        self.stats.forward_units -= 1  # a recompute is not a forward
        return out.requires_grad_(True) if out.is_floating_point() else out  # it came out of a streamed node

    # ------------------------------------------------------------------ end of a backward pass
    def at_backward_end(self) -> None:
        """Once per backward pass: have autograd wait for the gradient sink when the pass ends.

        Keyed by autograd's graph-task id: a pass that failed in a node that is not the engine's
        (autograd then drops the queued callback) is cleaned up when the next pass starts.
        """
        task = torch._C._current_graph_task_id()
        if self._end_queued == task:
            return
        if self._end_queued is not None:  # a previous pass never reached its end
            self.backward_failed()
        self._end_queued = task
        self.ownership.clear()
        torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)

    def backward_failed(self) -> None:
        """autograd drops queued callbacks when a backward fails: undo what the pass had started."""
        self._end_queued = None
        self.inputs.clear()
        self.ownership.clear()
        self.streamer.drop_prefetched()
        self.grads.drop_held()
        try:
            self.grads.wait()  # no transfer of the failed pass may land in the next step's gradients
        except RuntimeError:
            logger.exception("gradient accumulation also failed while unwinding a failed backward")

    def backward_done(self) -> None:
        self._end_queued = None
        self.inputs.clear()  # no forward continues a chain across a backward
        self.ownership.clear()
        self.streamer.drop_prefetched()
        started = time.perf_counter()
        self.grads.wait()  # when backward() returns, every param.grad is complete
        self.stats.grad_wait_s += time.perf_counter() - started

    @property
    def backward_pending(self) -> bool:
        """Whether a backward pass's end callback is queued (tests read it after a failure)."""
        return self._end_queued is not None


def _check_unfrozen(unit: Unit) -> None:
    for e in unit.frozen:
        if e.tensor.requires_grad:
            raise unfrozen_error(unit.name, e.name)



def _computed_positions(seen: list[torch.Tensor], own: tuple, side: tuple) -> list[int]:
    """Positions of the tensors in ``seen`` that the unit computed: not its input or output (already
    the node's), weights or buffers (``own``), nor a side argument, nor a view of any of these."""
    external = {id(t) for t in own}
    for value in side:
        items = value.values() if isinstance(value, dict) else value
        for item in items:
            for t in (item if isinstance(item, (tuple, list)) else (item,)):
                if isinstance(t, torch.Tensor):
                    external.add(id(t))
    return [i for i, t in enumerate(seen)
            if id(t) not in external and (t._base is None or id(t._base) not in external)]


def _with_seen(unit_name: str, call: Call, outputs: list, seeds: list, grad_seen: tuple) -> tuple[list, list]:
    """The recompute's seen tensors that received a gradient, added to what ``autograd.grad`` runs from."""
    seen = call.hooks.seen
    call.hooks.seen = []
    got = [len(seen), *[tuple(seen[i].shape) for i in call.seen_at if i < len(seen)]]
    if got != call.seen_shapes:
        raise UsageError(
            f"megatrain: the recompute of streamed unit {unit_name} passed other tensors to its sub-modules' "
            f"forward hooks than its forward did (count, shapes: {got} vs {call.seen_shapes}): the unit's "
            "forward is not deterministic, and the gradients of what the hooks kept cannot be matched."
        )
    for i, grad in zip(call.seen_at, grad_seen):
        t = seen[i]
        if grad is not None and t.requires_grad:
            outputs.append(t)
            seeds.append(grad)
    return outputs, seeds

"""The engine: streamed autograd through stateless templates.

``attach(model)`` turns every unit of a causal LM (embedding, decoder layers, final norm, head)
into a streamed unit and returns an :class:`Engine` handle whose ``detach()`` undoes it. The
model keeps its own ``forward``: HF computes rotary tables, masks per layer type, scaling and the
loss exactly as usual; only the units' ``forward`` is replaced (an instance attribute, so the
class is untouched). A streamed unit

* forward (training): fetches its weights, runs the template under ``no_grad`` and keeps only its
  input (the activation checkpoint), inside an ``autograd.Function``;
* backward: fetches the weights again, restores the RNG state of the forward (dropout) and its
  autocast state, recomputes with grad, returns the input's gradient and adds the weights'
  gradients into the fp32 host accumulators (``param.grad`` views them);
* forward (eval / generate / ``no_grad``): fetch + template, nothing kept.

A requires-grad scalar (the *anchor*) is an input of every streamed call so that backward reaches
units whose input carries no grad (frozen embeddings under PEFT, the embedding itself).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.optim.optimizer import register_optimizer_step_post_hook

from .adapters import Units, locate_units, unwrap
from .config import MegaTrainConfig
from . import layer_major
from .grads import GradSink
from .offload import Checkpoint, CheckpointOffload
from .store import Entry, HostStore
from .streamer import Streamer
from .template import Template, TemplateCache

logger = logging.getLogger(__name__)

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
_KERNEL_KEY = "_megatrain_kernel"  # a unit call's kwarg carrying a kernel (never reaches the module)
_INPUT_KWARGS = ("hidden_states", "input_ids", "input", "inputs_embeds")


@dataclass
class _Unit:
    index: int
    name: str
    module: nn.Module
    template: Template
    mirror: list
    trainable: list[Entry]


@dataclass
class _Call:
    """Everything a streamed call needs besides its differentiable input."""

    unit: int
    args: tuple  # positional arguments after the input
    kwargs: dict
    input_key: str | None  # None: the input was the first positional argument
    autocast: tuple | None = None  # (enabled, dtype, cache_enabled) on the compute device type
    cpu_rng: torch.Tensor | None = None
    dev_rng: torch.Tensor | None = None
    kernel: Any = None  # computes the unit instead of its template (the chunked head + loss)


@dataclass
class EngineStats:
    """Counters since the last ``reset`` (read by the Trainer integration's metrics)."""

    forward_units: int = 0
    backward_units: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    tokens: int = 0  # token ids entering the embedding in training calls
    useful_flops: float = 0.0  # 6 * P * tokens + 12 * layers * hidden * seq * tokens (no recompute)
    optimizer_wait_s: float = 0.0  # training thread blocked on a background HostAdamW update
    grad_wait_s: float = 0.0  # backward blocked on gradient transfers (queue full, or the last ones at its end)
    grad_stream_bytes: int = 0  # bytes the grad stream moved: gradients down, accumulators up
    grad_stream_busy_s: float = 0.0  # grad stream time spent on them (CUDA events)
    fetches: int = 0  # unit weight fetches
    uploads: int = 0  # ... that had to upload the unit (the others reused the copy on the device)
    fetches_not_ready: int = 0  # ... whose upload had not landed when the compute needed it
    # optimizer state HostAdamW's device_update moved over the link (added at the next step())
    update_h2d_bytes: int = 0
    update_d2h_bytes: int = 0

    def reset(self) -> None:
        self.forward_units = self.backward_units = self.h2d_bytes = self.d2h_bytes = self.tokens = 0
        self.grad_stream_bytes = 0
        self.fetches = self.fetches_not_ready = self.uploads = 0
        self.useful_flops = self.optimizer_wait_s = self.grad_wait_s = self.grad_stream_busy_s = 0.0
        self.update_h2d_bytes = self.update_d2h_bytes = 0


@dataclass
class _Group:
    """A layer-major accumulation group in progress (see :mod:`megatrain_hf.layer_major`)."""

    tokens: list = field(default_factory=list)  # round -> tokens of that round's unit calls
    anchors: dict = field(default_factory=dict)  # round -> anchor its calls take (previous round's tokens, summed)
    rounds: dict = field(default_factory=dict)  # coroutine index -> unit calls with a graph node so far
    current: Any = None  # the coroutine whose unit call the driver is executing
    backward_open: bool = False  # the group's one backward over all micro-batches is running


def _position_limit(config) -> int | None:
    """``max_position_embeddings`` when it bounds the trained positions; None without it, or when
    rope scaling (YaRN, linear, dynamic, ...) extends the context on purpose."""
    limit = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        return None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def _use_expandable_segments() -> Callable[[], None] | None:
    """Switch the caching allocator to expandable segments; return the undo, or None if unchanged.

    Under ``max_gpu_memory`` the allocator runs at its cap: with fixed-size segments, freed blocks
    of one size (or one stream's pool) cannot serve another, so allocations keep failing, the
    allocator frees its cache (a device-wide synchronisation, then ``cudaFree`` / ``cudaMalloc``)
    and retries. Expandable segments map pages into one growing range per stream instead, so what
    is reserved stays close to what is allocated. The setting applies to segments created after
    it; the user's own ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` wins.
    """
    import os

    if any("expandable_segments" in os.environ.get(name, "") for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")):
        return None
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch < 2.12
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        logger.warning("megatrain: this torch cannot switch the CUDA allocator to expandable segments at run "
                       "time; under max_gpu_memory set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        return None
    setter("expandable_segments:True")
    return lambda: setter("expandable_segments:False")


def _active_peak(device: torch.device) -> int:
    """Peak of the allocator's active bytes since the last reset (allocated if not reported)."""
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("active_bytes.all.peak", stats.get("allocated_bytes.all.peak", 0)))


class _StreamedUnit(torch.autograd.Function):
    """One unit call: output and a zero scalar *token* (layer-major ordering, see ``_anchor_for``)."""

    @staticmethod
    def forward(ctx, engine: "Engine", call: _Call, anchor: torch.Tensor, x: torch.Tensor):
        ctx.engine, ctx.call = engine, call
        ctx.ckpt = engine._offload_checkpoint(x)
        if ctx.ckpt is None:
            ctx.save_for_backward(x)  # the activation checkpoint of this unit
        out = engine._compute(call, x, engine.streamer.fetch(call.unit))
        engine.streamer.prefetch(call.unit + 1)  # after the compute is queued: never delays it
        return out, anchor.new_zeros(())

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor, grad_token: torch.Tensor):
        engine = ctx.engine
        group = engine._group
        if group is not None and not group.backward_open:
            raise RuntimeError(
                "megatrain: a backward pass started inside one micro-batch of a layer-major accumulation "
                "group, before the other micro-batches ran their forward. Inside Trainer.training_step call "
                "self.accelerator.backward(loss) (Trainer's own code does), in your own loop use "
                "engine.backward(loss); or turn the schedule off with MegaTrainConfig(layer_major=False)."
            )
        engine._at_backward_end()
        try:
            if ctx.ckpt is None:
                (x,) = ctx.saved_tensors
            else:  # back from the host; the micro-batch's previous checkpoint starts its way up
                x = engine.offload.load(ctx.ckpt)
                engine.offload.prefetch(ctx.ckpt.prev)
                ctx.ckpt.prev = None
            grad_x = engine._recompute_backward(ctx.call, x, grad_out)
        except BaseException:
            engine._backward_failed()
            raise
        return None, None, None, grad_x


class Engine:
    """Handle of an attached model. Build with :func:`attach`."""

    def __init__(self, model: nn.Module, config: MegaTrainConfig, device: torch.device, dtype: torch.dtype) -> None:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device} was asked for but CUDA is not available; use device='cpu'.")
        self.model = model
        self.config = config
        self.device = device
        self.compute_dtype = dtype
        self.stats = EngineStats()
        self._undo: list = []
        units = locate_units(model)
        self._check_coverage(model, units)
        self._disable_hf_checkpointing(model)
        staging = config.host_staging is not False
        if config.check_host_memory:
            staging = self._check_host_memory(units, dtype, device, config)
        self.store = HostStore(
            list(zip(units.names, units.modules)),
            compute_dtype=dtype,
            device=device,
            pin=config.resolve_pin(device),
            embedding_units=units.embedding_units,
            staging=staging,
        )
        self.host_threads = config.resolve_host_threads()
        if torch.get_num_threads() < self.host_threads:
            logger.info(
                "megatrain: raising torch CPU threads from %d to %d for the host update "
                "(MegaTrainConfig.host_threads)", torch.get_num_threads(), self.host_threads
            )
            torch.set_num_threads(self.host_threads)
        self.streamer = Streamer(self.store, device, self.stats)
        self.grads = GradSink(self.store, device, self.stats, host_threads=self.host_threads)
        self.offload: CheckpointOffload | None = None
        if config.offload_checkpoints is True:
            self._start_offload()
        self._chains: dict[int, weakref.ref] = {}  # micro-batch -> its last offloaded checkpoint
        self._offload_per_token: float | None = None  # host checkpoint bytes per token of a micro-batch
        self._microbatch_tokens = 0  # the most tokens one training micro-batch has had
        self._host_fit_logged = False
        templates = TemplateCache()
        self.units: list[_Unit] = []
        for u, (name, module) in enumerate(zip(units.names, units.modules)):
            template = templates.get(module)
            self.units.append(
                _Unit(u, name, module, template, template.mirror_pairs(module), self.store.trainable_entries(u))
            )
        self.num_templates = len(templates)
        # For the TFLOPS metric (the project's convention): 6 * P + 12 * layers * hidden * seq per token.
        self.trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        config = getattr(unwrap(model), "config", None)
        text_config = getattr(config, "get_text_config", lambda: config)()
        layers = getattr(text_config, "num_hidden_layers", 0) or 0
        hidden = getattr(text_config, "hidden_size", 0) or 0
        self._attn_flops_per_seq = 12.0 * layers * hidden
        self._max_positions = _position_limit(text_config)
        self._model_type = getattr(text_config, "model_type", "?")
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self._end_queued = None  # graph-task id of the pass whose end callback is queued
        self._group: _Group | None = None
        # the chunked head + loss (loss.py): installed at attach, active per config / integration
        self.chunked_loss_active = self.config.chunked_loss is True
        self._init_budget()
        self._install(model, units)
        logger.info(
            "megatrain attached: %d units (%d templates), %.1fM trainable params, %.2f GiB host, "
            "compute %s on %s",
            len(self.units),
            self.num_templates,
            self.store.trainable_numel() / 1e6,
            self.store.host_bytes() / 2**30,
            str(dtype).replace("torch.", ""),
            device,
        )

    # ------------------------------------------------------------------ attach / detach
    @staticmethod
    def _check_coverage(model: nn.Module, units: Units) -> None:
        covered = {id(p) for m in units.modules for p in m.parameters()}
        stray = [n for n, p in model.named_parameters() if id(p) not in covered]
        if stray:
            raise ValueError(
                f"{len(stray)} parameter(s) live outside the streamed units and would stay on the host: "
                f"{stray[:5]}. megatrain supports models whose weights are all in the embedding, decoder "
                "layers, final norm and lm_head."
            )

    @staticmethod
    def _check_host_memory(units: Units, dtype: torch.dtype, device: torch.device, config: MegaTrainConfig) -> bool:
        """Raise with the arithmetic before allocating, rather than meet the OOM killer later.

        Returns whether to keep the host staging copy: with ``host_staging="auto"`` it is dropped
        when that is what makes the plan fit.
        """
        from .memory import available_host_bytes, check_host_memory, host_breakdown_for_units

        # The model's current tensors are released as they move into the store.
        current = sum(p.numel() * p.element_size() for m in units.modules for p in m.parameters())
        available = available_host_bytes() + current

        def check(staging: bool) -> None:
            breakdown = host_breakdown_for_units(
                list(zip(units.names, units.modules)),
                compute_dtype=dtype,
                staging=staging and dtype != torch.float32,
                embedding_units=units.embedding_units,
                optimizer_state=config.replace_adamw,
            )
            check_host_memory(sum(breakdown.values()), breakdown, available=available)

        if config.host_staging is False:
            check(False)
            return False
        try:
            check(True)
            return True
        except MemoryError:
            if config.host_staging is True or dtype == torch.float32:
                raise
            check(False)  # raises (with the smaller plan's arithmetic) if even that does not fit
            logger.info(
                "megatrain: host_staging='auto' drops the bf16 host copy of the weights (2 B/param) so that "
                "the plan fits this machine's RAM; the fp32 masters are sent and rounded on the GPU"
            )
            return False

    def _disable_hf_checkpointing(self, model: nn.Module) -> None:
        base = unwrap(model)
        flag = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") else (
            "is_gradient_checkpointing"
        )
        if getattr(base, flag, False):
            logger.warning(
                "HF activation checkpointing was enabled on the model; megatrain turns it off because it "
                "already recomputes every layer from its own checkpoint (HF's would recompute twice)."
            )
            base.gradient_checkpointing_disable()

        def _noop(*args, **kwargs):
            logger.info(
                "activation checkpointing requested: megatrain already checkpoints every layer and "
                "recomputes it in backward, so HF's is not enabled."
            )

        for target in {id(model): model, id(base): base}.values():
            for name in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
                if hasattr(target, name):
                    self._set_instance_attr(target, name, _noop)

    def _set_instance_attr(self, obj: Any, name: str, value: Any) -> None:
        had = name in vars(obj)
        old = vars(obj).get(name)
        obj.__dict__[name] = value  # instance attribute: the class stays untouched

        def undo():
            if obj.__dict__.get(name) is not value:
                return  # replaced since (e.g. TRL patched the forward on top): leave the newer one
            if had:
                obj.__dict__[name] = old
            else:
                obj.__dict__.pop(name, None)

        self._undo.append(undo)

    def _install(self, model: nn.Module, units: Units) -> None:
        for unit in self.units:
            self._set_instance_attr(unit.module, "forward", self._make_forward(unit.index))
        self._install_chunked_loss(unwrap(model))
        # Non-unit buffers (rotary inv_freq, ...) are small: they live on the compute device.
        in_units = {id(b) for m in units.modules for b in m.buffers()}
        for mod in model.modules():
            for key, buf in list(mod._buffers.items()):
                if buf is not None and id(buf) not in in_units and buf.device != self.device:
                    mod._buffers[key] = buf.to(self.device)
                    self._undo.append(lambda mod=mod, key=key, buf=buf: mod._buffers.__setitem__(key, buf))
        # A device map of 2+ entries keeps Trainer and Accelerate from moving the whole model.
        base = unwrap(model)
        self._report_compute_device(base)
        device_map = {name: str(self.device) for name in units.names}
        self._set_instance_attr(base, "hf_device_map", device_map)
        hook = base.register_state_dict_pre_hook(lambda *args, **kwargs: self.synchronize())
        self._undo.append(hook.remove)

        if self._max_positions is not None:
            decoder = base.get_decoder() if hasattr(base, "get_decoder") else base
            hook = decoder.register_forward_pre_hook(self._check_sequence_length, with_kwargs=True)
            self._undo.append(hook.remove)
        original_zero_grad = base.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            if not set_to_none:
                self.synchronize()  # a background update reads the gradient buffers in place
            original_zero_grad(set_to_none=set_to_none)

        self._set_instance_attr(base, "zero_grad", zero_grad)
        # load_state_dict (resume, load_best_model_at_end) must not race a background update,
        # and changes the masters (re-stage them)
        hook = base.register_load_state_dict_pre_hook(lambda *args, **kwargs: self.synchronize())
        self._undo.append(hook.remove)
        hook = base.register_load_state_dict_post_hook(lambda *args, **kwargs: self.store.mark_dirty())
        self._undo.append(hook.remove)
        # torch keeps global hooks forever: hold the engine weakly so a dropped model is freed
        on_step = weakref.WeakMethod(self._on_optimizer_step)
        step_hook = register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: (m := on_step()) is not None and m(optimizer, args, kwargs)
        )
        self._undo.append(step_hook.remove)
        weakref.finalize(self, step_hook.remove)

    def _install_chunked_loss(self, base: nn.Module) -> None:
        """Route training forwards with labels through the chunked head + loss (``loss.py``)."""
        if self.config.chunked_loss is False:
            return
        from .adapters import CHUNKED_LOSS_FAMILIES

        model_type = getattr(getattr(base, "config", None), "model_type", None)
        if model_type not in CHUNKED_LOSS_FAMILIES:  # its logits may be scaled in ways loss.py does not know
            if self.config.chunked_loss is True:
                logger.warning(
                    "megatrain: chunked_loss=True but model type %r is not known to compute its logits as "
                    "lm_head(hidden) [+ soft-capping]; the loss is computed from full logits.", model_type
                )
            self.chunked_loss_active = False
            return
        head = self.units[-1].module
        if type(head) is not nn.Linear:  # e.g. a LoRA-wrapped lm_head: keep HF's head and loss
            if self.config.chunked_loss is True:
                logger.warning(
                    "megatrain: chunked_loss=True but the lm_head is a %s, not an nn.Linear; the loss is "
                    "computed from full logits.", type(head).__name__
                )
            self.chunked_loss_active = False
            return
        from .loss import chunked_forward

        self._set_instance_attr(base, "forward", chunked_forward(self, base, base.forward, self.config.loss_chunk_tokens))

    def head_loss(self, hidden: torch.Tensor, kernel: Any) -> torch.Tensor:
        """The loss from the final hidden states, computed by ``kernel`` in the head unit's streamed call."""
        return self._unit_forward(len(self.units) - 1, (hidden,), {_KERNEL_KEY: kernel})

    def _report_compute_device(self, base: nn.Module) -> None:
        """``model.device`` must name the compute device, not the host (generate() moves inputs there).

        ``device`` is a property of the class, so the instance gets a same-named subclass that
        overrides it; ``detach`` restores the original class.
        """
        cls = type(base)
        device = self.device
        namespace = {"device": property(lambda _self: device), "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        base.__class__ = type(cls.__name__, (cls,), namespace)
        self._undo.append(lambda: setattr(base, "__class__", cls))

    def _at_backward_end(self) -> None:
        """Once per backward pass: have autograd wait for the gradient sink when the pass ends.

        Keyed by autograd's graph-task id: a pass that failed in a node that is not the engine's
        (autograd then drops the queued callback) is cleaned up when the next pass starts.
        """
        task = torch._C._current_graph_task_id()
        if self._end_queued == task:
            return
        if self._end_queued is not None:  # a previous pass never reached its end
            self._backward_failed()
        self._end_queued = task
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_failed(self) -> None:
        """autograd drops queued callbacks when a backward fails: undo what the pass had started."""
        self._end_queued = None  # graph-task id of the pass whose end callback is queued
        self.streamer.drop_prefetched()
        self.grads.drop_held()
        try:
            self.grads.wait()  # no transfer of the failed pass may land in the next step's gradients
        except RuntimeError:
            logger.exception("gradient accumulation also failed while unwinding a failed backward")

    def _backward_done(self) -> None:
        self._end_queued = None  # graph-task id of the pass whose end callback is queued
        self.streamer.drop_prefetched()
        started = time.perf_counter()
        self.grads.wait()  # when backward() returns, every param.grad is complete
        self.stats.grad_wait_s += time.perf_counter() - started

    def synchronize(self) -> None:
        """Wait for background work (gradient accumulation, optimizer updates) and re-raise its errors.

        Needed only when your own code reads parameters right after ``optimizer.step()`` with
        HostAdamW; Trainer's save, evaluate and the end of ``train()`` do it already.
        """
        self.grads.wait()
        self.store.synchronize()

    def detach(self) -> None:
        """Restore the model's modules (forward, buffers, device map). Parameters stay on the host."""
        self.synchronize()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.streamer.drop_prefetched()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy still reads the buffers we unpin
        self.grads.close()
        self.store.release()
        if getattr(self.model, "_megatrain_engine", None) is self:
            del self.model._megatrain_engine

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if getattr(optimizer, "marks_store_dirty", False):
            return  # HostAdamW marks exactly the units it updated
        for group in optimizer.param_groups:
            if any(self.store.home_of(p) is not None for p in group["params"][:1]):
                self.store.mark_dirty()
                return

    def check_trainability(self) -> None:
        """Raise if a parameter's ``requires_grad`` changed since attach (the store laid it out then)."""
        changed = []
        for entries in self.store.entries:
            for e in entries:
                if e.kind in ("trainable", "frozen") and e.tensor.requires_grad != (e.kind == "trainable"):
                    changed.append(f"{e.name} ({e.kind} at attach)")
        if changed:
            raise ValueError(
                f"requires_grad changed after megatrain was attached for {len(changed)} parameter(s), e.g. "
                f"{changed[:3]}. Freeze/unfreeze (or apply PEFT) before building the Trainer / calling attach(); "
                "or call handle.detach() and attach again."
            )

    def active_dropout(self) -> list[str]:
        """Modules that draw random numbers in training mode (dropout probability > 0)."""
        found = []
        for name, module in self.model.named_modules():
            if not module.training:
                continue
            if isinstance(module, nn.modules.dropout._DropoutNd):
                if module.p > 0:
                    found.append(name)
                continue
            for attr in ("attention_dropout", "dropout"):
                value = module.__dict__.get(attr)
                if isinstance(value, float) and value > 0:
                    found.append(f"{name}.{attr}")
        return found

    def mark_dirty(self) -> None:
        """Call after changing parameters in place through ``.data`` (nothing else needs it)."""
        self.store.mark_dirty()

    # ------------------------------------------------------------------ streamed calls
    def _make_forward(self, u: int):
        def forward(*args, **kwargs):
            return self._unit_forward(u, args, kwargs)

        return forward

    def _unit_forward(self, u: int, args: tuple, kwargs: dict) -> torch.Tensor:
        coroutine = layer_major.current(self)
        if coroutine is not None:  # a micro-batch of a layer-major group: the driver runs the call
            return coroutine.call(u, args, kwargs)
        return self._unit_forward_now(u, args, kwargs)

    def _unit_forward_now(self, u: int, args: tuple, kwargs: dict) -> torch.Tensor:
        if args:
            x, rest, key = args[0], args[1:], None
        else:
            key = next((k for k in _INPUT_KWARGS if k in kwargs), None)
            if key is None:
                raise TypeError(f"streamed unit {self.units[u].name} got no input tensor (kwargs: {sorted(kwargs)})")
            kwargs = dict(kwargs)
            x, rest = kwargs.pop(key), ()
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"streamed unit {self.units[u].name} expects a tensor input, got {type(x).__name__}")
        kernel = kwargs.get(_KERNEL_KEY)
        if kernel is not None:
            kwargs = {k: v for k, v in kwargs.items() if k != _KERNEL_KEY}
        unit = self.units[u]
        needs_graph = torch.is_grad_enabled() and (
            bool(unit.trainable) or (x.is_floating_point() and x.requires_grad)
        )
        call = _Call(u, rest, kwargs, key, kernel=kernel)
        if u == 0 and unit.module.training and torch.is_grad_enabled() and not x.is_floating_point():
            seq = x.shape[-1] if x.dim() else 1
            self.stats.tokens += x.numel()
            self._microbatch_tokens = max(self._microbatch_tokens, x.numel())
            self.stats.useful_flops += x.numel() * (6.0 * self.trainable_params + self._attn_flops_per_seq * seq)
        if u == 0:  # a micro-batch's forward starts: its checkpoints form a new chain
            self._chains.pop(self._microbatch_key(), None)
        if not needs_graph:
            out = self._compute(call, x, self.streamer.fetch(u))
            self.streamer.prefetch(u + 1)
            return out
        self._check_side_inputs(unit, rest, kwargs)
        call.kwargs = self._without_cache(unit, kwargs)
        dev_type = self.device.type
        call.autocast = (
            torch.is_autocast_enabled(dev_type),
            torch.get_autocast_dtype(dev_type),
            torch.is_autocast_cache_enabled(),
        )
        if unit.module.training:  # dropout may draw random numbers: replay them in backward
            call.cpu_rng = torch.get_rng_state()
            if dev_type == "cuda":
                call.dev_rng = torch.cuda.get_rng_state(self.device)
        out, token = _StreamedUnit.apply(self, call, self._anchor_for_call(), x)
        if self.offload is None:
            self._ckpt_bytes += x.numel() * x.element_size()  # the checkpoint this call keeps
        group = self._group
        if group is not None and group.current is not None:
            r = group.rounds.get(group.current.index, 0)
            group.rounds[group.current.index] = r + 1
            while len(group.tokens) <= r:
                group.tokens.append([])
            group.tokens[r].append(token)
            self.grads.count_call(u)
        return out

    def _available_host(self) -> int:
        """Host RAM the offloaded checkpoints may still take; unbounded under ``check_host_memory=False``
        (the OS reports less than it grants, e.g. a VM whose RAM grows on use)."""
        from .memory import available_host_bytes

        return available_host_bytes() if self.config.check_host_memory else 1 << 62

    def _start_offload(self) -> None:
        from .memory import DEFAULT_HEADROOM_BYTES

        self.offload = CheckpointOffload(self.device, self.store.allocate, self.store.free, self._available_host,
                                         DEFAULT_HEADROOM_BYTES, self.stats)

    def _offload_instead(self, fits: int, k: int) -> bool:
        """``offload_checkpoints="auto"``: the budget fits ``fits`` < ``k``; offload if the host can hold
        two micro-batches' checkpoints, and measure again (the next steps run one, then two)."""
        if self.config.offload_checkpoints != "auto" or self.offload is not None or self._per_microbatch <= 0:
            return False
        from .memory import DEFAULT_HEADROOM_BYTES

        if self._available_host() - DEFAULT_HEADROOM_BYTES < 2 * self._per_microbatch:
            return False
        logger.info("megatrain: max_gpu_memory fits %d of the step's %d micro-batches with the activation "
                    "checkpoints on the GPU; offloading them to host memory (%.2f GiB per micro-batch) and "
                    "measuring again", fits, k, self._per_microbatch / 2**30)
        self._start_offload()
        self._peaks, self._per_microbatch = {}, 0
        self._microbatch_tokens = 0  # the host measurement divides by the switch step's tokens
        self._restart_peaks()  # the new measurements start from here
        return True

    def _check_sequence_length(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the decoder: a training call's sequence must fit the positions the model
        was built for, unless it passes ``position_ids`` (packed documents restart them)."""
        if not (module.training and torch.is_grad_enabled()) or kwargs.get("position_ids") is not None:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        if isinstance(ids, torch.Tensor) and ids.dim():
            seq = ids.shape[-1]
        elif isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
            seq = embeds.shape[-2]
        else:
            return
        limit = self._max_positions
        if seq > limit:
            raise ValueError(
                f"megatrain: a training sequence has {seq} tokens, more than the model's max_position_embeddings="
                f"{limit} ({self._model_type}): positions past it were never trained, and the loss would be "
                f"computed on them silently. Fix: truncate the data to <= {limit} tokens (e.g. tokenizer(..., "
                f"truncation=True, max_length={limit}) or SFTConfig(max_length={limit})), or extend the context "
                "on purpose (set rope_scaling and max_position_embeddings in the model config before loading)."
            )

    def _microbatch_key(self) -> int:
        group = self._group
        return group.current.index if group is not None and group.current is not None else 0

    def _offload_checkpoint(self, x: torch.Tensor) -> Checkpoint | None:
        """With ``offload_checkpoints``: ``x`` saved to the host, linked to its micro-batch's chain."""
        if self.offload is None or not x.is_floating_point():
            return None
        key = self._microbatch_key()
        last = self._chains.get(key)
        ckpt = self.offload.save(x, last() if last is not None else None)
        self._chains[key] = weakref.ref(ckpt)
        return ckpt

    def _anchor_for_call(self) -> torch.Tensor:
        """The requires-grad scalar input of a streamed call.

        Outside a layer-major group: the engine's leaf anchor (so that backward reaches every
        unit). Inside one, round r's calls take the sum of round r-1's tokens: autograd runs that
        sum's backward only after every round-r call's backward, and every round-(r-1) call waits
        for it, so unit u finishes for all micro-batches before unit u-1 starts (one upload, one
        gradient download per unit).
        """
        group = self._group
        r = group.rounds.get(group.current.index, 0) if group is not None and group.current is not None else 0
        if r == 0:
            return self.anchor
        anchor = group.anchors.get(r)
        if anchor is None:
            tokens = group.tokens[r - 1]
            anchor = tokens[0] if len(tokens) == 1 else torch.stack(tokens).sum()
            group.anchors[r] = anchor
        return anchor

    # ------------------------------------------------------------------ GPU memory budget
    def _init_budget(self) -> None:
        """``max_gpu_memory``: cap the allocator, and size layer-major groups from measurements."""
        self.gpu_budget = self.config.gpu_memory_bytes()
        self.in_flight = None  # micro-batches per group in the current step (None: no step seen)
        self._ckpt_bytes = 0  # activation-checkpoint bytes saved by graph calls since the last observation
        self._peaks: dict[int, int] = {}  # micro-batches in flight -> GPU peak of the last such step
        self._per_microbatch = 0  # activation-checkpoint bytes of one micro-batch (measured)
        self._peak_source = None
        # the largest peaks seen before each reset of the statistics (reset per measured step)
        self.max_peak_allocated = self.max_peak_reserved = 0
        if self.gpu_budget is None or self.device.type != "cuda":
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        fraction = min(1.0, self.gpu_budget / total)
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        self._undo.append(lambda: torch.cuda.set_per_process_memory_fraction(1.0, self.device))
        undo = _use_expandable_segments()
        if undo is not None:
            self._undo.append(undo)
        # Planned on active bytes (allocated, plus blocks freed but still read by another stream,
        # e.g. inputs whose checkpoint copy is pending), with _BUDGET_MARGIN left for
        # fragmentation. Not on reserved:
        # under a cap the caching allocator keeps freed blocks until an allocation fails, so what
        # it holds drifts up to the cap whatever the step needs (7B, 24 GiB, one micro-batch in
        # flight: 8.6 GiB allocated, 22.7 GiB reserved) and would never let a second one in.
        # Blocks cached before the cap (e.g. a model initialised on the GPU) are released first.
        self._peak_source = lambda: _active_peak(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        logger.info("megatrain: GPU memory capped at %.2f GiB (%.1f%% of %s)%s", self.gpu_budget / 2**30,
                    100 * fraction, torch.cuda.get_device_name(self.device),
                    ", allocator on expandable segments" if undo is not None else "")

    _BUDGET_MARGIN = 0.9  # of the budget, planned for allocated bytes (the rest: fragmentation, estimate error)

    def microbatches_in_flight(self, k: int) -> int:
        """How many of a step's ``k`` micro-batches to run per layer-major group under the budget.

        Step 1 runs one at a time (measured), the next step at most two (a second measurement:
        the peak's growth per micro-batch, which also covers what grows besides the checkpoints,
        e.g. full logits without the chunked loss); then as many as the two measurements allow.
        """
        k = min(k, self._host_fit(k))
        if self.gpu_budget is None or self._peak_source is None:
            return k
        if not self._peaks:
            return 1
        low = min(self._peaks)
        per = self._per_microbatch
        if len(self._peaks) > 1:
            high = max(self._peaks)
            per = max(per, (self._peaks[high] - self._peaks[low]) // (high - low))
        if per <= 0:
            return k if len(self._peaks) > 1 else min(k, 2)
        base = self._peaks[low] - low * per
        room = self._BUDGET_MARGIN * self.gpu_budget - base
        fits = int(room // per)
        if fits < k:  # one measurement over-estimates what fits, so fewer than k is certain already
            rest = per - self._per_microbatch  # what a micro-batch would still add with offloaded checkpoints
            with_offload = k if rest <= 0 else int(room // rest)
            if with_offload > max(1, fits) and self._offload_instead(max(1, fits), k):
                return 1
        if len(self._peaks) == 1:
            fits = min(fits, 2)
        return max(1, min(k, fits))

    def _host_fit(self, k: int) -> int:
        """With offloaded checkpoints: micro-batches whose checkpoints the host RAM can hold.

        The first step runs one at a time and its pool size is one micro-batch's checkpoints;
        later steps fit what the pool and the RAM still available hold.
        """
        if self.offload is None:
            return k
        if self._offload_per_token is None:
            return 1
        from .memory import DEFAULT_HEADROOM_BYTES

        capacity = self.offload.pool_bytes + self._available_host() - DEFAULT_HEADROOM_BYTES
        per_microbatch = max(1, int(self._offload_per_token * self._microbatch_tokens))
        fits = max(1, capacity // per_microbatch)
        if fits < k:
            self._log_host_fit_once(fits, k, per_microbatch)
        return fits

    def _log_host_fit_once(self, fits: int, k: int, per_microbatch: int) -> None:
        if not self._host_fit_logged:
            self._host_fit_logged = True
            logger.info("megatrain: host RAM holds the offloaded checkpoints of %d of the step's %d micro-batches "
                        "(%.2f GiB each); the step runs in groups of %d", fits, k, per_microbatch / 2**30, fits)

    def observe_step(self, microbatches: int) -> None:
        """After an optimizer step of ``microbatches``: its GPU peak and checkpoint bytes per micro-batch."""
        if self.offload is not None and self._offload_per_token is None and microbatches > 0 and self._microbatch_tokens:
            # the first step ran one micro-batch at a time: its peak is one micro-batch's checkpoints
            self._offload_per_token = self.offload.peak_in_use_bytes / self._microbatch_tokens
        nbytes, self._ckpt_bytes = self._ckpt_bytes, 0
        if self._peak_source is None or microbatches <= 0 or len(self._peaks) >= 2:
            return  # two group sizes measured: the plan is set, peak statistics are left alone
        self._per_microbatch = max(self._per_microbatch, nbytes // microbatches)
        self._peaks[self.in_flight or 1] = int(self._peak_source())
        self._restart_peaks()

    def _restart_peaks(self) -> None:
        """Keep the peaks so far (``max_peak_*``, reported) and reset CUDA's statistics for the next measurement."""
        if self.device.type == "cuda":
            self.max_peak_allocated = max(self.max_peak_allocated, torch.cuda.max_memory_allocated(self.device))
            self.max_peak_reserved = max(self.max_peak_reserved, torch.cuda.max_memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)

    # ------------------------------------------------------------------ layer-major accumulation
    def run_layer_major(self, fns: list[Callable[[], Any]]) -> list[Any]:
        """Run micro-batch steps layer-major (see :mod:`megatrain_hf.layer_major`); return their results.

        Each callable runs one micro-batch's forward and calls :meth:`backward` on its loss, like a
        training step; the backward of all of them runs once all forwards are done.
        """
        if self._group is not None:
            raise RuntimeError("megatrain: run_layer_major() cannot be nested")
        if len(fns) == 1:
            return [fns[0]()]
        self._group = _Group()
        self.grads.begin_group()
        try:
            return layer_major.run(self, self.device, fns, self._execute_group_call, self._group_backward)
        finally:
            self._group = None
            self.grads.end_group()

    def accumulate(self, loss_fns: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        """Forward + backward of several micro-batches of one optimizer step, layer-major.

        Each callable computes one micro-batch's loss, already scaled as you want it accumulated
        (e.g. divided by the number of micro-batches); the gradients of all of them are in
        ``param.grad`` when this returns, as after one ``loss.backward()`` per micro-batch.
        Returns the detached losses. Example::

            losses = engine.accumulate([lambda b=b: model(**b).loss / len(batches) for b in batches])
        """
        return self.run_layer_major([functools.partial(self._loss_step, fn) for fn in loss_fns])

    def _loss_step(self, loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        loss = loss_fn()
        self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor, retain_graph: bool | None = None) -> None:
        """``loss.backward()``; inside a layer-major group, deferred to the group's one backward."""
        coroutine = layer_major.current(self)
        if coroutine is None:
            loss.backward(retain_graph=retain_graph)
        else:
            coroutine.pause("backward", (loss, {"retain_graph": retain_graph}))

    def _execute_group_call(self, coroutine, u: int, args: tuple, kwargs: dict) -> Any:
        self._group.current = coroutine
        try:
            return self._unit_forward_now(u, args, kwargs)
        finally:
            self._group.current = None

    def _group_backward(self, items: list[tuple[torch.Tensor, dict]]) -> None:
        group = self._group
        group.backward_open = True
        try:
            retain = any(kwargs.get("retain_graph") for _, kwargs in items)
            torch.autograd.backward([loss for loss, _ in items], retain_graph=retain)
        finally:
            # later unit calls (a second forward in the same step) start a fresh token chain
            group.backward_open = False
            group.tokens, group.anchors, group.rounds = [], {}, {}

    def _check_side_inputs(self, unit: _Unit, rest: tuple, kwargs: dict) -> None:
        def tensors(values):
            for v in values:
                if isinstance(v, torch.Tensor):
                    yield v
                elif isinstance(v, (tuple, list)):
                    yield from (t for t in v if isinstance(t, torch.Tensor))

        for t in tensors((*rest, *kwargs.values())):
            if t.requires_grad:
                raise RuntimeError(
                    f"streamed unit {unit.name} received a side input that requires grad (shape "
                    f"{tuple(t.shape)}); megatrain differentiates only the unit's main input (hidden "
                    "states). Trainable rotary/position tables are not supported."
                )

    def _without_cache(self, unit: _Unit, kwargs: dict) -> dict:
        """Training calls never write a KV cache (the recompute would write it twice)."""
        out = dict(kwargs)
        for name in _CACHE_KWARGS:
            cache = out.get(name)
            if cache is None:
                continue
            layer_idx = getattr(getattr(unit.module, "self_attn", None), "layer_idx", 0)
            seen = cache.get_seq_length(layer_idx) if hasattr(cache, "get_seq_length") else 0
            if seen:
                raise RuntimeError(
                    f"streamed unit {unit.name} got a KV cache holding {seen} tokens in a training "
                    "(grad-enabled) call; megatrain does not train through a pre-filled cache. Pass "
                    "use_cache=False / no past_key_values when training."
                )
            out[name] = None
        if "use_cache" in out:
            out["use_cache"] = False
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

    def _compute(self, call: _Call, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        unit = self.units[call.unit]
        if call.kernel is not None:
            with self._autocast(None):
                out = call.kernel.forward(x, tensors)
            self.stats.forward_units += 1
            return out
        module = unit.template.bind(tensors, unit.mirror)
        try:
            with self._autocast(None):
                if call.input_key is None:
                    out = module(x, *call.args, **call.kwargs)
                else:
                    out = module(*call.args, **{call.input_key: x}, **call.kwargs)
        finally:
            unit.template.unbind()
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"streamed unit {unit.name} returned {type(out).__name__}; megatrain expects a tensor "
                "(transformers >= 5 decoder layers return one)."
            )
        self.stats.forward_units += 1
        return out

    def _recompute_backward(self, call: _Call, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor | None:
        unit = self.units[call.unit]
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=call.cpu_rng is not None, device_type=self.device.type):
            if call.cpu_rng is not None:
                torch.set_rng_state(call.cpu_rng)
                if call.dev_rng is not None:
                    torch.cuda.set_rng_state(call.dev_rng, self.device)
            tensors = self.streamer.fetch(call.unit)
            leaves = []
            for e in unit.trainable:
                leaf = tensors[e.name].detach().requires_grad_(True)
                tensors[e.name] = leaf
                leaves.append(leaf)
            x_grad = x.is_floating_point() and x.requires_grad
            if call.kernel is not None:  # the kernel recomputes chunk by chunk itself
                if call.unit > 0:
                    self.streamer.prefetch(call.unit - 1)
                with self._autocast(call.autocast):
                    grad_x, sums = call.kernel.backward(x, tensors, [e.name for e in unit.trainable], grad_out)
                grads = (grad_x, *[sums.get(e.name) for e in unit.trainable])
                x_grad = True
            else:
                x_in = x.detach().requires_grad_(x_grad)
                with torch.enable_grad(), self._autocast(call.autocast):
                    out = self._compute(call, x_in, tensors)
                if call.unit > 0:
                    self.streamer.prefetch(call.unit - 1)  # backward order; overlaps this unit's backward
                self.stats.forward_units -= 1  # a recompute is not a forward
                inputs = ([x_in] if x_grad else []) + leaves
                grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
        grad_x = grads[0] if x_grad else None
        if leaves:
            self.grads.submit(call.unit, unit.trainable, list(grads[1 if x_grad else 0 :]))
        self.stats.backward_units += 1
        return grad_x


def attach(
    model: nn.Module,
    config: MegaTrainConfig | None = None,
    *,
    device: torch.device | str | None = None,
    bf16: bool = False,
) -> Engine:
    """Attach the engine to ``model`` (on the CPU, fp32 masters) and return its handle.

    ``device``/``bf16`` are what the Trainer would use (its ``args.device`` and ``args.bf16``);
    ``config`` overrides them. Attaching twice raises; ``handle.detach()`` undoes everything but
    the parameters' new home in host buffers.
    """
    config = config or MegaTrainConfig()
    if getattr(model, "_megatrain_engine", None) is not None:
        raise RuntimeError("megatrain is already attached to this model; call handle.detach() first.")
    dev = config.resolve_device(torch.device(device) if device is not None else None)
    dtype = config.resolve_dtype(trainer_bf16=bf16)
    floating = {p.dtype for p in model.parameters() if p.requires_grad}
    if floating - {torch.float32}:
        raise ValueError(
            f"trainable parameters are {sorted(str(d) for d in floating)}; megatrain keeps fp32 masters. "
            "Load the model with dtype=torch.float32 (e.g. from_pretrained(path, dtype=torch.float32)); "
            "the compute still runs in bf16 with TrainingArguments(bf16=True)."
        )
    engine = Engine(model, config, dev, dtype)
    model.__dict__["_megatrain_engine"] = engine
    return engine


def engine_of(model: nn.Module) -> Engine | None:
    """The engine attached to ``model`` (or to the model under its PEFT/Accelerate wrappers)."""
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        engine = model.__dict__.get("_megatrain_engine")
        if engine is not None:
            return engine
        model = getattr(model, "module", None) or (
            model.get_base_model() if hasattr(model, "get_base_model") else None
        )
    return None


"""The engine: attach a model, and the handle that drives and detaches it.

``attach(model)`` turns every unit of a causal LM (embedding, decoder layers, final norm, head)
into a streamed unit and returns an :class:`Engine` whose ``detach()`` undoes it. The model keeps
its own ``forward``: HF computes rotary tables, masks per layer type, scaling and the loss exactly
as usual; only the units' ``forward`` is replaced (an instance attribute: the class is
untouched). The engine builds the pieces and wires them:

* ``core``: the host store (the parameters' new home), templates, the streamer, the gradient
  sink, the checkpoint offload, the streams;
* ``runtime``: the streamed call of a unit (``UnitRunner``) and layer-major groups;
* ``memory``: the host RAM check before allocating, the GPU budget;
* ``hf``: the family record (where the units are), the model installs, the chunked loss.

Every change to the model goes through one ``Patcher``, whose undo is ``detach()``.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
import dataclasses
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .errors import IncompatibleOptionsError, UsageError
from .config import MegaTrainConfig
from .core.grads import GradSink
from .core.ownership import LocalOwnership, ShardedOwnership
from .core.layout import Kind
from .core.activation_offload import CheckpointOffload
from .runtime.activation_inputs import CheckpointHomes
from .core.patcher import Patcher
from .core.resident import ResidentState
from .core.sharding import UnitSharding
from .core.store import HostStore, alias
from .core.streamer import Streamer
from .core.streams import streams_for
from .core.template import TemplateCache
from .models.checks import check_compile_dropout, check_coverage, check_fp32, check_liger_head, prepare_graph_call
from .models.families import INPUT_KWARGS, family_of, unwrap
from .models.flops import flops_parameters
from .models.model_patches import install_model, wrapper_chain
from .models.loading import deferred_weights
from .models.base_quantization import quantized_weights
from .models.experts import routed_experts
from .memory.budget import GpuBudget
from .memory import activations
from .memory import host as host_memory
from .memory.host import DEFAULT_HEADROOM_BYTES
from .memory.shapes import ModelShape
from .optim.tier_files import TierFiles
from .plan import Machine, Run, check, resolve
from .runtime import layer_major
from .runtime.compiled import RegionCompiler
from .runtime.streamed_call import Unit, UnitRunner
from .stats import EngineStats

logger = logging.getLogger(__name__)

_STEPPED_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for engine in list(_STEPPED_ENGINES):
        engine._on_optimizer_step(optimizer, args, kwargs)


register_optimizer_step_post_hook(_after_optimizer_step)


class Engine:
    """Handle of an attached model. Build with :func:`attach`."""

    def __init__(self, model: nn.Module, config: MegaTrainConfig, device: torch.device, dtype: torch.dtype,
                 streams=None, frozen_in_wire_dtype: bool = True) -> None:
        run = Run(bf16=dtype == torch.bfloat16, emulated_streams=streams is not None)
        machine = Machine.detect(device, config.offload_dir, ram_in_use=host_memory.model_bytes([("model", model)]))
        check(config, machine, run)  # what does not combine is refused before the model is touched
        self.model, self.config, self.device, self.compute_dtype = model, config, device, dtype
        self.patcher = Patcher(before_pickle=self.synchronize)
        self.family = family_of(model)
        located = self.family.locate(model)
        check_coverage(model, located)
        check_liger_head(model)
        if config.compile:
            check_compile_dropout(model)
        named = list(zip(located.names, located.modules))
        deferred = deferred_weights(model)  # a model from megatrain_hf.from_pretrained: read its weights into the flats
        schemes = quantized_weights(model, config.base_quantization,
                                    deferred.stored_schemes(model) if deferred is not None else None)
        quantize = (lambda p: schemes.get(id(p))) if schemes else None
        experts = routed_experts(named)  # the plan decides their dtype (MegaTrainConfig.experts_dtype)

        def fp32_experts(dtype: torch.dtype | None) -> frozenset[int]:
            return experts.params if dtype == torch.float32 else frozenset()

        self.plan = plan = resolve(config, machine, dataclasses.replace(run, experts=experts.kernel), lambda compute, e:
                                   host_memory.unit_sizes(named, compute_dtype=compute,
                                                          embedding_units=located.embedding_units,
                                                          frozen_in_wire_dtype=frozen_in_wire_dtype, quantize=quantize,
                                                          fp32_params=fp32_experts(e)),
                                   shape=lambda: ModelShape.from_hf_config(unwrap(model).config))  # max_seq_len
        self.sharding = UnitSharding(len(named), plan.ownership.timeout_s) if plan.ownership.sharded else None
        self.state_tier = tiers = plan.disk.tiers
        on_unit = None  # the disk tier's files, made once; masters on disk go there as soon as the store filled them
        if tiers.on_disk and plan.optimizer.moments is not None:
            on_unit = TierFiles(plan.disk.dir, tiers.units, tiers.masters, plan.optimizer.moments.mode, plan.disk.io,
                                 plan.disk.window)
        self.host_threads = plan.optimizer.threads
        self._raise_threads(self.host_threads)
        self.stats = EngineStats()
        ownership = (ShardedOwnership(self.sharding, plan.transport.receive_slots) if self.sharding is not None
                     else LocalOwnership())
        try:
            self.store = HostStore(named, compute_dtype=dtype, pin=plan.host.pin,
                                   embedding_units=located.embedding_units, staging=plan.host.staging,
                                   frozen_in_wire_dtype=frozen_in_wire_dtype,
                                   sources=deferred.source if deferred is not None else None, quantize=quantize,
                                   ranges=deferred.ranges if deferred is not None else None,
                                   stored_quantized=deferred.quantized_source if deferred is not None else None,
                                   ownership=ownership, grad_dtype=plan.precision.grads, on_unit=on_unit,
                                   fp32_params=fp32_experts(plan.precision.experts))
        except BaseException:
            if on_unit is not None:
                on_unit.close()  # (the files made so far)
            raise
        finally:
            if deferred is not None:
                deferred.close()
        if deferred is not None:
            deferred.finish(model)
        self.streams = streams if streams is not None else streams_for(device)
        self.streamer = Streamer(self.store, device, self.stats, self.streams)
        self.resident = ResidentState.build(self.store, self.streamer, plan.residency.units, device, dtype, self.streams)
        self.grads = GradSink(self.store, self.stats, self.streams, host_threads=self.host_threads)
        self.grad_keeper = None  # device_update: the device sums kept for the device's share of the update
        if plan.optimizer.device_update:
            from .optim.device_update import KeepingGradSink

            self.grad_keeper = KeepingGradSink(self.grads)
        self.budget = GpuBudget(device, plan.activations.gpu_budget, plan.activations.offload_checkpoints,
                                offload=lambda: self.runner.offload,
                                start_offload=lambda: self.checkpoint_homes.start_offload(),
                                available_host=self._available_host, on_undo=self.patcher.on_undo,
                                expandable=plan.activations.expandable_segments)
        templates = TemplateCache()
        units = []
        streamed = frozenset(id(p) for _, module in named for p in module.parameters())  # no callable may hold one
        for u, (name, module) in enumerate(named):
            template = templates.get(module)
            units.append(Unit(u, name, module, template, template.mirror_of(module, streamed, name),
                              self.store.entries_of(u, Kind.TRAINABLE), self.store.entries_of(u, Kind.FROZEN)))
        self.num_templates = len(templates)
        self.runner = UnitRunner(units, self.streamer, self.grads, self.stats, self.budget, device, dtype,
                                 INPUT_KWARGS, prepare_graph_call)
        budget = self.budget.budget  # the activations' share: what the resident units leave of it
        self.runner.tile_policy = activations.tile_policy(plan.activations.tile_tokens, plan.activations.compute_bytes,
                                                          None if budget is None else
                                                          max(1, budget - plan.residency.device_bytes))
        self.layer_major = layer_major.Driver(self.runner, self.grads, device)
        self.runner.layer_recipe = self.family.layer_recipe  # whole decoder layers tiled (models/layer_recipes.py)
        self._longest_sequence = 0
        self.runner.on_sequence = self._check_sequence
        self.runner.checkpoint_interval = plan.activations.checkpoint_interval
        if plan.compile is not None:
            self.runner.compiler = RegionCompiler.for_units(plan.compile.backend, plan.compile.mode, units)
        self.runner.inputs.device_units = frozenset({len(units) - 1})  # the head's input: never offloaded
        self.checkpoint_homes = CheckpointHomes(self.runner.inputs, plan.activations, self.store, self.stats,
                                                self.streams, self._available_host, DEFAULT_HEADROOM_BYTES,
                                                plan.host.pin)
        self._set_flops_model(model, located)
        self._gathering = False  # gather_state_dict reads state_dict() (data parallelism)
        self.chunked_loss_active = plan.loss.chunked  # the integration may turn it on ("auto")
        self.chunked_loss_installed = False
        self._install(model)
        if self.resident is not None:  # zero_grad of the model, its wrappers and units empties the device gradients
            self.resident.wrap_zero_grad(self.patcher, [*wrapper_chain(model), *(unit.module for unit in units)])
        for unit in units:  # what _install set on the real modules is the engine's own: never mirrored
            unit.mirror.seal()
        logger.info(
            "megatrain attached: %d units (%d templates), %.1fM trainable params, %.2f GiB host, compute %s on %s",
            len(units), self.num_templates, self.store.trainable_numel() / 1e6, self.store.host_bytes() / 2**30,
            str(dtype).replace("torch.", ""), device,
        )

    @property
    def units(self) -> list[Unit]:
        return self.runner.units

    def matches(self, config: MegaTrainConfig, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether attaching ``model`` again with these options would build this same engine."""
        return config == self.config and device == self.device and dtype == self.compute_dtype

    # ------------------------------------------------------------------ install
    def _raise_threads(self, threads: int) -> None:
        before = torch.get_num_threads()
        if before < threads:
            logger.info("megatrain: raising torch CPU threads from %d to %d for the host update "
                        "(MegaTrainConfig.host_threads)", before, threads)
            torch.set_num_threads(threads)
            self.patcher.on_undo(lambda: torch.set_num_threads(before))

    def _check_sequence(self, seq: int) -> None:
        """A training sequence longer than any before: the plan's rules that depend on the length
        (the attention kernel at long context, ``plan.py``)."""
        if seq > self._longest_sequence:
            config = getattr(unwrap(self.model), "config", None)
            self.plan.check(seq_len=seq, attention=getattr(config, "_attn_implementation", None))
            self.plan.check_length(seq, self._longest_sequence)  # max_seq_len: logged, or refused
            self._longest_sequence = seq

    def _set_flops_model(self, model: nn.Module, located) -> None:
        self.trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.stats.set_flops_model(*flops_parameters(model, located))

    def _install(self, model: nn.Module) -> None:
        patcher = self.patcher
        for unit in self.units:
            patcher.set_attr(unit.module, "forward", functools.partial(_unit_forward, weakref.ref(self), unit.index))
        engine_ref = weakref.ref(self)
        patcher.hook(model, model.register_forward_pre_hook(
            lambda *args: (engine := engine_ref()) is not None and engine.adopt_unit_forwards()))
        install_model(patcher, model, [u.module for u in self.units], self.device, self.synchronize,
                      self.mark_dirty, self._check_state_readable if self.store.remote else None,
                      frozenset(id(e.tensor) for u in self.store.remote for e in self.store.owned_trainable(u)))
        self._install_chunked_loss(unwrap(model))
        model_ref = weakref.ref(model)  # a backward hook anywhere in it: incoming gradients not written into
        self.runner.ownership.roots = lambda: [m for m in (model_ref(),) if m is not None]
        if self.sharding is not None and any(map(self.store.n_train, range(len(self.units)))):
            # every forward broadcasts the units' masters: every model call is collective (core/sharding.py)
            base = unwrap(model)
            patcher.hook(base, base.register_forward_pre_hook(self._agree_on_call, with_kwargs=True))
        # torch keeps global hooks forever: one module-level hook dispatches to the live engines, held weakly,
        # so a dropped model is freed and no hook is removed while torch iterates over them
        _STEPPED_ENGINES.add(self)
        patcher.on_undo(lambda: _STEPPED_ENGINES.discard(self))
        patcher.set_attr(model, "_megatrain_engine", self)

    def adopt_unit_forwards(self) -> None:
        """A unit's ``forward`` replaced after attach becomes that unit's own forward, run on its template with
        the streamed weights, and the streamed forward is put back. Liger-Kernel's ``use_liger_kernel=True``
        patches the final norm's instance ``forward`` inside ``Trainer.train()``, after attach: without this
        the norm ran on its host master, outside the engine. Checked at every top-level forward of the model."""
        for unit in self.units:
            current = vars(unit.module).get("forward")
            if isinstance(current, functools.partial) and current.func is _unit_forward:
                continue
            unit.template.adopt_root_forward(unit.mirror, current)
            unit.module.__dict__["forward"] = functools.partial(_unit_forward, weakref.ref(self), unit.index)
            logger.info("megatrain: %s's forward was replaced after attach (%s): it runs on the streamed weights",
                        unit.name, getattr(current, "__qualname__", type(current).__name__))

    def _install_chunked_loss(self, base: nn.Module) -> None:
        """Route training forwards with labels through the chunked head + loss (``models/chunked_loss.py``)."""
        if self.config.chunked_loss is False:
            return
        reason = None
        if base.get_output_embeddings() is not self.units[-1].module:  # a sequence classifier's score head
            reason = "the model has no LM head"
        elif not self.family.chunked_loss:  # its logits may be scaled in ways chunked_loss.py does not know
            reason = f"model type {self.family.model_type!r} is not known to compute its logits as lm_head(hidden)"
        elif type(self.units[-1].module) is not nn.Linear:  # e.g. a LoRA-wrapped lm_head: keep HF's head and loss
            reason = f"the lm_head is a {type(self.units[-1].module).__name__}, not an nn.Linear"
        if reason is not None:
            if self.config.chunked_loss is True:
                logger.warning("megatrain: chunked_loss=True but %s; the loss is computed from full logits.", reason)
            self.chunked_loss_active = False
            return
        from .models.chunked_loss import chunked_forward

        forward = chunked_forward(base, base.forward, self.plan.loss.chunk_tokens, self.head_loss,
                                  lambda: self.chunked_loss_active)
        self.patcher.set_attr(base, "forward", forward)
        self.chunked_loss_installed = True

    def _agree_on_call(self, module: nn.Module, args, kwargs) -> None:
        training = module.training and torch.is_grad_enabled()
        self.sharding.agree_on_call("a training forward" if training else
                                    "a model call without gradients or in eval mode (generate, evaluation)", training)

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if getattr(optimizer, "marks_store_dirty", False):
            return  # HostAdamW marks exactly the units it updated
        if self.resident is not None and any(self.store.home_of(p) is not None for g in optimizer.param_groups
                                             for p in g["params"]):
            raise IncompatibleOptionsError(
                f"megatrain: {type(optimizer).__name__} stepped the host copies of units kept on the device "
                f"(resident_units={self.config.resident_units}); only HostAdamW updates them there. Fix: "
                "engine.host_optimizer(AdamW(...)) (or Trainer's AdamW), or attach with resident_units=0.")
        for group in optimizer.param_groups:
            if any(self.store.home_of(p) is not None for p in group["params"][:1]):
                self.store.mark_dirty()
                return

    # ------------------------------------------------------------------ handle API
    def synchronize(self) -> None:
        """Wait for background work (gradient accumulation, optimizer updates) and re-raise its errors.

        Needed only when your own code reads parameters right after ``optimizer.step()`` with
        HostAdamW; Trainer's save, evaluate and the end of ``train()`` do it already.
        """
        self.grads.wait()
        self.store.gates.synchronize()
        self.store.wait_master_writes()  # masters on disk: the files the parameters map hold the last update
        if self.resident is not None:
            self.resident.sync_down()  # the host flats hold the resident units' masters and moments

    def mark_dirty(self) -> None:
        """Call after changing parameters in place through ``.data`` (nothing else needs it)."""
        (self.resident or self.store).mark_dirty()

    def host_optimizer(self, optimizer: torch.optim.Optimizer):
        """A HostAdamW with ``optimizer``'s groups and hyper-parameters (a plain AdamW), built from the plan:
        its moment format, kernel and threads, and the disk tier's files made at attach (a
        ``DeviceShareAdamW`` under ``device_update``)."""
        from .optim.host_adamw import HostAdamW

        sections = dict(plan=self.plan.optimizer, device=self.device)
        if self.plan.optimizer.device_update:
            from .optim.device_update import DeviceShareAdamW

            # the device's units keep their gradients on the GPU, unless a GPU budget has no room planned for them
            sink = self.grad_keeper if self.plan.optimizer.device_keeps_grads else None
            return DeviceShareAdamW.from_plan(optimizer, self.store, **sections, grad_sink=sink, stats=self.stats)
        return HostAdamW.from_plan(optimizer, self.store, **sections)

    def detach(self) -> None:
        """Undo every change to the model. Parameters stay in host RAM (in the store's flats)."""
        self.synchronize()
        self.patcher.undo()
        if self.resident is not None:
            self.resident.detach()  # the device gradients become .grad (host copies)
        self.streamer.drop_prefetched()
        if self.streams is not None:
            self.streams.synchronize()  # no copy still reads the flats we unpin
        self.grads.close()
        self.checkpoint_homes.close()
        if self.store.tier_files is not None:
            self.store.tier_files.close()  # the parameters keep their mapping of the masters
        self.store.release()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, optimizer=None, defer: bool = True,
                        on_nonfinite: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``, exactly, for any loop.

        The global L2 norm comes from the per-unit norms the gradient sink recorded as the gradients
        landed (no pass over the host gradients); the clip multiply is ``clip_grad_norm_``'s. With
        ``optimizer`` a ``HostAdamW`` and ``defer`` (the default), the multiply runs inside its next
        background update, unit by unit; otherwise the gradients are multiplied at once (do that when
        your code reads ``.grad`` after clipping). A non-finite norm makes a ``HostAdamW`` skip its next
        step (weights, moments and step counts unchanged; logged; ``on_nonfinite(norm)`` instead, if
        given); another optimizer gets the gradients as plain clipping leaves them. Returns the total
        norm, as torch does. ``norm_type`` other than 2
        runs torch's norm and multiply over the gradients (``GradSink.gradients``).
        """
        if float(norm_type) != 2.0:  # torch's norm over every gradient (a resident unit's on the device too)
            self.grads.finish()
            norm = torch.nn.utils.get_total_norm(self.grads.gradients(), norm_type)
            self.grads.scale_(torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0))
            return norm
        norm = self.grads.global_norm()  # every gradient is on the host once backward returned
        deferred = defer and hasattr(optimizer, "set_clip_coef")
        if not bool(torch.isfinite(norm)):
            if on_nonfinite is not None:
                on_nonfinite(norm)
            elif hasattr(optimizer, "skip_next_step"):
                optimizer.skip_next_step()
                logger.warning("megatrain: non-finite gradient norm (%s): the optimizer skips this update (weights, "
                               "moments and step counts unchanged).", float(norm))
            return norm
        if math.isinf(float(max_norm)):  # only the norm is measured
            return norm
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)  # as clip_grad_norm_ computes it
        if deferred:
            optimizer.set_clip_coef(coef)
            return norm
        if float(coef) < 1.0:
            self.grads.scale_(coef)
        return norm

    # ------------------------------------------------------------------ data parallelism: the whole model
    def gather_state_dict(self, dst: int = 0) -> dict | None:
        """The model's full ``state_dict`` on rank ``dst`` (None on the others), every weight as training
        left it: the units another rank owns are received unit by unit into fresh tensors. Every rank must
        call it (a collective). Without data parallelism: ``model.state_dict()``."""
        self.synchronize()
        sharding, store = self.store.ownership.sharding, self.store
        if sharding is None:
            return self.model.state_dict()
        received: dict[int, torch.Tensor] = {}
        for u, bufs in enumerate(store.buffers):
            if bufs.master_host is None or sharding.owner(u) == dst:
                continue
            flat = bufs.master_host if sharding.rank != dst else torch.empty_like(bufs.master_host)
            sharding.gather_to(u, flat, dst)
            if sharding.rank == dst:
                received[u] = flat
        if sharding.rank != dst:
            return None
        replace = {id(e.tensor): alias(flat, e.offset, e.shape) for u, flat in received.items()
                   for e in store.owned_trainable(u)}
        self._gathering = True
        try:
            full = self.model.state_dict()
        finally:
            self._gathering = False
        by_name = {name: replace[id(p)] for name, p in self.model.named_parameters(remove_duplicate=False)
                   if id(p) in replace}
        return {k: by_name.get(k, v) for k, v in full.items()}

    def _check_state_readable(self) -> None:
        if not self._gathering:
            sharding = self.store.ownership.sharding
            raise UsageError(
                f"megatrain: this process (rank {sharding.rank} of {sharding.world_size}) holds only the units it owns; "
                "the other ranks' weights are not here, so model.state_dict() / save_pretrained() would not be the "
                "model (they read as NaN). Fix: megatrain_hf.gather_state_dict(model) on every rank (the full "
                "state on rank 0), or trainer.save_model() (it gathers), or save_pretrained(dir, state_dict=...) "
                "with the gathered state.")

    def set_final_microbatch(self, is_final: Callable[[], bool]) -> None:
        """Tell the gradient sink whether a backward is the step's last (then gradient norms are wanted)."""
        self.grads.final_microbatch = is_final

    def call_unit(self, u: int, args: tuple, kwargs: dict, kernel: Any = None) -> torch.Tensor:
        """A streamed call of unit ``u`` (``kernel``: computes it instead of its template)."""
        coroutine = self.layer_major.coroutine()
        if coroutine is not None:  # a micro-batch of a layer-major group: the driver runs the call
            return coroutine.call(u, args, kwargs, kernel)
        return self.runner.call(u, args, kwargs, kernel)

    def head_loss(self, hidden: torch.Tensor, kernel: Any) -> torch.Tensor:
        """The loss from the final hidden states, computed by ``kernel`` in the head unit's streamed call."""
        return self.call_unit(len(self.units) - 1, (hidden,), {}, kernel)

    # ------------------------------------------------------------------ checkpoint offload
    def _available_host(self) -> int:
        """Host RAM the offloaded checkpoints may still take; unbounded under ``check_host_memory=False``
        (the OS reports less than it grants, e.g. a VM whose RAM grows on use)."""
        return host_memory.available_host_bytes() if self.plan.host.check_ram else 1 << 62

    @property
    def offload(self) -> CheckpointOffload | None:
        return self.runner.offload

    # ------------------------------------------------------------------ layer-major accumulation
    def run_layer_major(self, fns: list[Callable[[], Any]]) -> list[Any]:
        """Run micro-batch steps layer-major (see ``runtime/layer_major.py``); return their results.

        Each callable runs one micro-batch's forward and calls :meth:`backward` on its loss, like a
        training step; the backward of all of them runs once all forwards are done.
        """
        return self.layer_major.run(fns)

    def accumulate(self, loss_fns: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        """Forward + backward of several micro-batches of one optimizer step, layer-major.

        Each callable computes one micro-batch's loss, already scaled as you want it accumulated
        (e.g. divided by the number of micro-batches); the gradients of all of them are in
        ``param.grad`` when this returns, as after one ``loss.backward()`` per micro-batch.
        Returns the detached losses. Example::

            losses = engine.accumulate([lambda b=b: model(**b).loss / len(batches) for b in batches])
        """
        return self.layer_major.run([functools.partial(self.layer_major.loss_step, fn) for fn in loss_fns])

    def backward(self, loss: torch.Tensor, retain_graph: bool | None = None) -> None:
        """``loss.backward()``; inside a layer-major group, deferred to the group's one backward."""
        self.layer_major.backward(loss, retain_graph)


def _unit_forward(engine_ref: weakref.ref, u: int, *args, **kwargs) -> torch.Tensor:
    """A streamed unit's ``forward`` (installed as an instance attribute of the real unit)."""
    return engine_ref().call_unit(u, args, kwargs)


def attach(model: nn.Module, config: MegaTrainConfig | None = None, *, device: torch.device | str | None = None,
           bf16: bool = False, streams=None, frozen_in_wire_dtype: bool | None = None) -> Engine:
    """Attach the engine to ``model`` (on the CPU, fp32 masters) and return its handle.

    ``device``/``bf16`` are what the Trainer would use (its ``args.device`` and ``args.bf16``);
    ``config`` overrides them. Attaching twice raises; ``handle.detach()`` undoes everything but
    the parameters' new home in host flats. ``streams``: for tests, ``core.streams.EmulatedStreams()``
    runs the CUDA transfer pipelines on the CPU. ``frozen_in_wire_dtype``: frozen weights stored in
    the wire dtype (bf16 matrices: half the bytes; rounded once on the host), or as they are (fp32,
    rounded on the device; for weights edited in place or written by a checkpoint). ``None``: in the
    wire dtype for a PEFT model (its checkpoints hold the adapters, not the frozen base) and as they are
    otherwise, so that ``save_model`` / ``state_dict`` write a partly frozen model's frozen weights
    bit-equal to plain training's.
    """
    config = config or MegaTrainConfig()
    if engine_of(model) is not None:
        raise UsageError("megatrain is already attached to this model; call handle.detach() first.")
    check_fp32(model)
    dev = config.resolve_device(torch.device(device) if device is not None else None)
    if frozen_in_wire_dtype is None:
        frozen_in_wire_dtype = hasattr(model, "peft_config")
    return Engine(model, config, dev, config.resolve_dtype(trainer_bf16=bf16), streams=streams,
                  frozen_in_wire_dtype=frozen_in_wire_dtype)


def load(path, config: MegaTrainConfig | None = None, *, device: torch.device | str | None = None, bf16: bool = False,
         **model_kwargs: Any) -> tuple[nn.Module, Engine]:
    """``(model, engine)``: the model of a ``save_pretrained`` folder, attached, its weights read from
    the files straight into the host store (``megatrain_hf.from_pretrained`` + :func:`attach`).

    For hand-written loops; with a Trainer, give it ``megatrain_hf.from_pretrained(path)`` (the
    plugin attaches). ``model_kwargs`` (``attn_implementation``, ...) go to ``from_pretrained``.
    """
    from .models.loading import from_pretrained

    model = from_pretrained(path, **model_kwargs)
    return model, attach(model, config, device=device, bf16=bf16)


def gather_state_dict(model: nn.Module, dst: int = 0) -> dict | None:
    """``model``'s full ``state_dict`` on rank ``dst`` under megatrain's data parallelism (None on the other
    ranks; every rank must call it); the plain ``state_dict()`` of a model megatrain is not attached to."""
    engine = engine_of(model)
    return engine.gather_state_dict(dst) if engine is not None else model.state_dict()


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

"""``MegaTrainPlugin``: the callback that makes a Trainer train with megatrain.

Passed in ``callbacks=`` (or ``plugins=``), it attaches the engine before ``Trainer.__init__``
moves the model (``install.py``), installs the per-instance overrides (``overrides.py``) and then
acts at Trainer's events. It sits first in the Trainer's callback list, so that

* its ``on_log`` adds the ``megatrain/*`` metrics to what the reporters (console, TensorBoard, W&B)
  receive after Trainer has recorded the log in ``state.log_history``: the checkpointed
  ``trainer_state.json`` is the same as without megatrain;
* what other callbacks see at ``on_pre_optimizer_step``, ``on_optimizer_step`` and
  ``on_step_end`` is what plain Trainer shows them: when a callback that is not Trainer's own
  overrides one of those events, the gradients are clipped before the first and the background
  update is waited for before the others (the overlap is given up for that run; logged once).

A model attached by one Trainer can be given to another: the new Trainer reuses the engine when
its options are the same, else the engine is detached and attached again. The model stays
attached after training (evaluation and ``generate()`` keep streaming) until
``megatrain_hf.engine_of(model).detach()``.
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref
from dataclasses import replace
from typing import Any, Callable

import torch
from transformers import TrainerCallback

from ...errors import IncompatibleOptionsError, MegatrainConfigError
from ...config import MegaTrainConfig
from ...core.patcher import Patcher
from ...engine import Engine, attach, engine_of
from ...plan import Run, check
from ...stats import Metrics
from . import overrides
from ..reach import record_attached
from .saving import host_adamw
from .init_wrap import install

logger = logging.getLogger(__name__)


NOT_OBSERVING = frozenset({"trl.trainer.callbacks.RichProgressCallback"})
"""Callbacks of other libraries whose step events read no parameter or gradient (read in their source).
A forward through the model needs no entry: every unit's fetch waits for that unit's update."""


class MegaTrainPlugin(TrainerCallback):
    """Train the Trainer's model with megatrain.

    Example::

        from megatrain_hf import MegaTrainPlugin
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[MegaTrainPlugin()])
        # or, as the design card writes it:
        trainer = Trainer(model=model, args=args, train_dataset=ds, plugins=[MegaTrainPlugin()])
    """

    def __init__(self, config: MegaTrainConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError("pass either a MegaTrainConfig or keyword options, not both")
        install()
        self.config = config if config is not None else MegaTrainConfig(**options)
        self.patcher = Patcher()  # the overrides of the Trainer this plugin is bound to
        self.metrics = Metrics(self.config.metrics)
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite gradient norm
        self.step_group = None  # the optimizer step's micro-batches (layer_major.py)
        self.step_microbatches = 0
        self._trainer: weakref.ref | None = None
        self._engine: Engine | None = None
        self._fresh: Engine | None = None  # the engine attach_to built last (not a reused one)
        self.references: list[Engine] = []  # frozen models streamed beside the policy (TRL's reference)
        self._logged: set[str] = set()

    @property
    def engine(self) -> Engine | None:
        """The engine of the bound Trainer's model (the last one attached, under ``model_init``)."""
        trainer = self._trainer() if self._trainer is not None else None
        found = engine_of(trainer.model) if trainer is not None and trainer.model is not None else None
        return found if found is not None else self._engine

    # ------------------------------------------------------------------ attach
    def check_args(self, args) -> None:
        """Refuse TrainingArguments that cannot work with a streamed model, saying what to do."""
        from ..refusals import check_precision_and_sharding

        check_precision_and_sharding(fp16=args.fp16, deepspeed=getattr(args, "deepspeed", None),
                                     fsdp=getattr(args, "fsdp", None))
        if getattr(args, "fp16_full_eval", False) or getattr(args, "bf16_full_eval", False):
            raise IncompatibleOptionsError(
                "TrainingArguments(bf16_full_eval/fp16_full_eval=True) would cast the host-resident fp32 "
                "masters in place. Unset it: with bf16=True megatrain already evaluates with bf16 weights."
            )
        if getattr(args, "torch_compile", False) and not self.config.compile:
            # regional compilation of the streamed layers instead of the whole model (runtime/compiled.py)
            self.config = replace(self.config, compile=True,
                                  compile_backend=getattr(args, "torch_compile_backend", None) or "inductor",
                                  compile_mode=getattr(args, "torch_compile_mode", None))
        if getattr(args, "use_liger_kernel", False):
            _liger_without_fused_head(args)
        check(self.config, run=Run(bf16=bool(args.bf16), grad_accum=args.gradient_accumulation_steps))
        if getattr(args, "n_gpu", 1) > 1:
            logger.info("megatrain drives one GPU per process; not using DataParallel over %d GPUs", args.n_gpu)
            args._n_gpu = 1

    def attach_to(self, model, args) -> Engine:
        """Attach the engine to ``model`` (or reuse the one attached with the same options)."""
        if model is None:
            raise MegatrainConfigError("megatrain needs `model=` (a causal LM on the CPU) or `model_init=`.")
        self.check_args(args)
        device = self.config.resolve_device(args.device)
        dtype = self.config.resolve_dtype(trainer_bf16=bool(args.bf16))
        existing = engine_of(model)
        if existing is not None and existing.matches(self.config, device, dtype):
            logger.info("megatrain: this model is attached already with the same options; the engine is reused")
            self._engine = existing
            return existing
        if existing is not None:
            logger.info("megatrain: this model was attached with other options; detaching and attaching again")
            existing.detach()
        self._engine = attach(model, self.config, device=args.device, bf16=bool(args.bf16))
        self._fresh = self._engine
        return self._engine

    def attach_reference(self, model, args) -> bool:
        """Attach a frozen model that is evaluated beside the trained one (TRL's reference or reward
        model); returns False (leave it to Accelerate) for a model megatrain cannot stream."""
        from ...models.families import FAMILIES, unwrap

        if not isinstance(model, torch.nn.Module) or model is self.engine.model:
            return False
        if engine_of(model) is not None:
            return True  # attached already: nothing to move
        config = getattr(unwrap(model), "config", None)
        if getattr(config, "model_type", None) not in FAMILIES:
            return False
        model.requires_grad_(False)  # evaluated under no_grad: no master, gradient or optimizer state
        # a reference synchronised with the policy (TRL's sync_ref_model) is edited in place: kept in fp32,
        # as plain training keeps it; else in the wire dtype (2 B/param for bf16 matrices)
        edited = bool(getattr(args, "sync_ref_model", False))
        self.references.append(attach(model, self.config, device=args.device, bf16=bool(args.bf16),
                                      frozen_in_wire_dtype=not edited))
        logger.info("megatrain: %s is streamed as a frozen reference (%.2f GiB host, wire dtype)",
                    type(unwrap(model)).__name__, self.references[-1].store.host_bytes() / 2**30)
        return True

    def attaching(self, model_init: Callable, args) -> Callable:
        """``model_init`` whose every model is attached (Trainer reads its arity: it is kept)."""
        if len(inspect.signature(model_init).parameters) == 0:
            def init():
                model = model_init()
                self.attach_to(model, args)
                return model
        else:
            def init(trial):
                model = model_init(trial)
                self.attach_to(model, args)
                return model
        return init

    def release(self, engine: Engine | None) -> None:
        """``Trainer.__init__`` failed: detach what this plugin attached for it (not a reused engine)."""
        if engine is not None and self._fresh is engine:
            engine.detach()

    def bind(self, trainer) -> None:
        """Install the per-instance overrides of ``trainer`` and go first among its callbacks."""
        self.patcher = Patcher()
        self._trainer = weakref.ref(trainer)
        overrides.install(self.patcher, self, trainer)
        callbacks = trainer.callback_handler.callbacks
        callbacks.remove(self)
        callbacks.insert(0, self)
        record_attached(type(trainer).__name__)
        if getattr(trainer.args, "process_index", 0) == 0:
            announce(self.engine, trainer)

    # ------------------------------------------------------------------ helpers for the overrides
    def log_once(self, level: int, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            logger.log(level, message)

    def observers(self, trainer, *events: str) -> list[str]:
        """Callbacks that could read parameters or gradients at one of ``events``: those overriding it,
        except Trainer's own, this plugin, those known to read neither (``NOT_OBSERVING``), and those
        whose class says so with ``megatrain_observes_weights = False`` (a timer, a progress bar)."""
        found = []
        for cb in trainer.callback_handler.callbacks:
            cls = type(cb)
            if (cb is self or cls.__module__.startswith("transformers.")
                    or f"{cls.__module__}.{cls.__qualname__}" in NOT_OBSERVING
                    or getattr(cls, "megatrain_observes_weights", True) is False):
                continue
            if any(getattr(cls, event, None) is not getattr(TrainerCallback, event) for event in events):
                found.append(cls.__name__)
        return found

    def skip_step(self, trainer, optimizer, norm: torch.Tensor) -> None:
        """inf/nan gradient norm: the optimizer skips this step (weights and AdamW state unchanged)."""
        optimizer.skip_next_step()
        self.skipped_steps += 1
        logger.warning(
            "megatrain: non-finite gradient norm (%s) at optimizer step %d: skipping this update (weights, "
            "AdamW moments and step counts unchanged; the LR schedule advances). %d step(s) skipped so far.",
            float(norm), trainer.state.global_step + 1, self.skipped_steps,
        )

    def check_forwards(self) -> None:
        """At each entry point: no forward of the model reads a streamed weight outside the units."""
        from ...models.checks import check_liger_head

        for engine in (self.engine, *self.references):
            check_liger_head(engine.model)
        self.adopt_trl_fused_head()

    def adopt_trl_fused_head(self) -> None:
        """Serve TRL's fused LM head (if the model has one) through the engine's head unit; then refuse any
        other forward of the model that holds a streamed module or parameter (``trl.check_model_forward``)."""
        from ..trl import adopt_fused_lm_head, check_model_forward

        for engine in (self.engine, *self.references):
            model = engine.model
            candidates = [c for c in (model, getattr(model, "get_base_model", lambda: None)()) if c is not None]
            for candidate in candidates:
                if adopt_fused_lm_head(engine, candidate):
                    break
            for candidate in candidates:
                check_model_forward(engine, candidate)

    # ------------------------------------------------------------------ callback events
    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.engine
        if engine is not None:
            self.metrics.start(engine)

    def on_optimizer_step(self, args, state, control, **kwargs):
        trainer = self._trainer() if self._trainer is not None else None
        engine = self.engine
        if trainer is None or engine is None:
            return
        watching = self.observers(trainer, "on_optimizer_step", "on_step_end")
        if watching:
            self.log_once(logging.INFO, f"megatrain: {', '.join(watching)} observe(s) the step's end: the optimizer "
                          "update is waited for before them (it no longer overlaps the next forward)")
            engine.synchronize()

    def on_step_end(self, args, state, control, **kwargs):
        engine = self.engine
        if engine is not None:  # max_gpu_memory: the measured peak sizes the next steps' groups
            engine.budget.observe_step(self.step_microbatches)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs:
            trainer = self._trainer() if self._trainer is not None else None
            optimizer = host_adamw(trainer) if trainer is not None and trainer.optimizer is not None else None
            logs.update(self.metrics.read(self.engine, optimizer, self.skipped_steps))

    def on_train_end(self, args, state, control, **kwargs):
        self.step_group = None
        engine = self.engine
        if engine is not None:
            engine.synchronize()  # the last update may still run in the background


def _liger_without_fused_head(args) -> None:
    """``use_liger_kernel=True``: Liger's RMSNorm, SwiGLU and rotary kernels run inside the streamed layers (Trainer
    patches the model's modules when it trains; the templates mirror them, ``core/template.py``); its fused linear
    cross-entropy, which would read ``lm_head.weight`` from host RAM, is left out: megatrain's chunked loss computes
    the same loss inside the streamed head unit (``chunked_loss``)."""
    config = dict(args.liger_kernel_config or {})
    if config.get("fused_linear_cross_entropy") is not False:
        config["fused_linear_cross_entropy"] = False
        args.liger_kernel_config = config
        logger.info("megatrain: use_liger_kernel=True: Liger's RMSNorm, SwiGLU and rotary kernels run in the streamed "
                    "layers; its fused linear cross-entropy is replaced by megatrain's chunked loss in the head unit "
                    "(liger_kernel_config['fused_linear_cross_entropy'] = False)")


def announce(engine: Engine, trainer) -> None:
    """The one line that says megatrain trains this Trainer: at WARNING level, or printed to stderr where the
    tool's logging configuration would hide it (as accelerate prints its state), so that a run under axolotl,
    LLaMA-Factory or ``trl`` shows it."""
    from importlib import metadata

    from ...models.families import unwrap

    try:
        version = metadata.version("megatrain_hf")
    except metadata.PackageNotFoundError:
        version = "(not installed)"
    line = (f"megatrain_hf {version}: {type(trainer).__name__} trains {type(unwrap(engine.model)).__name__} with "
            f"megatrain ({len(engine.units)} streamed units, {engine.store.trainable_numel() / 1e6:.1f}M trainable "
            f"parameters, {engine.store.host_bytes() / 2**30:.2f} GiB host, compute "
            f"{str(engine.compute_dtype).replace('torch.', '')} on {engine.device}); checkpoints hold its "
            "optimizer state in megatrain_optimizer/")
    if _visible(logger, logging.WARNING):
        logger.warning(line)
    else:
        print(line, file=sys.stderr, flush=True)


def _visible(log: logging.Logger, level: int) -> bool:
    """Whether a record of ``level`` on ``log`` reaches a handler that emits it (or Python's last resort)."""
    if log.disabled or not log.isEnabledFor(level):
        return False
    found = False
    current: logging.Logger | None = log
    while current is not None:
        for handler in current.handlers:
            found = True
            if handler.level <= level:
                return True
        current = current.parent if current.propagate else None
    return not found and logging.lastResort is not None and logging.lastResort.level <= level

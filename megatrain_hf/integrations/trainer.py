"""Hugging Face ``Trainer`` integration: ``MegaTrainPlugin``, ``enable()`` / ``disable()``.

``Trainer`` has no ``plugins=`` argument and its callbacks start after ``Trainer.__init__`` has
already moved the model to the GPU (too late for a model that does not fit). So importing this
module wraps ``Trainer.__init__`` once (``install()``; ``uninstall()`` restores it). The wrapper
is inert unless a :class:`MegaTrainPlugin` is passed (in ``callbacks=`` or ``plugins=``) or
``enable()`` is active: then, before the original ``__init__`` runs, it validates the
``TrainingArguments`` and attaches the engine to the model, which also gives the model a
multi-entry ``hf_device_map`` so that neither Trainer nor Accelerate moves it. After ``__init__``
the plugin overrides two methods *on that Trainer instance only*: ``create_optimizer`` (plain
AdamW becomes :class:`HostAdamW`, same math) and ``log`` (engine metrics join Trainer's logs,
hence TensorBoard/W&B). Trainer subclasses (TRL's ``SFTTrainer``) go through the same path.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import types
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ..config import MegaTrainConfig
from ..engine import Engine, attach
from ..optimizer import HostAdamW, convertible

logger = logging.getLogger(__name__)

_original_init = None
_enabled_config: MegaTrainConfig | None = None


class MegaTrainPlugin(TrainerCallback):
    """Train the Trainer's model with megatrain.

    Example::

        from megatrain_hf import MegaTrainPlugin
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[MegaTrainPlugin()])
        # or, as the design card writes it:
        trainer = Trainer(model=model, args=args, train_dataset=ds, plugins=[MegaTrainPlugin()])
    """

    def __init__(self, config: MegaTrainConfig | None = None, **overrides: Any) -> None:
        if config is not None and overrides:
            raise TypeError("pass either a MegaTrainConfig or keyword overrides, not both")
        self.config = config if config is not None else MegaTrainConfig(**overrides)
        self.engine: Engine | None = None
        self._last_log: tuple[float, int] | None = None

    # ------------------------------------------------------------------ setup
    def check_args(self, args) -> None:
        """Refuse TrainingArguments that cannot work with a streamed model, saying what to do."""
        if args.fp16:
            raise ValueError(
                "TrainingArguments(fp16=True) is not supported by megatrain (fp16 needs loss scaling of "
                "host-resident grads). Use bf16=True (Ampere or newer GPUs) or fp32."
            )
        if getattr(args, "fp16_full_eval", False) or getattr(args, "bf16_full_eval", False):
            raise ValueError(
                "TrainingArguments(bf16_full_eval/fp16_full_eval=True) would cast the host-resident fp32 "
                "masters in place. Unset it: with bf16=True megatrain already evaluates with bf16 weights."
            )
        if getattr(args, "torch_compile", False):
            raise ValueError(
                "TrainingArguments(torch_compile=True) compiles the whole model, which megatrain streams "
                "layer by layer. Unset torch_compile."
            )
        if getattr(args, "deepspeed", None):
            raise ValueError(
                "megatrain and DeepSpeed both want to own the parameters and the optimizer step; use one. "
                "Remove `deepspeed=` from TrainingArguments (or drop the MegaTrainPlugin)."
            )
        if getattr(args, "fsdp", None):
            raise ValueError(
                f"megatrain and FSDP (fsdp={args.fsdp!r}) both want to own the parameters; use one. "
                "Remove `fsdp=` from TrainingArguments (or drop the MegaTrainPlugin)."
            )
        if getattr(args, "n_gpu", 1) > 1:
            logger.info("megatrain drives one GPU per process; not using DataParallel over %d GPUs", args.n_gpu)
            args._n_gpu = 1

    def attach_to(self, model, args) -> Engine:
        if model is None:
            raise ValueError(
                "megatrain needs `model=` (a causal LM on the CPU); Trainer(model_init=...) is not supported."
            )
        self.check_args(args)
        self.engine = attach(model, self.config, device=args.device, bf16=bool(args.bf16))
        return self.engine

    def bind(self, trainer: Trainer) -> None:
        """Per-instance overrides of the trainer (the class is untouched)."""
        plugin = self
        original_create_optimizer = trainer.create_optimizer
        original_log = trainer.log

        def create_optimizer(self, model=None):
            optimizer = original_create_optimizer(model) if model is not None else original_create_optimizer()
            if plugin.config.replace_adamw and convertible(optimizer):
                self.optimizer = HostAdamW.from_optimizer(
                    optimizer,
                    plugin.engine.store,
                    exact_clipping=plugin.config.exact_clipping,
                    host_threads=plugin.engine.host_threads,
                )
                logger.info("megatrain: AdamW runs as HostAdamW on the host flats (same math)")
            return self.optimizer

        def log(self, logs: dict[str, float], *args, **kwargs):
            if "loss" in logs:
                logs.update(plugin.metrics())
            return original_log(logs, *args, **kwargs)

        original_clip = trainer._clip_grad_norm

        def _clip_grad_norm(self, model):
            # Every gradient is on the host once backward returned; clip as a scale inside the update.
            optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
            if not isinstance(optimizer, HostAdamW):
                return original_clip(model)
            norm = plugin.engine.grads.global_norm()
            coef = float(self.args.max_grad_norm) / (norm + 1e-6)  # as clip_grad_norm_ computes it
            optimizer.set_clip_coef(torch.clamp(coef, max=1.0))
            return norm

        trainer.create_optimizer = types.MethodType(create_optimizer, trainer)
        trainer.log = types.MethodType(log, trainer)
        trainer._clip_grad_norm = types.MethodType(_clip_grad_norm, trainer)
        gradient_state = trainer.accelerator.gradient_state
        self.engine.grads.final_microbatch = lambda: bool(gradient_state.sync_gradients)

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        """Engine metrics since the previous call (training logs only)."""
        engine = self.engine
        if engine is None:
            return {}
        now = time.perf_counter()
        stats = engine.stats
        last_time, _ = self._last_log or (now, 0)
        elapsed = max(now - last_time, 1e-9)
        out = {
            "megatrain/h2d_GB": stats.h2d_bytes / 1e9,
            "megatrain/d2h_GB": stats.d2h_bytes / 1e9,
            "megatrain/tokens": float(stats.tokens),
        }
        if self._last_log is not None:
            out["megatrain/tokens_per_s"] = stats.tokens / elapsed
            out["megatrain/link_GBps"] = (stats.h2d_bytes + stats.d2h_bytes) / 1e9 / elapsed
            out["megatrain/optimizer_wait_frac"] = stats.optimizer_wait_s / elapsed
            out["megatrain/grad_wait_frac"] = stats.grad_wait_s / elapsed
        try:
            import psutil

            out["megatrain/host_rss_GiB"] = psutil.Process().memory_info().rss / 2**30
        except ImportError:  # psutil is a dependency; keep metrics best-effort anyway
            pass
        if engine.device.type == "cuda":
            out["megatrain/gpu_peak_GiB"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
        stats.reset()
        self._last_log = (now, 0)
        return out

    # ------------------------------------------------------------------ callback events
    def on_train_end(self, args, state, control, **kwargs):
        if self.engine is not None:
            self.engine.synchronize()  # the last update may still run in the background

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.engine
        if engine is not None:
            self._last_log = (time.perf_counter(), 0)
            engine.stats.reset()
            logger.info(
                "megatrain: %d units (%d templates), %.1fM trainable params, %.2f GiB host buffers, "
                "pinned=%s, compute %s on %s",
                len(engine.units),
                engine.num_templates,
                engine.store.trainable_numel() / 1e6,
                engine.store.host_bytes() / 2**30,
                engine.store.pin,
                str(engine.compute_dtype).replace("torch.", ""),
                engine.device,
            )


def _find_plugin(plugins, callbacks) -> MegaTrainPlugin | None:
    found = [p for p in list(plugins or []) + list(callbacks or []) if isinstance(p, MegaTrainPlugin)]
    unique = list({id(p): p for p in found}.values())
    if len(unique) > 1:
        raise ValueError(f"got {len(unique)} MegaTrainPlugin instances; pass one.")
    return unique[0] if unique else None


def _patched_init(self, *args, **kwargs):
    plugins = kwargs.pop("plugins", None)
    for p in plugins or []:
        if not isinstance(p, MegaTrainPlugin):
            raise TypeError(
                f"Trainer(plugins=...) accepts MegaTrainPlugin instances (added by megatrain_hf), got "
                f"{type(p).__name__}. Pass callbacks through callbacks=."
            )
    params = inspect.signature(_original_init).bind_partial(self, *args, **kwargs).arguments
    params.pop("self")
    plugin = _find_plugin(plugins, params.get("callbacks"))
    if plugin is None and _enabled_config is not None:
        plugin = MegaTrainPlugin(_enabled_config)
    if plugin is None:
        return _original_init(self, *args, **kwargs)

    callbacks = list(params.get("callbacks") or [])
    if not any(c is plugin for c in callbacks):
        callbacks.append(plugin)
    params["callbacks"] = callbacks
    if params.get("args") is None:
        from transformers import TrainingArguments

        params["args"] = TrainingArguments(output_dir="tmp_trainer")
    engine = plugin.attach_to(params.get("model"), params["args"])
    try:
        _original_init(self, **params)
    except BaseException:
        engine.detach()
        raise
    plugin.bind(self)


def install() -> None:
    """Wrap ``Trainer.__init__`` (idempotent). Inert for Trainers built without megatrain."""
    global _original_init
    if _original_init is not None:
        return
    _original_init = Trainer.__init__
    Trainer.__init__ = functools.wraps(_original_init)(_patched_init)


def uninstall() -> None:
    """Restore the original ``Trainer.__init__``."""
    global _original_init
    if _original_init is None:
        return
    Trainer.__init__ = _original_init
    _original_init = None


def enable(config: MegaTrainConfig | None = None, **overrides: Any) -> None:
    """Every ``Trainer`` built from now on trains with megatrain (notebooks, scripts you do not edit)."""
    global _enabled_config
    if config is not None and overrides:
        raise TypeError("pass either a MegaTrainConfig or keyword overrides, not both")
    install()
    _enabled_config = config if config is not None else MegaTrainConfig(**overrides)


def disable() -> None:
    """Stop attaching megatrain to new Trainers (already attached models stay attached)."""
    global _enabled_config
    _enabled_config = None


def is_enabled() -> bool:
    return _enabled_config is not None


install()

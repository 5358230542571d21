"""Hugging Face ``Trainer`` integration: ``MegaTrainPlugin``, ``enable()`` / ``disable()``.

``Trainer`` has no ``plugins=`` argument and its callbacks start after ``Trainer.__init__`` has
already moved the model to the GPU (too late for a model that does not fit). So importing this
module wraps ``Trainer.__init__`` once (``install()``; ``uninstall()`` restores it). The wrapper
is inert unless a :class:`MegaTrainPlugin` is passed (in ``callbacks=`` or ``plugins=``) or
``enable()`` is active: then, before the original ``__init__`` runs, it validates the
``TrainingArguments`` and attaches the engine to the model, which also gives the model a
multi-entry ``hf_device_map`` so that neither Trainer nor Accelerate moves it. After ``__init__``
the plugin overrides methods *on that Trainer instance only*: ``create_optimizer`` (plain
AdamW becomes :class:`HostAdamW`, same math), ``log`` (engine metrics join Trainer's logs,
hence TensorBoard/W&B), ``_clip_grad_norm`` (clipping inside the host update; a non-finite norm
skips the step), ``_save_checkpoint`` (atomic: written into a hidden staging folder, then renamed)
and ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler`` (HostAdamW's state as
one safetensors file per unit, see :mod:`megatrain_hf.checkpoint`). Trainer subclasses (TRL's
``SFTTrainer``) go through the same path.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import pickle
import shutil
import time
import types
import warnings
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ..checkpoint import (
    OPTIMIZER_DIR,
    atomic_write,
    fsync_path,
    fsync_tree,
    has_sharded_optimizer,
    load_optimizer,
    save_optimizer,
)
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
        self._alloc_retries: int | None = None  # CUDA allocator retries at the previous log
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite gradient norm (HostAdamW)
        self._step_group: _StepGroup | None = None  # the optimizer step's micro-batches (layer-major)
        self._step_microbatches = 0
        self._logged: set[str] = set()

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
                    kernel=plugin.config.resolve_host_adamw_kernel(plugin.engine.device),
                    device_update=plugin.config.device_update,
                    # the device's units keep their gradients on the GPU, unless a GPU budget has no room planned for them
                    grad_sink=plugin.engine.grads if plugin.engine.gpu_budget is None else None,
                    stats=plugin.engine.stats,
                )
                logger.info("megatrain: AdamW runs as HostAdamW on the host flats (same math)")
            return self.optimizer

        def log(self, logs: dict[str, float], *args, **kwargs):
            if "loss" in logs:
                logs.update(plugin.metrics(_host_adamw(self)))
            return original_log(logs, *args, **kwargs)

        original_clip = trainer._clip_grad_norm

        def _clip_grad_norm(self, model):
            # Every gradient is on the host once backward returned; clip as a scale inside the update.
            optimizer = _host_adamw(self)
            if optimizer is None:
                return original_clip(model)
            norm = plugin.engine.grads.global_norm()
            if plugin._skip_if_not_finite(self, optimizer, norm):
                return norm
            coef = float(self.args.max_grad_norm) / (norm + 1e-6)  # as clip_grad_norm_ computes it
            optimizer.set_clip_coef(torch.clamp(coef, max=1.0))
            return norm

        original_get_grad_norm = getattr(trainer, "_get_grad_norm", None)

        def _get_grad_norm(self, model, grad_norm=None):
            # max_grad_norm=0: Trainer only measures the norm; a non-finite one still skips the step.
            optimizer = _host_adamw(self)
            if grad_norm is not None or optimizer is None:
                return original_get_grad_norm(model, grad_norm=grad_norm)
            grad_norm = plugin.engine.grads.global_norm()
            plugin._skip_if_not_finite(self, optimizer, grad_norm)
            return grad_norm

        original_save_checkpoint = trainer._save_checkpoint
        original_get_output_dir = trainer._get_output_dir
        original_save_opt = trainer._save_optimizer_and_scheduler
        original_load_opt = trainer._load_optimizer_and_scheduler

        def _save_checkpoint(self, model, trial):
            return _staged_save_checkpoint(self, original_save_checkpoint, original_get_output_dir, model, trial)

        def _save_optimizer_and_scheduler(self, output_dir):
            optimizer = _host_adamw(self)
            if optimizer is None or not self.args.should_save:
                return original_save_opt(output_dir)
            save_optimizer(optimizer, os.path.join(output_dir, OPTIMIZER_DIR))
            _save_scheduler(self, output_dir)

        def _load_optimizer_and_scheduler(self, checkpoint):
            sharded = checkpoint is not None and has_sharded_optimizer(checkpoint)
            try:
                return _load_sharded(self, checkpoint) if sharded else original_load_opt(checkpoint)
            except pickle.UnpicklingError as exc:  # torch.load(weights_only=True) met code or a foreign class
                files = SCHEDULER_NAME if sharded else f"{OPTIMIZER_NAME} or {SCHEDULER_NAME}"
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise RuntimeError(
                    f"megatrain: refused to load {files} of {checkpoint}: it holds pickled objects other than "
                    "tensors and plain containers, which could run code (torch.load(weights_only=True) refused "
                    f"it: {first}). Resume only from checkpoints you trust; nothing from the file was executed."
                ) from exc

        original_get_batch_samples = trainer.get_batch_samples
        original_training_step = trainer.training_step

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            # Trainer fetches an optimizer step's micro-batches up front: remember them (layer-major)
            batches, num_items = original_get_batch_samples(epoch_iterator, num_batches, device)
            plugin._step_group = _StepGroup(batches, num_items) if len(batches) > 1 else None
            plugin._step_microbatches = len(batches)
            plugin.engine.in_flight = 1  # micro-batch by micro-batch unless a layer-major group runs
            return batches, num_items

        def training_step(self, model, inputs, num_items_in_batch=None):
            group = plugin._step_group
            index = group.index(inputs) if group is not None else None
            if index is None:
                return original_training_step(model, inputs, num_items_in_batch)
            if group.results is None:
                if not plugin._layer_major_applies(self):
                    plugin._step_group = None
                    return original_training_step(model, inputs, num_items_in_batch)
                group.results = plugin._run_layer_major(self, model, group, original_training_step)
            if index == len(group.batches) - 1:
                plugin._step_group = None  # drop the references to the step's batches
            return group.results[index]

        original_get_train_dataloader = trainer.get_train_dataloader

        def get_train_dataloader(self):
            # Trainer's own message for this is the sampler's "num_samples should be a positive integer"
            from transformers.trainer_utils import has_length

            dataset = self.train_dataset
            if dataset is not None and has_length(dataset) and len(dataset) == 0:
                raise ValueError(
                    f"megatrain: train_dataset ({type(dataset).__name__}) is empty: 0 examples to train on. "
                    "Fix: check the split and the filtering / packing that built it (e.g. examples longer than "
                    "max_length dropped, a wrong split name)."
                )
            return original_get_train_dataloader()

        def adopting(name: str) -> None:
            # TRL's SFTTrainer adds its fused LM head after Trainer.__init__ (so after the plugin
            # attached), and accelerate wraps the forward when training starts: take it over in between
            original = getattr(trainer, name)

            def method(self, *args, **kwargs):
                plugin._adopt_trl_fused_head()
                return original(*args, **kwargs)

            setattr(trainer, name, types.MethodType(method, trainer))

        for name in ("train", "evaluate", "predict"):
            adopting(name)
        trainer.get_train_dataloader = types.MethodType(get_train_dataloader, trainer)
        trainer.get_batch_samples = types.MethodType(get_batch_samples, trainer)
        trainer.training_step = types.MethodType(training_step, trainer)
        trainer.create_optimizer = types.MethodType(create_optimizer, trainer)
        trainer.log = types.MethodType(log, trainer)
        trainer._clip_grad_norm = types.MethodType(_clip_grad_norm, trainer)
        if original_get_grad_norm is not None:  # transformers 5.17 and 5.24 have it
            trainer._get_grad_norm = types.MethodType(_get_grad_norm, trainer)
        trainer._save_checkpoint = types.MethodType(_save_checkpoint, trainer)
        trainer._save_optimizer_and_scheduler = types.MethodType(_save_optimizer_and_scheduler, trainer)
        trainer._load_optimizer_and_scheduler = types.MethodType(_load_optimizer_and_scheduler, trainer)
        if plugin.config.chunked_loss == "auto" and type(trainer) is Trainer:
            # plain Trainer reads only the loss of a training forward; subclasses may read logits
            self.engine.chunked_loss_active = self._chunked_loss_installed()
        accelerator = trainer.accelerator
        original_prepare_optimizer = accelerator.prepare_optimizer

        def prepare_optimizer(optimizer, device_placement=None):
            # HostAdamW's state lives in the host store. With device placement, accelerate copies
            # the whole state to the GPU and loads it back (measured at 3.14 B: +23 GiB of host
            # RSS and as much GPU memory, 30 s, at the start of training).
            if isinstance(optimizer, HostAdamW):
                device_placement = False
            return original_prepare_optimizer(optimizer, device_placement=device_placement)

        accelerator.prepare_optimizer = prepare_optimizer
        gradient_state = accelerator.gradient_state
        self.engine.grads.final_microbatch = lambda: bool(gradient_state.sync_gradients)

    def _chunked_loss_installed(self) -> bool:
        from ..adapters import unwrap

        base = unwrap(self.engine.model)
        return "forward" in vars(base) and type(self.engine.units[-1].module) is torch.nn.Linear

    # ------------------------------------------------------------------ layer-major accumulation
    def _layer_major_applies(self, trainer) -> bool:
        """Whether this step's micro-batches run layer-major (logged once per reason)."""
        mode = self.config.layer_major
        if mode is False:
            return False
        from accelerate.utils import DistributedType

        accelerator = trainer.accelerator
        blockers = []
        if accelerator.distributed_type != DistributedType.NO:
            blockers.append(f"accelerator distributed_type={accelerator.distributed_type}")
        if accelerator.scaler is not None:
            blockers.append("a gradient scaler is active")
        if "lomo" in str(getattr(trainer.args.optim, "value", trainer.args.optim)).lower():
            blockers.append(f"optim={trainer.args.optim} needs the learning rate inside backward")
        if mode == "auto":
            dropout = self.engine.active_dropout()
            if dropout:
                blockers.append(
                    f"the model has active dropout ({', '.join(dropout[:3])}{', ...' if len(dropout) > 3 else ''}), "
                    "whose random masks would be drawn in another order than plain Trainer's; "
                    "MegaTrainConfig(layer_major=True) accepts that"
                )
        if blockers:
            self._log_once(
                logging.WARNING if mode is True else logging.INFO,
                "megatrain: gradient accumulation runs micro-batch by micro-batch (not layer-major): "
                + "; ".join(blockers),
            )
            return False
        self._log_once(
            logging.INFO,
            "megatrain: layer-major gradient accumulation (each layer computes all micro-batches of a step, "
            "uploaded once per direction, gradients summed on the device)",
        )
        return True

    def _log_once(self, level: int, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            logger.log(level, message)

    def _run_layer_major(self, trainer, model, group: "_StepGroup", training_step) -> list:
        """Trainer's own ``training_step`` for every micro-batch of the step, interleaved per layer.

        ``accelerator.backward`` is routed to the engine for the duration: inside a micro-batch it
        scales the loss as Accelerate does and defers it to the step's one backward pass.
        """
        from ..layer_major import current

        engine = self.engine
        accelerator = trainer.accelerator
        original_backward = accelerator.backward

        def backward(loss, **kwargs):
            if current(engine) is None:
                return original_backward(loss, **kwargs)
            unknown = sorted(set(kwargs) - {"retain_graph"})
            if unknown:
                raise ValueError(
                    f"megatrain layer-major accumulation got accelerator.backward(loss, {', '.join(unknown)}=...), "
                    "which it cannot defer. Set MegaTrainConfig(layer_major=False)."
                )
            engine.backward(loss / accelerator.gradient_accumulation_steps, **kwargs)

        missing = object()
        previous = accelerator.__dict__.get("backward", missing)
        accelerator.__dict__["backward"] = backward
        try:
            steps = [functools.partial(training_step, model, batch, group.num_items) for batch in group.batches]
            in_flight = engine.microbatches_in_flight(len(steps))  # max_gpu_memory: fewer at a time
            engine.in_flight = in_flight
            results = []
            for start in range(0, len(steps), in_flight):
                results.extend(engine.run_layer_major(steps[start : start + in_flight]))
            return results
        finally:
            if previous is missing:
                accelerator.__dict__.pop("backward", None)
            else:
                accelerator.__dict__["backward"] = previous

    def _skip_if_not_finite(self, trainer, optimizer: HostAdamW, norm: torch.Tensor) -> bool:
        """inf/nan gradient norm: the optimizer skips this step (weights and AdamW state unchanged)."""
        if bool(torch.isfinite(norm)):
            return False
        optimizer.skip_next_step()
        self.skipped_steps += 1
        logger.warning(
            "megatrain: non-finite gradient norm (%s) at optimizer step %d: skipping this update (weights, "
            "AdamW moments and step counts unchanged; the LR schedule advances). %d step(s) skipped so far.",
            float(norm),
            trainer.state.global_step + 1,
            self.skipped_steps,
        )
        return True

    # ------------------------------------------------------------------ metrics
    def metrics(self, optimizer: HostAdamW | None = None) -> dict[str, float]:
        """Engine (and host optimizer) metrics since the previous call (training logs only)."""
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
            "megatrain/update_link_GB": (stats.update_h2d_bytes + stats.update_d2h_bytes) / 1e9,
            "megatrain/tokens": float(stats.tokens),
            "megatrain/skipped_steps": float(self.skipped_steps),
        }
        if self._last_log is not None:
            out["megatrain/tokens_per_s"] = stats.tokens / elapsed
            link = stats.h2d_bytes + stats.d2h_bytes + stats.update_h2d_bytes + stats.update_d2h_bytes
            out["megatrain/link_GBps"] = link / 1e9 / elapsed
            out["megatrain/optimizer_wait_frac"] = stats.optimizer_wait_s / elapsed
            out["megatrain/grad_wait_frac"] = stats.grad_wait_s / elapsed
            out["megatrain/tflops"] = stats.useful_flops / elapsed / 1e12  # 6PT + 12LHST, no recompute
            if engine.in_flight is not None:
                out["megatrain/microbatches_in_flight"] = float(engine.in_flight)
            if stats.fetches:
                out["megatrain/h2d_not_ready_frac"] = stats.fetches_not_ready / stats.fetches
            if engine.device.type == "cuda":  # compute stream stalled on uploads (events), exposed H2D
                out["megatrain/h2d_wait_frac"] = engine.streamer.exposed_wait_s() / elapsed
            if stats.grad_stream_busy_s > 0:  # the link's effective rate while the grad stream copied
                out["megatrain/grad_stream_GBps_busy"] = stats.grad_stream_bytes / 1e9 / stats.grad_stream_busy_s
        if optimizer is not None:  # the host update's own time, hidden or not, and its rate
            update_s, updated = optimizer.take_update_stats()
            on_device = optimizer.take_device_numel()
            if optimizer.device_update and updated + on_device > 0:
                out["megatrain/update_device_frac"] = on_device / (updated + on_device)
            if self._last_log is not None and update_s > 0:
                out["megatrain/update_frac"] = update_s / elapsed
                out["megatrain/update_Gparams_per_s"] = updated / update_s / 1e9
        try:
            import psutil

            out["megatrain/host_rss_GiB"] = psutil.Process().memory_info().rss / 2**30
        except ImportError:  # psutil is a dependency; keep metrics best-effort anyway
            pass
        if engine.device.type == "cuda":  # max_gpu_memory resets the statistics while it measures
            peak = max(torch.cuda.max_memory_allocated(engine.device), engine.max_peak_allocated)
            out["megatrain/gpu_peak_GiB"] = peak / 2**30
            # allocations that failed, emptied the allocator's cache (a device synchronisation) and
            # retried: a step that keeps doing this runs at the memory cap, slowly
            retries = int(torch.cuda.memory_stats(engine.device).get("num_alloc_retries", 0))
            if self._alloc_retries is not None:
                out["megatrain/alloc_retries"] = float(retries - self._alloc_retries)
            self._alloc_retries = retries
        stats.reset()
        self._last_log = (now, 0)
        return out

    def _adopt_trl_fused_head(self) -> None:
        """Serve TRL's fused LM head (if the model has one) through the engine's head unit."""
        from .trl import adopt_fused_lm_head

        model = self.engine.model
        for candidate in (model, getattr(model, "get_base_model", lambda: None)()):
            if candidate is not None and adopt_fused_lm_head(self.engine, candidate):
                return

    # ------------------------------------------------------------------ callback events
    def on_step_end(self, args, state, control, **kwargs):
        if self.engine is not None:  # max_gpu_memory: the measured peak sizes the next steps' groups
            self.engine.observe_step(self._step_microbatches)

    def on_train_end(self, args, state, control, **kwargs):
        self._step_group = None
        if self.engine is not None:
            self.engine.synchronize()  # the last update may still run in the background

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.engine
        if engine is not None:
            engine.check_trainability()
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


class _StepGroup:
    """The micro-batches of one optimizer step, as ``get_batch_samples`` returned them."""

    def __init__(self, batches: list, num_items) -> None:
        self.batches = batches
        self.num_items = num_items
        self.results: list | None = None

    def index(self, inputs) -> int | None:
        return next((i for i, batch in enumerate(self.batches) if batch is inputs), None)


def _host_adamw(trainer) -> HostAdamW | None:
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return optimizer if isinstance(optimizer, HostAdamW) else None


# ---------------------------------------------------------------------------------- checkpoints
OPTIMIZER_NAME = "optimizer.pt"  # Trainer's names (transformers.trainer), the same in 5.17 and 5.24
SCHEDULER_NAME = "scheduler.pt"
TRAINER_STATE_NAME = "trainer_state.json"
_STAGING = ".{name}.tmp-{pid}"  # hidden: Trainer's globs (checkpoint-*) never see a folder being written


def _save_scheduler(trainer, output_dir: str) -> None:
    """The LR scheduler exactly as Trainer saves it (torch.save of its state_dict), written atomically."""
    from transformers.trainer_pt_utils import reissue_pt_warnings

    state = trainer.lr_scheduler.state_dict()
    with warnings.catch_warnings(record=True) as caught_warnings:
        atomic_write(os.path.join(output_dir, SCHEDULER_NAME), lambda tmp: torch.save(state, tmp))
    reissue_pt_warnings(caught_warnings)


def _load_sharded(trainer, checkpoint: str) -> None:
    """Trainer's ``_load_optimizer_and_scheduler`` for a checkpoint holding HostAdamW's shards."""
    optimizer = _host_adamw(trainer)
    folder = os.path.join(checkpoint, OPTIMIZER_DIR)
    if optimizer is None:
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        raise ValueError(
            f"{folder} holds megatrain's per-unit HostAdamW state, but this Trainer's optimizer is "
            f"{type(inner).__name__}. Resume with MegaTrainPlugin(replace_adamw=True) (the default) and "
            "the AdamW optimizer, or convert the folder with megatrain_hf.checkpoint.to_torch_state_dict()."
        )
    scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
    if not os.path.isfile(scheduler_file):  # Trainer loads neither unless both exist
        logger.warning("megatrain: %s has no %s; optimizer and scheduler state not loaded", checkpoint, SCHEDULER_NAME)
        return
    load_optimizer(optimizer, folder)
    from transformers.trainer_pt_utils import reissue_pt_warnings

    with warnings.catch_warnings(record=True) as caught_warnings:
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
    reissue_pt_warnings(caught_warnings)


def _remove_stale_staging(run_dir: str) -> None:
    """Remove staging folders left by processes that were killed while saving (not by live ones)."""
    import psutil

    try:
        names = os.listdir(run_dir)
    except OSError:
        return
    for name in names:
        if not (name.startswith(".checkpoint-") and ".tmp-" in name):
            continue
        pid = name.rsplit(".tmp-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid() or psutil.pid_exists(int(pid)):
            continue  # ours, or that process still runs
        logger.info("megatrain: removing %s, left by an interrupted checkpoint save", name)
        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def _staged_save_checkpoint(trainer, original_save, original_get_output_dir, model, trial) -> None:
    """Trainer's ``_save_checkpoint``, made atomic: a checkpoint folder appears only when complete.

    Trainer writes straight into ``checkpoint-N`` (5.17 and 5.24), so a process killed while saving
    leaves a partial folder that ``get_last_checkpoint`` and ``resume_from_checkpoint=True`` pick up.
    Here Trainer's own ``_save_checkpoint`` runs unchanged but with its run directory pointed at a
    hidden staging folder ``.checkpoint-N.tmp-<pid>``; everything it wrote is fsync'ed, then renamed
    to ``checkpoint-N`` (one atomic rename), and what Trainer does with the run directory (the best
    checkpoint's path, rotation under ``save_total_limit``) is redone on the real one.
    """
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    args = trainer.args
    if args.push_to_hub or not args.should_save:  # the hub upload reads the folder in the background
        return original_save(model, trial)
    run_dir = original_get_output_dir(trial=trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    final = os.path.join(run_dir, name)
    staging_root = os.path.join(run_dir, _STAGING.format(name=name, pid=os.getpid()))
    os.makedirs(run_dir, exist_ok=True)
    _remove_stale_staging(run_dir)
    shutil.rmtree(staging_root, ignore_errors=True)
    os.makedirs(staging_root)
    staged = os.path.join(staging_root, name)
    missing = object()
    previous = trainer.__dict__.get("_get_output_dir", missing)
    trainer.__dict__["_get_output_dir"] = lambda trial=None: staging_root
    try:
        original_save(model, trial)
    except BaseException:
        shutil.rmtree(staging_root, ignore_errors=True)
        raise
    finally:
        if previous is missing:
            trainer.__dict__.pop("_get_output_dir", None)
        else:
            trainer.__dict__["_get_output_dir"] = previous

    # Trainer looked for the best checkpoint in the staging root; redo it on the run directory.
    state = trainer.state
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy in ("steps", "epoch", "best") and state.best_global_step:
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if state.best_global_step == state.global_step or os.path.exists(best):
            state.best_model_checkpoint = best
    if os.path.isfile(os.path.join(staged, TRAINER_STATE_NAME)):
        state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))

    fsync_tree(staging_root)
    trash = None
    if os.path.exists(final):  # saving the same step again (e.g. after resuming from an earlier one)
        trash = os.path.join(run_dir, _STAGING.format(name=name + ".old", pid=os.getpid()))
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(staged, final)  # the commit point
    fsync_path(run_dir)
    shutil.rmtree(staging_root, ignore_errors=True)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    rotate_checkpoints(
        output_dir=run_dir,
        save_total_limit=args.save_total_limit,
        best_model_checkpoint=state.best_model_checkpoint,
        use_mtime=True,
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

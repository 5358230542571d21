"""The per-instance overrides a Trainer with megatrain gets (the class is untouched).

Public hooks where they exist:

* ``create_optimizer``: a plain AdamW that Trainer builds becomes :class:`HostAdamW` with the same
  groups and hyper-parameters (same math; the LR scheduler Trainer creates next drives it). An
  optimizer passed in ``optimizers=(opt, scheduler)`` stays bound to its scheduler: it is kept,
  and steps the host parameters synchronously after backward (logged).
* ``train`` / ``evaluate`` / ``predict``: TRL's fused LM head is taken over first (TRL adds it
  after ``Trainer.__init__``); ``train`` refuses an empty dataset with a clear message.
* ``accelerator.clip_grad_norm_`` (Trainer's clipping and gradient-norm logging both call it):
  ``Engine.clip_grad_norm_`` -- the global norm from the per-unit norms the gradient sink computed;
  with HostAdamW the clip is a multiply inside the background update (exactly ``clip_grad_norm_``'s
  multiply), or applied to the gradients at once when a callback could observe them (it overrides
  ``on_pre_optimizer_step`` or ``on_optimizer_step``). A non-finite norm skips the update.
* ``accelerator.prepare_optimizer``: HostAdamW's state is not copied to the device and back.
* ``accelerator.prepare_model(..., evaluation_mode=True)`` (how TRL prepares its reference and reward
  models): a model of a supported family is attached frozen and streamed like the policy, instead
  of being moved whole to the device.

Checkpoint and layer-major overrides live in ``checkpoints.py`` and ``layer_major.py``.
"""

from __future__ import annotations

import logging

import torch
from accelerate.utils import DynamoBackend
from transformers import Trainer

from ...errors import IncompatibleOptionsError, TrainingDataError
from ...core.patcher import Patcher
from ...engine import engine_of
from ...optim.host_adamw import HostAdamW, convertible
from ...plan import OptimizerChoice, Run
from ...plan import check as check_plan
from . import saving as checkpoints
from . import distributed
from . import layer_major
from .saving import host_adamw

logger = logging.getLogger(__name__)


def install(patcher: Patcher, plugin, trainer) -> None:
    _install_optimizer(patcher, plugin, trainer)
    _install_entry_points(patcher, plugin, trainer)
    _install_accelerator(patcher, plugin, trainer)
    checkpoints.install(patcher, trainer)
    layer_major.install(patcher, plugin, trainer)
    distributed.install(patcher, plugin, trainer)
    engine = plugin.engine
    if plugin.config.chunked_loss == "auto" and type(trainer) is Trainer:
        # plain Trainer reads only the loss of a training forward; subclasses may read logits
        engine.chunked_loss_active = engine.chunked_loss_installed
    elif engine.chunked_loss_installed and type(trainer).compute_loss is not Trainer.compute_loss:
        logger.warning("megatrain: chunked_loss=True with %s.compute_loss: training forwards with labels return "
                       "logits=None (only the loss). If compute_loss reads outputs.logits, set chunked_loss='auto' "
                       "(HF's loss for Trainer subclasses).", type(trainer).__name__)


def _install_optimizer(patcher: Patcher, plugin, trainer) -> None:
    original = trainer.create_optimizer

    def create_optimizer(model=None):
        supplied = trainer.optimizer is not None  # Trainer(optimizers=(opt, ...)) set it in __init__
        optimizer = original(model) if model is not None else original()
        _check_compressible(plugin, optimizer, supplied and trainer.lr_scheduler is not None)
        if not plugin.config.replace_adamw or not convertible(optimizer):
            return optimizer
        if supplied and trainer.lr_scheduler is not None:
            plugin.log_once(logging.INFO, "megatrain: the optimizer and scheduler passed in Trainer(optimizers=...) "
                            "are kept (the scheduler drives that optimizer); it steps the host parameters "
                            "synchronously after backward. Pass optim='adamw_torch_fused' instead (or no scheduler) "
                            "for megatrain's HostAdamW, updated in the background.")
            return optimizer
        trainer.optimizer = _host_optimizer(plugin, optimizer)
        logger.info("megatrain: AdamW runs as HostAdamW on the host flats (same math)")
        return trainer.optimizer

    patcher.set_attr(trainer, "create_optimizer", create_optimizer)


def _check_compressible(plugin, optimizer: torch.optim.Optimizer, kept: bool) -> None:
    """Compressed moments, the disk tier and bf16 gradients exist only in HostAdamW, and data parallelism
    needs it: refuse (``megatrain_hf/plan.py``'s rules) a setup where it would not run."""
    choice = OptimizerChoice(type(optimizer).__name__, convertible(optimizer), kept, isinstance(optimizer, HostAdamW))
    if plugin.engine is not None:
        plugin.engine.plan.check(optimizer=choice)
    else:
        check_plan(plugin.config, run=Run(optimizer=choice))


def _host_optimizer(plugin, optimizer: torch.optim.Optimizer) -> HostAdamW:
    return plugin.engine.host_optimizer(optimizer)  # the plan's format, kernel, threads and disk tier


def _install_entry_points(patcher: Patcher, plugin, trainer) -> None:
    def wrapped(name: str, check=None):
        original = getattr(trainer, name)

        def method(*args, **kwargs):
            if check is not None:
                check()
            plugin.check_forwards()
            return original(*args, **kwargs)

        patcher.set_attr(trainer, name, method)

    def check_dataset():
        # Trainer's own message for this is the sampler's "num_samples should be a positive integer"
        from transformers.trainer_utils import has_length

        dataset = trainer.train_dataset
        if dataset is not None and has_length(dataset) and len(dataset) == 0:
            raise TrainingDataError(
                f"megatrain: train_dataset ({type(dataset).__name__}) is empty: 0 examples to train on. "
                "Fix: check the split and the filtering / packing that built it (e.g. examples longer than "
                "max_length dropped, a wrong split name)."
            )

    def check_before_training():
        check_dataset()
        _check_liger_device(trainer, plugin.engine)
        _check_example_lengths(trainer, plugin.engine)

    wrapped("train", check_before_training)
    wrapped("evaluate")
    wrapped("predict")


_SCAN_LIMIT = 200_000  # map-style datasets scanned item by item up to this many examples


def _check_liger_device(trainer, engine) -> None:
    if getattr(trainer.args, "use_liger_kernel", False) and engine is not None and engine.device.type != "cuda":
        raise IncompatibleOptionsError(
            f"megatrain: TrainingArguments(use_liger_kernel=True) with the compute on {engine.device}: Liger-Kernel's "
            "kernels are Triton kernels that launch on CUDA only (Triton would fail with '0 active drivers'). Fix: "
            "train on a CUDA GPU, or unset use_liger_kernel."
        )


def _check_example_lengths(trainer, engine) -> None:
    """Refuse, before training starts, a tokenized example longer than the model's positions (naming
    it), where the dataset can be read without cost: an HF ``datasets.Dataset`` (its Arrow column) or
    a sized dataset of at most ``_SCAN_LIMIT`` examples. The per-forward check covers the rest."""
    from transformers.trainer_utils import has_length

    from ...models.checks import limit_reason, position_limit, sequence_too_long
    from ...models.families import unwrap

    dataset = trainer.train_dataset
    config = getattr(unwrap(engine.model), "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    limit = position_limit(text)
    if dataset is None or limit is None or not has_length(dataset):
        return
    lengths = _arrow_lengths(dataset)
    if lengths is None and len(dataset) <= _SCAN_LIMIT:
        lengths = []
        for i in range(len(dataset)):
            ids = dataset[i].get("input_ids") if isinstance(dataset[i], dict) else None
            if ids is None:
                return
            lengths.append(ids.shape[-1] if isinstance(ids, torch.Tensor) else len(ids))
    if not lengths:
        return
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] > limit:
        raise sequence_too_long(lengths[longest], limit, getattr(text, "model_type", "?"),
                                where=f"example {longest} of train_dataset ({type(dataset).__name__})",
                                reason=limit_reason(text))


def _arrow_lengths(dataset) -> list[int] | None:
    """Token counts of an HF ``datasets.Dataset``'s ``input_ids`` column, from Arrow (None otherwise)."""
    try:
        import datasets
        import pyarrow.compute as pc
    except ImportError:
        return None
    if not isinstance(dataset, datasets.Dataset) or "input_ids" not in dataset.column_names:
        return None
    column = dataset.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"]
    return pc.list_value_length(column).to_pylist()


def _install_accelerator(patcher: Patcher, plugin, trainer) -> None:
    accelerator = trainer.accelerator
    original_clip = accelerator.clip_grad_norm_
    original_prepare_optimizer = accelerator.prepare_optimizer

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        optimizer = host_adamw(trainer)
        engine = plugin.engine
        if optimizer is None or engine is None or float(norm_type) != 2.0:
            return original_clip(parameters, max_norm, norm_type)
        # the multiply runs inside the background update unless a callback observes the gradients
        # around the optimizer step (bf16 accumulators hold the one bf16 gradient: never multiplied here)
        observed = engine.store.accumulators.grad_dtype == torch.float32 and plugin.observers(
            trainer, "on_pre_optimizer_step", "on_optimizer_step")
        if observed:
            plugin.log_once(logging.INFO, "megatrain: a callback observes the gradients before/after the optimizer "
                            "step: clipping is applied to them at once instead of inside the background update")
        return engine.clip_grad_norm_(max_norm, optimizer=optimizer, defer=not observed,
                                      on_nonfinite=lambda norm: plugin.skip_step(trainer, optimizer, norm))

    original_prepare_model = accelerator.prepare_model

    def prepare_model(model, device_placement=None, evaluation_mode=False):
        # TRL's reference and reward models are prepared for evaluation after Trainer.__init__:
        # streamed like the policy (frozen, in the wire dtype) instead of moved whole to the device
        if evaluation_mode and plugin.attach_reference(model, trainer.args):
            return model
        dynamo = accelerator.state.dynamo_plugin
        streamed = engine_of(model) is not None
        if not streamed or dynamo.backend == DynamoBackend.NO:
            return original_prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        # torch_compile: the engine compiles its layer templates (compile=True); compiling the whole model
        # would trace the streamed calls
        saved, dynamo.backend = dynamo.backend, DynamoBackend.NO
        try:
            return original_prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        finally:
            dynamo.backend = saved

    def prepare_optimizer(optimizer, device_placement=None):
        # HostAdamW's state lives in the host store: with device placement, accelerate would copy the
        # whole state to the GPU and load it back (as much host RSS and GPU memory, and time)
        if isinstance(optimizer, HostAdamW):
            device_placement = False
        return original_prepare_optimizer(optimizer, device_placement=device_placement)

    patcher.set_attr(accelerator, "clip_grad_norm_", clip_grad_norm_)
    patcher.set_attr(accelerator, "prepare_optimizer", prepare_optimizer)
    patcher.set_attr(accelerator, "prepare_model", prepare_model)
    gradient_state = accelerator.gradient_state
    plugin.engine.set_final_microbatch(lambda: bool(gradient_state.sync_gradients))

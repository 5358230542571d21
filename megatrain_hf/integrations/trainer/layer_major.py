"""Layer-major accumulation under Trainer: the step's micro-batches run through each unit together.

Trainer fetches an optimizer step's micro-batches up front (``get_batch_samples``); the override
remembers them. At the step's first ``training_step`` the driver runs Trainer's own
``training_step`` for every micro-batch as coroutines (``runtime/layer_major.py``), with
``accelerator.backward`` routed to the engine (it scales the loss as Accelerate does and defers it
to the step's one backward pass), and hands the K results back, one per ``training_step`` call.

Whether a step runs layer-major is decided per step, each reason logged once: ``layer_major=False``;
a distributed accelerator or a gradient scaler; LOMO optimizers (they need the learning rate inside
backward); and, under ``"auto"``, anything whose result would depend on the order in which the
micro-batches' Python code runs -- dropout (random masks drawn in another order), module hooks
(forward, pre-forward, backward, torch's global ones: they may draw random numbers), tensor hooks on
parameters (they run once per micro-batch's backward), a Trainer subclass whose ``training_step``
or ``_prepare_inputs`` keeps state across calls (TRL's GRPO and RLOO pick their buffered batch by a
counter that ``training_step`` advances). Known order-independent overrides are listed in
``ORDER_INDEPENDENT``.
"""

from __future__ import annotations

import functools
import logging

from transformers import Trainer

from ...errors import IncompatibleOptionsError
from ...core.patcher import Patcher
from ...core.hooks import hooked_modules
from ...models.checks import dropout_modules

logger = logging.getLogger(__name__)

ORDER_INDEPENDENT = frozenset({
    # TRL's trainers that only wrap Trainer's training_step in a context manager (activation offload)
    "trl.trainer.sft_trainer.SFTTrainer.training_step",
    "trl.trainer.dpo_trainer.DPOTrainer.training_step",
    "trl.trainer.kto_trainer.KTOTrainer.training_step",
    "trl.trainer.reward_trainer.RewardTrainer.training_step",
})
"""``module.qualname`` of ``training_step`` / ``_prepare_inputs`` overrides known not to keep state
across calls (read in their source, for the TRL versions the project declares)."""


class _StepGroup:
    """The micro-batches of one optimizer step, as ``get_batch_samples`` returned them."""

    def __init__(self, batches: list, num_items) -> None:
        self.batches = batches
        self.num_items = num_items
        self.results: list | None = None

    def index(self, inputs) -> int | None:
        return next((i for i, batch in enumerate(self.batches) if batch is inputs), None)


def stateful_overrides(trainer) -> list[str]:
    """The ``training_step`` / ``_prepare_inputs`` overrides of a Trainer subclass not known to be
    order-independent."""
    found = []
    for name in ("training_step", "_prepare_inputs"):
        for cls in type(trainer).__mro__:
            if cls is Trainer:
                break
            fn = cls.__dict__.get(name)
            if fn is not None:
                qualname = f"{cls.__module__}.{getattr(fn, '__qualname__', name)}"
                if qualname not in ORDER_INDEPENDENT:
                    found.append(qualname)
    return found


def install(patcher: Patcher, plugin, trainer) -> None:
    original_get_batch_samples = trainer.get_batch_samples
    original_training_step = trainer.training_step

    def get_batch_samples(epoch_iterator, num_batches, device):
        batches, num_items = original_get_batch_samples(epoch_iterator, num_batches, device)
        plugin.step_group = _StepGroup(batches, num_items) if len(batches) > 1 else None
        plugin.step_microbatches = len(batches)
        engine = plugin.engine
        if engine is not None:
            engine.budget.in_flight = 1  # micro-batch by micro-batch unless a layer-major group runs
        return batches, num_items

    def training_step(model, inputs, num_items_in_batch=None):
        group = plugin.step_group
        index = group.index(inputs) if group is not None else None
        if index is None:
            return original_training_step(model, inputs, num_items_in_batch)
        if group.results is None:
            if not _applies(plugin, trainer):
                plugin.step_group = None
                return original_training_step(model, inputs, num_items_in_batch)
            group.results = _run(plugin, trainer, model, group, original_training_step)
        if index == len(group.batches) - 1:
            plugin.step_group = None  # drop the references to the step's batches
        return group.results[index]

    patcher.set_attr(trainer, "get_batch_samples", get_batch_samples)
    patcher.set_attr(trainer, "training_step", training_step)


def _applies(plugin, trainer) -> bool:
    """Whether this step's micro-batches run layer-major (logged once per reason)."""
    mode = plugin.config.layer_major
    if mode is False:
        return False
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    engine = plugin.engine
    blockers = []
    if accelerator.distributed_type != DistributedType.NO:
        blockers.append(f"accelerator distributed_type={accelerator.distributed_type}")
    if accelerator.scaler is not None:
        blockers.append("a gradient scaler is active")
    if "lomo" in str(getattr(trainer.args.optim, "value", trainer.args.optim)).lower():
        blockers.append(f"optim={trainer.args.optim} needs the learning rate inside backward")
    if mode == "auto":
        dropout = dropout_modules(engine.model)
        if dropout:
            blockers.append(
                f"the model has dropout ({', '.join(dropout[:3])}{', ...' if len(dropout) > 3 else ''}), whose "
                "random masks would be drawn in another order than plain Trainer's"
            )
        modules = hooked_modules([(unit.name, unit.module) for unit in engine.units])
        if modules:
            blockers.append(f"modules have hooks ({', '.join(modules[:3])}{', ...' if len(modules) > 3 else ''}), "
                            "which may draw random numbers in another order than plain Trainer's")
        hooked = engine.grads.hooked_parameters()
        if hooked:
            blockers.append(f"parameters have tensor hooks ({', '.join(hooked[:3])}), which run once per micro-batch")
        stateful = stateful_overrides(trainer)
        if stateful:
            blockers.append(f"{', '.join(stateful)} may keep state across micro-batches (their order would change)")
        if blockers:
            blockers[-1] += "; MegaTrainConfig(layer_major=True) accepts that"
    if blockers:
        plugin.log_once(logging.WARNING if mode is True else logging.INFO,
                        "megatrain: gradient accumulation runs micro-batch by micro-batch (not layer-major): "
                        + "; ".join(blockers))
        return False
    plugin.log_once(logging.INFO, "megatrain: layer-major gradient accumulation (each layer computes all "
                    "micro-batches of a step, uploaded once per direction, gradients summed on the device)")
    return True


def _run(plugin, trainer, model, group: _StepGroup, training_step) -> list:
    """Trainer's own ``training_step`` for every micro-batch of the step, interleaved per unit."""
    engine = plugin.engine
    accelerator = trainer.accelerator
    original_backward = accelerator.backward

    def backward(loss, **kwargs):
        if engine.layer_major.coroutine() is None:
            return original_backward(loss, **kwargs)
        unknown = sorted(set(kwargs) - {"retain_graph"})
        if unknown:
            raise IncompatibleOptionsError(
                f"megatrain layer-major accumulation got accelerator.backward(loss, {', '.join(unknown)}=...), "
                "which it cannot defer. Set MegaTrainConfig(layer_major=False)."
            )
        engine.backward(loss / accelerator.gradient_accumulation_steps, **kwargs)

    with plugin.patcher.temporarily(accelerator, "backward", backward):
        steps = [functools.partial(training_step, model, batch, group.num_items) for batch in group.batches]
        in_flight = engine.budget.microbatches_in_flight(len(steps))  # max_gpu_memory: fewer at a time
        engine.budget.in_flight = in_flight
        results = []
        for start in range(0, len(steps), in_flight):
            results.extend(engine.run_layer_major(steps[start : start + in_flight]))
        return results

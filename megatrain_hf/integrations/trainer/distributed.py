"""Trainer under data parallelism (``torchrun``, ``accelerate launch --num_processes N``).

The engine shards the host state by unit (``core/sharding.py``); here is what Trainer and Accelerate
would otherwise do to such a model, per instance:

* ``accelerator.prepare_model``: the megatrain model is returned as it is (no
  ``DistributedDataParallel`` wrapper: the engine sums the gradients into their owners itself, and
  accelerate's check of device-mapped models does not apply); Trainer's distributed sampler,
  ``gradient_accumulation_steps``, logging on rank 0 and its loss scaling are Trainer's own.
* ``create_optimizer``: only HostAdamW knows which rank owns which unit; another optimizer is refused
  (the plan's rule, checked by ``overrides.py`` when the Trainer builds its optimizer).
* ``save_model``: every rank takes part; rank 0 receives the other ranks' units one by one and
  writes one ``save_pretrained`` folder (loadable by plain ``from_pretrained``).
* ``_save_checkpoint``: every rank writes into the same staging folder (its optimizer shards and its
  RNG state), then rank 0 commits it (``checkpoints.py``).
"""

from __future__ import annotations

import logging

import torch

from ...core.patcher import Patcher

logger = logging.getLogger(__name__)


def install(patcher: Patcher, plugin, trainer) -> None:
    engine = plugin.engine
    if engine is None or engine.sharding is None:
        return
    accelerator = trainer.accelerator
    prepare_model = accelerator.prepare_model

    def prepare_model_dp(model, device_placement=None, evaluation_mode=False):
        if model is engine.model or getattr(model, "_megatrain_engine", None) is engine:
            if model not in accelerator._models:
                accelerator._models.append(model)
            return model
        return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    patcher.set_attr(accelerator, "prepare_model", prepare_model_dp)

    save = trainer._save

    def save_model(output_dir=None, _internal_call=False):
        state = engine.gather_state_dict()
        if trainer.args.should_save:
            output_dir = output_dir if output_dir is not None else trainer.args.output_dir
            save(output_dir, state_dict=state)
        engine.sharding.barrier()  # the folder is whole before any rank goes on (and reads it)

    patcher.set_attr(trainer, "save_model", save_model)

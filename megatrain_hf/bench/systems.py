"""How each benchmarked system is set up through the HF Trainer, in one place.

All systems get the same ``TrainingArguments`` (tokens per step, precision, optimizer, clipping,
schedule, activation checkpointing, data order) except what the system itself needs:

- ``megatrain``: stock Trainer + ``MegaTrainPlugin`` (HF checkpointing is requested like
  everywhere; megatrain turns it off on streamed layers and recomputes per layer itself); its
  options come from ``MEGATRAIN_CONFIG`` (JSON) when set, the defaults otherwise.
- ``plain``: stock Trainer; the whole model, grads and AdamW state on the GPU.
- ``deepspeed``: ZeRO-3 with parameters AND optimizer offloaded to pinned CPU memory, the
  configuration of the HF DeepSpeed guide (ZeRO-3 offload example): DeepSpeed's own AdamW (its
  CPU Adam when offloaded) with ``"auto"`` hyper-parameters, bucket sizes ``"auto"`` (derived
  from the hidden size), ``overlap_comm`` and ``contiguous_gradients`` on. No DeepSpeed
  scheduler, so Trainer's schedule (the same as every other system's) drives it.
- ``fsdp2``: FSDP2 (``fully_shard``) per ``LlamaDecoderLayer`` with ``CPUOffloadPolicy``
  (pinned host params, grads and optimizer state; the optimizer steps on the CPU). FSDP's own
  activation checkpointing is used and Trainer's is off: transformers warns that combining them
  adds a redundant all-gather in backward.

DeepSpeed and FSDP2 need a process group; the runner starts their workers with a world-size-1
distributed environment.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from transformers import TrainerCallback

SYSTEMS = ("megatrain", "plain", "deepspeed", "fsdp2")
DISTRIBUTED_SYSTEMS = frozenset({"deepspeed", "fsdp2"})


def deepspeed_config() -> dict[str, Any]:
    """ZeRO-3 + CPU offload of params and optimizer (pinned), as the HF DeepSpeed guide writes it."""
    return {
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1_000_000_000,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def fsdp2_config() -> dict[str, Any]:
    """``TrainingArguments.fsdp_config`` for FSDP2 + CPU offload (keys of transformers >= 5.17)."""
    return {
        "version": 2,
        "cpu_offload": True,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "activation_checkpointing": True,
        "reshard_after_forward": True,
        "cpu_ram_efficient_loading": False,
        "state_dict_type": "SHARDED_STATE_DICT",
    }


def _checkpointing_field() -> str:
    """``activation_checkpointing`` (transformers >= 5.23) or ``gradient_checkpointing`` (older)."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def training_arguments(system: str, *, output_dir: str, micro_batch: int, grad_accum: int, max_steps: int,
                       bf16: bool, use_cpu: bool, seed: int):
    """The ``TrainingArguments`` of ``system``: the shared workload plus the system's own keys."""
    from transformers import TrainingArguments

    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; allowed: {', '.join(SYSTEMS)}")
    kwargs: dict[str, Any] = {
        "output_dir": output_dir,
        "max_steps": max_steps,
        "per_device_train_batch_size": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "bf16": bf16,
        "learning_rate": 1e-5,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "optim": "adamw_torch_fused",
        "logging_strategy": "steps",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "dataloader_num_workers": 0,
        "train_sampling_strategy": "sequential",  # same batches in the same order for every system
        "disable_tqdm": True,
        "seed": seed,
        "use_cpu": use_cpu,
    }
    kwargs[_checkpointing_field()] = system != "fsdp2"
    if system == "deepspeed":
        kwargs["deepspeed"] = deepspeed_config()
    elif system == "fsdp2":
        # Read by accelerate when it creates the process group: CPU offload needs a gloo group
        # for CPU tensors next to NCCL ("cuda:nccl,cpu:gloo").
        os.environ.setdefault("ACCELERATE_USE_FSDP", "true")
        os.environ.setdefault("FSDP_OFFLOAD_PARAMS", "true")
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = fsdp2_config()
    return TrainingArguments(**kwargs)


class SystemCheck(TrainerCallback):
    """Fails the run at ``on_train_begin`` unless the system is really in effect.

    Accelerate can quietly run something else (FSDP on a CPU-only process becomes DDP), and a
    result labelled "fsdp2" must not come from DDP. ``facts`` records what was checked.
    """

    def __init__(self, system: str) -> None:
        self.system = system
        self.trainer = None  # set right after Trainer(...) returns
        self.facts: dict[str, Any] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        check = {"megatrain": _check_megatrain, "plain": _check_plain,
                 "deepspeed": _check_deepspeed, "fsdp2": _check_fsdp2}[self.system]
        self.facts = {"distributed_type": str(self.trainer.accelerator.distributed_type)}
        self.facts.update(check(self.trainer))


def _require(ok: bool, what: str, facts: dict[str, Any]) -> None:
    if not ok:
        raise RuntimeError(f"benchmark configuration did not take effect: expected {what}; found {facts}")


def _check_megatrain(trainer) -> dict[str, Any]:
    from megatrain_hf import engine_of

    engine = engine_of(trainer.model)
    facts = {"engine": type(engine).__name__ if engine is not None else None,
             "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__}
    _require(engine is not None, "a megatrain engine attached to the model", facts)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    facts.update(config=engine.config.to_dict(), host_staging=engine.store.staging,
                 chunked_loss=engine.chunked_loss_active, adamw_kernel=getattr(optimizer, "kernel", None))
    return facts


def _check_plain(trainer) -> dict[str, Any]:
    from accelerate.utils import DistributedType

    devices = sorted({str(p.device) for p in trainer.model.parameters()})
    facts = {"param_devices": devices}
    _require(trainer.accelerator.distributed_type == DistributedType.NO, "no distribution", facts)
    return facts


def _check_deepspeed(trainer) -> dict[str, Any]:
    from accelerate.utils import DistributedType

    engine = trainer.model_wrapped
    facts = {name: _call(engine, name) for name in
             ("zero_optimization_stage", "zero_offload_param", "zero_offload_optimizer")}
    facts["optimizer"] = type(getattr(engine, "optimizer", None)).__name__
    facts = {k: str(v) for k, v in facts.items()}
    _require(trainer.accelerator.distributed_type == DistributedType.DEEPSPEED
             and facts["zero_optimization_stage"] == "3", "DeepSpeed ZeRO stage 3", facts)
    _require("cpu" in facts["zero_offload_param"] and "cpu" in facts["zero_offload_optimizer"],
             "params and optimizer offloaded to cpu", facts)
    return facts


def _check_fsdp2(trainer) -> dict[str, Any]:
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)  # absent when FSDP is not on
    sharded = [type(m).__name__ for m in trainer.model.modules() if isinstance(m, FSDPModule)]
    local = [getattr(p, "to_local", lambda p=p: p)() for p in trainer.model.parameters()]
    facts = {"fsdp_version": getattr(plugin, "fsdp_version", None), "fsdp_modules": len(sharded),
             "offload_policy": type(getattr(plugin, "cpu_offload", None)).__name__,
             "param_devices": sorted({str(t.device) for t in local})}
    _require(trainer.accelerator.distributed_type == DistributedType.FSDP and facts["fsdp_version"] == 2
             and len(sharded) > 0, "FSDP2 (fully_shard) modules", facts)
    _require(isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy) and facts["param_devices"] == ["cpu"],
             "CPUOffloadPolicy with parameters on the CPU", facts)
    return facts


def _call(obj, name: str):
    method = getattr(obj, name, None)
    return method() if callable(method) else None


def extra_callbacks(system: str) -> list:
    """Callbacks the system itself needs (the megatrain plugin), besides the bench's timer."""
    if system != "megatrain":
        return []
    from megatrain_hf import MegaTrainConfig, MegaTrainPlugin

    # MEGATRAIN_CONFIG (JSON, as `megatrain launch` hands it over) sets options, e.g.
    # MEGATRAIN_CONFIG='{"host_staging": false}' megatrain bench ...
    return [MegaTrainPlugin(MegaTrainConfig.from_env())]

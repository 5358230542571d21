"""How each benchmarked system is set up through the HF Trainer, in one place.

All systems get the same ``TrainingArguments`` (tokens per step, precision, optimizer
hyper-parameters, clipping, schedule, activation checkpointing, data order) and the same
``--warmup-steps``; besides that each gets what its own experts would set on one GPU with a large
host. The configurations below are written out in full (``system_config``) and land in every
report.

- ``megatrain``: stock Trainer + ``MegaTrainPlugin`` with its DEFAULT options (HF checkpointing is
  requested like everywhere; megatrain turns it off on streamed layers and recomputes per layer
  itself). ``MEGATRAIN_CONFIG`` (JSON) changes them for a run that names its options; the
  comparisons leave it unset.
- ``plain``: stock Trainer; the whole model, grads and AdamW state on the GPU.
- ``deepspeed``: ZeRO-3, parameters AND optimizer offloaded to pinned CPU memory; optimizer step
  by DeepSpeedCPUAdam.
- ``deepspeed_zero2``: ZeRO-2 with the optimizer offloaded to pinned CPU memory (bf16 weights and
  gradients on the GPU): the usual single-GPU choice when the weights fit.
- ``deepspeed_offloadpp``: ZeRO-Offload++ ("Twin-Flow"): ZeRO-3 with the optimizer offloaded, but
  ``offload_optimizer.ratio`` = 0.3 keeps 70 % of the optimizer sub-groups (their fp32 masters,
  Adam moments and update) on the GPU. DeepSpeed 0.19.8 accepts ``ratio < 1`` with stage 3 only
  (``DeepSpeedZeroConfig.offload_ratio_check``); sub-group ``i`` of ``n`` is on the GPU when
  ``i < int((1 - ratio) * n)`` (``DeepSpeedZeroOptimizer_Stage3``), so ``sub_group_size`` is cut
  to 1e8 for the split to be close to the ratio (at 1e9 a 3.14 B model has ~4 sub-groups: half
  on the GPU). Weights are not offloaded (the feature is about the optimizer).
- ``deepspeed_zenflow``: ZenFlow (``zero_optimization.zenflow``, in 0.19.8) on ZeRO-2 with
  the optimizer offloaded: the top-k gradient columns (``topk_ratio`` 0.1) are updated on the GPU
  every step, the rest accumulate and are applied by the CPU every ``update_interval`` = 4 steps,
  overlapped with the following steps (``overlap_step``). Its updates are STALE BY DESIGN
  (asynchronous, deferred): not the same optimizer as the others', which all apply every
  gradient at every step. ZenFlow replaces DeepSpeed's gradient accumulation with its own
  interval (``configure_zenflow`` sets ``gradient_accumulation_steps = update_interval``), so the
  bench runs it only with ``--grad-accum 1``; measured steps should be a multiple of 4 to average
  whole update cycles. ``select_strategy`` "auto" is per epoch, and Trainer hands DeepSpeed no
  dataloader, so the columns are selected once, at the first step.
- ``fsdp2``: FSDP2 (``fully_shard``) per ``LlamaDecoderLayer`` with ``CPUOffloadPolicy`` (pinned
  host params, grads and optimizer state; the optimizer steps on the CPU). FSDP's own activation
  checkpointing is used and Trainer's is off: transformers warns that combining them adds a
  redundant all-gather in backward.

DeepSpeed tuning shared by its systems (0.19.8 source: ``runtime/zero/config.py``,
``offload_config.py``; the sizes are what transformers' ``"auto"`` computes from the hidden size
``h``, written out so the report shows the numbers): ``overlap_comm`` and ``contiguous_gradients``
on; ``reduce_bucket_size`` = h^2; ZeRO-3 also ``stage3_prefetch_bucket_size`` = 0.9 h^2,
``stage3_param_persistence_threshold`` = 10 h, ``stage3_max_live_parameters`` =
``stage3_max_reuse_distance`` = 1e9 and ``sub_group_size`` = 1e9 (DeepSpeed's defaults, and the values of
the HF DeepSpeed guide's ZeRO-3 example; 1e9 live elements hold ~8 decoder layers of the 3.14 B shape gathered,
far more than the prefetch asks for, and one sub-group per ~1e9 parameters keeps the CPU Adam
calls few); ``pin_memory`` on every offload. ``fast_init`` is left off:
0.19.8 reads it only when optimizer state is swapped to NVMe. DeepSpeed's own AdamW
(``"optimizer": {"type": "AdamW"}``, hyper-parameters "auto" from ``TrainingArguments``) becomes
``DeepSpeedCPUAdam`` (``ZenFlowCPUAdam`` with ZenFlow) when the optimizer is offloaded. No
DeepSpeed scheduler, so Trainer's schedule (the same as every other system's) drives it.

CPU optimizer threads: DeepSpeedCPUAdam's kernel is ``#pragma omp parallel for`` with no thread
count (``ops/csrc/adam/cpu_adam_impl.cpp``), so it runs on the OpenMP team of the calling
thread, which torch sets at start-up from ``OMP_NUM_THREADS``, or, unset, to the physical core
count as torch's cpuinfo sees it (not the process's affinity or cgroup). DeepSpeed's launcher
sets ``OMP_NUM_THREADS`` only with ``--bind_cores_to_rank``; torchrun sets 1 per process when it
starts several. The runner therefore gives every worker whose optimizer runs on the CPU through
torch's OpenMP (the DeepSpeed systems, FSDP2) ``OMP_NUM_THREADS`` = :func:`host_cores`, and the
system check records what the worker ended up with (``torch.get_num_threads()``).

DeepSpeed and FSDP2 need a process group; the runner starts their workers with a world-size-1
distributed environment.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from transformers import TrainerCallback

from ..errors import MegatrainConfigError
from ..memory import ModelShape

SPEED_VARIANTS = {
    "megatrain_compile": ("megatrain", {"torch_compile": True}),
    "plain_compile": ("plain", {"torch_compile": True}),
    "megatrain_liger": ("megatrain", {"use_liger_kernel": True}),
    "plain_liger": ("plain", {"use_liger_kernel": True}),
}
"""A system with the options a user turns on for speed: (its base system, the TrainingArguments it adds)."""
SYSTEMS = ("megatrain", "plain", "deepspeed", "deepspeed_zero2", "deepspeed_offloadpp", "deepspeed_zenflow",
           "fsdp2", *SPEED_VARIANTS)
DEEPSPEED_SYSTEMS = frozenset({"deepspeed", "deepspeed_zero2", "deepspeed_offloadpp", "deepspeed_zenflow"})
ZERO3_SYSTEMS = frozenset({"deepspeed", "deepspeed_offloadpp"})  # the model is built partitioned (zero.Init)
DISTRIBUTED_SYSTEMS = DEEPSPEED_SYSTEMS | {"fsdp2"}
CPU_OPTIMIZER_SYSTEMS = DISTRIBUTED_SYSTEMS  # their optimizer steps on the CPU through torch's OpenMP

OFFLOADPP_RATIO = 0.3  # share of the optimizer sub-groups on the CPU (the rest update on the GPU)
OFFLOADPP_SUB_GROUP_SIZE = 100_000_000
ZENFLOW_UPDATE_INTERVAL = 4

SYSTEM_NOTES = {
    "megatrain": "megatrain's default options (MEGATRAIN_CONFIG unset unless the run names options)",
    "plain": "whole model, gradients and AdamW state on the GPU",
    "deepspeed": "ZeRO-3, parameters and optimizer offloaded to pinned CPU memory, DeepSpeedCPUAdam",
    "deepspeed_zero2": "ZeRO-2, optimizer offloaded to pinned CPU memory (weights on the GPU), DeepSpeedCPUAdam",
    "deepspeed_offloadpp": (f"ZeRO-Offload++: ZeRO-3, optimizer offloaded with ratio {OFFLOADPP_RATIO}: "
                            f"{100 * (1 - OFFLOADPP_RATIO):.0f} % of the optimizer sub-groups update on the GPU"),
    "deepspeed_zenflow": (f"ZenFlow on ZeRO-2 + optimizer offload: top-k columns updated on the GPU every step, the "
                          f"rest on the CPU every {ZENFLOW_UPDATE_INTERVAL} steps, overlapped; updates are stale by "
                          "design (asynchronous, deferred), not the same optimizer as the others'"),
    "fsdp2": "FSDP2 fully_shard per decoder layer with CPUOffloadPolicy (pinned), optimizer step on the CPU",
    "megatrain_compile": "megatrain + TrainingArguments(torch_compile=True): its layer templates compiled (inductor)",
    "plain_compile": "plain + TrainingArguments(torch_compile=True): the whole model compiled (inductor)",
    "megatrain_liger": ("megatrain + TrainingArguments(use_liger_kernel=True): Liger's RMSNorm, SwiGLU, rotary in the "
                        "streamed layers, megatrain's chunked loss for Liger's fused linear cross-entropy"),
    "plain_liger": "plain + TrainingArguments(use_liger_kernel=True): Liger's kernels and fused linear cross-entropy",
}


def base_system(system: str) -> str:
    """The system a speed variant is built on (``SPEED_VARIANTS``), else ``system`` itself."""
    return SPEED_VARIANTS[system][0] if system in SPEED_VARIANTS else system


def host_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped at the physical cores when known.

    The CPU optimizer kernels are bound by vector units and memory bandwidth; a second hardware
    thread per core adds contention, not throughput.
    """
    import psutil

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    physical = psutil.cpu_count(logical=False)
    return max(1, min(allowed, physical) if physical else allowed)


def _offload(**extra: Any) -> dict[str, Any]:
    return {"device": "cpu", "pin_memory": True, **extra}


def deepspeed_config(system: str, shape: ModelShape) -> dict[str, Any]:
    """The DeepSpeed config of ``system`` for a model of ``shape`` (see the module docstring)."""
    if system not in DEEPSPEED_SYSTEMS:
        raise MegatrainConfigError(f"{system!r} is not a DeepSpeed system; those are {sorted(DEEPSPEED_SYSTEMS)}")
    h = shape.hidden
    zero: dict[str, Any] = {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": h * h}
    if system in ZERO3_SYSTEMS:
        zero.update({
            "stage": 3,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "sub_group_size": 1_000_000_000,
        })
        if system == "deepspeed":
            zero["offload_param"] = _offload()
            zero["offload_optimizer"] = _offload()
        else:
            zero["offload_optimizer"] = _offload(ratio=OFFLOADPP_RATIO)
            zero["sub_group_size"] = OFFLOADPP_SUB_GROUP_SIZE
    else:
        zero.update({"stage": 2, "allgather_bucket_size": 500_000_000, "offload_optimizer": _offload()})
        if system == "deepspeed_zenflow":
            zero["zenflow"] = {
                "topk_ratio": 0.1,
                "select_strategy": "auto",
                "select_interval": "auto",
                "update_interval": ZENFLOW_UPDATE_INTERVAL,
                "overlap_step": True,
                "full_warm_up_rounds": 0,
            }
    return {
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": {"stage": zero.pop("stage"), **zero},
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
        "cpu_offload": True,  # accelerate: CPUOffloadPolicy(), pin_memory=True
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "activation_checkpointing": True,
        "reshard_after_forward": True,
        "cpu_ram_efficient_loading": False,
        "state_dict_type": "SHARDED_STATE_DICT",
    }


def system_config(system: str, shape: ModelShape) -> dict[str, Any]:
    """What the report shows of a system's own setup (the shared TrainingArguments aside)."""
    if system not in SYSTEMS:
        raise MegatrainConfigError(f"unknown system {system!r}; allowed: {', '.join(SYSTEMS)}")
    config: dict[str, Any] = {"note": SYSTEM_NOTES[system]}
    if system in DEEPSPEED_SYSTEMS:
        config["deepspeed"] = deepspeed_config(system, shape)
    elif system == "fsdp2":
        config["fsdp_config"] = fsdp2_config()
    elif base_system(system) == "megatrain":
        config["MEGATRAIN_CONFIG"] = os.environ.get("MEGATRAIN_CONFIG") or None
    if system in SPEED_VARIANTS:
        config["training_arguments"] = SPEED_VARIANTS[system][1]
    if system in CPU_OPTIMIZER_SYSTEMS:
        config["OMP_NUM_THREADS"] = host_cores()
    return config


def check_workload(system: str, grad_accum: int) -> None:
    """Raise ValueError when ``system`` does not run this workload as the others do."""
    if system == "deepspeed_zenflow" and grad_accum != 1:
        raise MegatrainConfigError(
            f"deepspeed_zenflow with --grad-accum {grad_accum}: ZenFlow replaces DeepSpeed's gradient "
            "accumulation with its update_interval (configure_zenflow sets gradient_accumulation_steps = "
            f"update_interval = {ZENFLOW_UPDATE_INTERVAL}), so its optimizer steps would not be Trainer's; "
            "the bench runs it with --grad-accum 1 only"
        )


def _checkpointing_field() -> str:
    """``activation_checkpointing`` (transformers >= 5.23) or ``gradient_checkpointing`` (older)."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def training_arguments(system: str, *, shape: ModelShape, output_dir: str, micro_batch: int, grad_accum: int,
                       max_steps: int, bf16: bool, use_cpu: bool, seed: int):
    """The ``TrainingArguments`` of ``system``: the shared workload plus the system's own keys."""
    from transformers import TrainingArguments

    if system not in SYSTEMS:
        raise MegatrainConfigError(f"unknown system {system!r}; allowed: {', '.join(SYSTEMS)}")
    check_workload(system, grad_accum)
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
    if system in DEEPSPEED_SYSTEMS:
        kwargs["deepspeed"] = deepspeed_config(system, shape)
    elif system == "fsdp2":
        # Read by accelerate when it creates the process group: CPU offload needs a gloo group
        # for CPU tensors next to NCCL ("cuda:nccl,cpu:gloo").
        os.environ.setdefault("ACCELERATE_USE_FSDP", "true")
        os.environ.setdefault("FSDP_OFFLOAD_PARAMS", "true")
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = fsdp2_config()
    if system in SPEED_VARIANTS:
        kwargs.update(SPEED_VARIANTS[system][1])
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
        import torch

        self.facts = {"distributed_type": str(self.trainer.accelerator.distributed_type),
                      "torch_num_threads": torch.get_num_threads(),
                      "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
        if self.system in DEEPSPEED_SYSTEMS:
            self.facts.update(_check_deepspeed(self.trainer, self.system))
        else:
            check = {"megatrain": _check_megatrain, "plain": _check_plain, "fsdp2": _check_fsdp2}[base_system(self.system)]
            self.facts.update(check(self.trainer))
            if self.system in SPEED_VARIANTS:
                self.facts.update(_check_speed_options(self.trainer, self.system))


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
    facts.update(config=engine.config.to_dict(), host_staging=engine.store.staging.enabled,
                 chunked_loss=engine.chunked_loss_active, adamw_kernel=getattr(optimizer, "kernel", None))
    return facts


def _check_speed_options(trainer, system: str) -> dict[str, Any]:
    """The speed options took effect: the compiled regions or model, Liger's modules."""
    from megatrain_hf import engine_of

    engine = engine_of(trainer.model)
    facts: dict[str, Any] = {}
    if trainer.args.torch_compile:
        if engine is not None:
            facts["compiled"] = engine.runner.compiler is not None
        else:
            facts["compiled"] = hasattr(trainer.model_wrapped, "_orig_mod")
        _require(facts["compiled"], f"{system}: the layers (megatrain) or the model (plain) compiled", facts)
    if trainer.args.use_liger_kernel:
        model = trainer.model
        mlp = model.model.layers[0].mlp
        forward = mlp.__dict__.get("forward") or type(mlp).forward
        facts["mlp_forward"] = getattr(forward, "__qualname__", str(forward))
        _require("Liger" in facts["mlp_forward"], f"{system}: Liger's SwiGLU in the layers", facts)
    return facts


def _check_plain(trainer) -> dict[str, Any]:
    from accelerate.utils import DistributedType

    devices = sorted({str(p.device) for p in trainer.model.parameters()})
    facts = {"param_devices": devices}
    _require(trainer.accelerator.distributed_type == DistributedType.NO, "no distribution", facts)
    return facts


def _device_name(offload) -> str:
    """``"cpu"`` / ``"none"`` of a DeepSpeed offload config object (None: not configured)."""
    device = getattr(offload, "device", None)
    return str(getattr(device, "value", device or "none"))


def _check_deepspeed(trainer, system: str) -> dict[str, Any]:
    from accelerate.utils import DistributedType

    engine = trainer.model_wrapped
    expected = deepspeed_config(system, _shape_of(trainer.model))["zero_optimization"]
    offload_opt = _call(engine, "zero_offload_optimizer")
    zero_optimizer = getattr(engine, "optimizer", None)
    basic = getattr(engine, "basic_optimizer", None)
    facts: dict[str, Any] = {
        "zero_optimization_stage": int(_call(engine, "zero_optimization_stage") or 0),
        "offload_param_device": _device_name(_call(engine, "zero_offload_param")),
        "offload_optimizer_device": _device_name(offload_opt),
        "offload_optimizer_pin_memory": getattr(offload_opt, "pin_memory", None),
        "offload_ratio": getattr(offload_opt, "ratio", None),
        "zenflow": bool(getattr(engine, "zenflow", False)),
        "zero_optimizer": type(zero_optimizer).__name__,
        "basic_optimizer": type(basic).__name__,
    }
    placement = getattr(zero_optimizer, "subgroup_to_device", None)  # ZeRO-3 with offloaded optimizer
    if isinstance(placement, dict):
        facts["optimizer_subgroups"] = len(placement)
        facts["optimizer_subgroups_on_cpu"] = sum(1 for d in placement.values() if d == "cpu")
    _require(trainer.accelerator.distributed_type == DistributedType.DEEPSPEED
             and facts["zero_optimization_stage"] == expected["stage"], f"DeepSpeed ZeRO stage {expected['stage']}",
             facts)
    _require(facts["offload_param_device"] == _device_name_of(expected.get("offload_param"))
             and facts["offload_optimizer_device"] == "cpu", "the configured offload devices", facts)
    _require(facts["offload_ratio"] == expected["offload_optimizer"].get("ratio", 1.0), "the configured offload ratio",
             facts)
    _require(facts["zenflow"] == ("zenflow" in expected), "ZenFlow on exactly when configured", facts)
    _require(facts["basic_optimizer"] in ("DeepSpeedCPUAdam", "ZenFlowCPUAdam"), "DeepSpeed's CPU Adam", facts)
    return facts


def _device_name_of(offload: dict[str, Any] | None) -> str:
    return offload["device"] if offload else "none"


def _shape_of(model) -> ModelShape:
    return ModelShape.from_hf_config(model.config)


def _check_fsdp2(trainer) -> dict[str, Any]:
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)  # absent when FSDP is not on
    sharded = [type(m).__name__ for m in trainer.model.modules() if isinstance(m, FSDPModule)]
    local = [getattr(p, "to_local", lambda p=p: p)() for p in trainer.model.parameters()]
    policy = getattr(plugin, "cpu_offload", None)
    facts = {"fsdp_version": getattr(plugin, "fsdp_version", None), "fsdp_modules": len(sharded),
             "offload_policy": type(policy).__name__, "pin_memory": getattr(policy, "pin_memory", None),
             "reshard_after_forward": getattr(plugin, "reshard_after_forward", None),
             "param_devices": sorted({str(t.device) for t in local})}
    _require(trainer.accelerator.distributed_type == DistributedType.FSDP and facts["fsdp_version"] == 2
             and len(sharded) > 0, "FSDP2 (fully_shard) modules", facts)
    _require(isinstance(policy, CPUOffloadPolicy) and facts["param_devices"] == ["cpu"],
             "CPUOffloadPolicy with parameters on the CPU", facts)
    return facts


def _call(obj, name: str):
    method = getattr(obj, name, None)
    return method() if callable(method) else None


def extra_callbacks(system: str) -> list:
    """Callbacks the system itself needs (the megatrain plugin), besides the bench's timer."""
    if base_system(system) != "megatrain":
        return []
    from megatrain_hf import MegaTrainConfig, MegaTrainPlugin

    # MEGATRAIN_CONFIG (JSON, as `megatrain launch` hands it over) sets options, e.g.
    # MEGATRAIN_CONFIG='{"host_staging": false}' megatrain bench ...; the bench records every metric
    # (observation only: no option of the training itself changes)
    config = MegaTrainConfig.from_env()
    if "metrics" not in json.loads(os.environ.get("MEGATRAIN_CONFIG") or "{}"):
        config = dataclasses.replace(config, metrics="all")
    return [MegaTrainPlugin(config)]

"""``megatrain estimate``'s decisions: the engine's training plan (``megatrain_hf/plan.py``) of a shape.

The estimate's flags become a ``MegaTrainConfig`` and a :class:`~megatrain_hf.plan.Machine` (a CUDA
device, ``--world-size`` ranks, ``--host-gib`` or this machine's RAM, ``--disk-gib`` or
``--offload-dir``'s free space); the units' layout comes from the shape
(``memory/model_layout.shape_sizes``) instead of a model. :func:`resolve` is the engine's own
resolution, so the estimate refuses what the engine would refuse, with the same message, and prints
the same decisions. A plan that RAM + disk cannot hold is reported, not raised: the estimate says
what fits.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from ..config import MegaTrainConfig
from ..errors import LongContextFitError, MegatrainConfigError
from ..memory.host import GiB, gib
from ..memory.model_layout import shape_sizes
from ..memory.shapes import ModelShape
from ..plan import ADJUSTMENTS, Machine, Run, TrainingPlan, check, resolve


def config_of(args) -> MegaTrainConfig:
    """The options the estimate's flags stand for (``offload_dir`` checked as the engine checks it)."""
    if args.offload_window < 2:
        raise MegatrainConfigError(
            f"--offload-window {args.offload_window}: must be >= 2 (the unit updating and the one written back "
            "behind it). Fix: --offload-window 4, the default.")
    placing = args.max_seq_len is not None  # the flags not given are the placement's to choose ("auto")
    return MegaTrainConfig(
        compute_dtype=args.dtype, optimizer_state=args.optimizer_state,
        host_staging=args.host_staging if args.host_staging is not None else "auto" if placing else True,
        grad_dtype=args.grad_dtype, sequence_tile_tokens=args.sequence_tile_tokens, max_seq_len=args.max_seq_len,
        checkpoint_interval=args.checkpoint_interval or "auto", chunked_loss=args.chunked_loss,
        loss_chunk_tokens=args.loss_chunk_tokens, base_quantization=args.base_quantization,
        offload_checkpoints=True if args.offload_checkpoints else "auto",
        max_gpu_memory=int(args.gpu_gib * GiB) if args.gpu_gib is not None else None,
        offload_dir=args.offload_dir, offload_state=args.offload_state, offload_window=args.offload_window,
        experts_dtype=args.experts_dtype)


def shape_plan(args, shape: ModelShape, ram_available: int, disk_free: int | None,
               gpu_working_set: int | None = None) -> tuple[TrainingPlan, str | None]:
    """(the plan of ``shape`` on the machine the flags describe, the engine's refusal for lack of RAM or
    disk or None). Raises what the engine refuses for options that do not combine. ``gpu_working_set``: the
    streamed step's GPU bytes (the memory plan's), which the resident units' budget leaves free."""
    config = config_of(args)
    gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    machine = Machine(torch.device("cuda"), cuda=True, world_size=args.world_size, ram_available=ram_available,
                      disk_free=disk_free, cpus=config.resolve_host_threads(),
                      grad_dtype_tensors=hasattr(torch.Tensor, "grad_dtype"), gpu_memory=gpu)
    run = Run(bf16=args.dtype == "bf16", grad_accum=args.grad_accum, gpu_working_set=gpu_working_set,
              experts=shape.experts_kernel if shape.experts else None)
    if args.disk_gib is not None and args.offload_dir is None:  # a tier planned on --disk-gib alone
        what_if = copy.copy(config)
        what_if.offload_dir = "(--disk-gib)"  # planning only: the rules read whether it is set
        check(what_if, machine, run)

    def sizes(compute: torch.dtype, experts: torch.dtype | None):  # the routed experts in fp32 where the plan says
        return shape_sizes(shape, compute, args.lora_rank, args.base_quantization,
                           "auto" if experts == torch.float32 else "compute")

    try:
        return resolve(config, machine, run, sizes, lambda: shape), None
    except LongContextFitError as exc:  # max_seq_len: the plan of the options as given, and the engine's refusal
        config, refusal = dataclasses.replace(config, max_seq_len=None), str(exc)
        try:
            return resolve(config, machine, run, sizes), refusal
        except MemoryError:
            pass
    except MemoryError as exc:  # HostMemoryError, DiskSpaceError: the arithmetic is the estimate's own table
        refusal = str(exc).split("\n", 1)[0]
    unchecked = dataclasses.replace(machine, ram_available=None, disk_free=1 << 62)
    return resolve(config, unchecked, run, sizes, lambda: shape), refusal


def describe(plan: TrainingPlan, refusal: str | None = None) -> str:
    """The decisions and the adjustments as a table."""
    lines = ["DECISIONS (the engine's plan, megatrain_hf/plan.py)"]
    lines += [f"  {name:<34}{value}" for name, value in decisions(plan)]
    for key, detail in plan.adjustments:
        (choice, other), what = ADJUSTMENTS[key]
        lines.append(f"  adjusted: {choice} with {other}: {what}" + (f" ({detail})" if detail else ""))
    if refusal is not None:
        lines.append(f"  the engine would refuse to attach here: {refusal}")
    return "\n".join(lines)


def as_dict(plan: TrainingPlan, refusal: str | None = None) -> dict:
    return {"decisions": dict(decisions(plan)), "adjustments": [key for key, _ in plan.adjustments],
            "refusal": refusal}


def decisions(plan: TrainingPlan) -> list[tuple[str, str]]:
    """(decision, value) rows of ``plan``."""
    tiers, moments, own, act = plan.disk.tiers, plan.optimizer.moments, plan.ownership, plan.activations
    where = (f"on disk for {len(tiers.units)} unit(s) ({gib(tiers.disk_bytes)} GiB, {plan.disk.window} RAM slots)"
             if tiers.on_disk else "in RAM")
    experts = plan.precision.experts
    return [
        ("compute dtype", _name(plan.precision.compute)),
        *([("routed experts", f"{_name(experts)} on the wire and in the compute"
            + (" (as plain bf16 training: their kernel ignores autocast)" if experts != plan.precision.compute else ""))]
          if experts is not None else []),
        ("gradient accumulators", f"{_name(plan.precision.grads)} (the streamed matrices; the rest fp32)"),
        ("AdamW moments", "none planned (replace_adamw=False)" if moments is None else f"{moments.mode}, {where}"),
        ("fp32 masters", f"on disk for {len(tiers.masters)} unit(s)" if tiers.masters else "in RAM"),
        ("host staging copy", "kept" if plan.host.staging else "none (the device rounds the fp32 masters)"),
        ("pinned host memory", "yes" if plan.host.pin else "no"),
        ("ownership", f"sharded by unit over {own.world_size} ranks" if own.sharded else "every unit local"),
        ("transport", "CUDA streams" if plan.transport.streams else "inline (CPU)"),
        ("host update", f"{plan.optimizer.kernel} kernel, {plan.optimizer.threads} threads"
         + (", the device takes a share" if plan.optimizer.device_update else "")),
        ("activation checkpoints", {True: "pinned host", False: "on the device"}.get(
            act.offload_checkpoints, "auto (the GPU budget decides)") + f", every {act.checkpoint_interval} unit(s)"),
        ("MLP tiles", f"sequence_tile_tokens={act.tile_tokens!r}"),
        ("chunked loss", "on" if plan.loss.chunked else "off at attach"),
        ("resident units", _resident(plan)),
    ]


def _resident(plan: TrainingPlan) -> str:
    """How many units stay whole on the device, and how many the GPU budget would hold."""
    r = plan.residency
    if r.fit is None:
        return f"{len(r.units)} (no GPU budget given: --gpu-gib)" if not r.units else f"{len(r.units)} placed"
    room = f"{r.fit} fit {gib(r.budget)} GiB (the GPU budget less the streamed step's {gib(plan.run.gpu_working_set or 0)})"
    return f"{len(r.units)} placed; {room}" + ("; 0 placed on CUDA until a GPU run measured it"
                                               if plan.config.resident_units == "auto" and r.fit else "")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")

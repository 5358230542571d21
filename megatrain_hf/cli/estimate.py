"""``megatrain estimate``: print the memory plan of a model, what fits this machine, and a chart."""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

from ..errors import UnsupportedModelError
from .decisions import as_dict, describe, shape_plan
from ..models.families import FAMILIES, unsupported_message
from ..memory import activations
from ..errors import LongContextFitError
from ..memory import long_context
from ..memory.fit import ModelFit, largest_model, largest_preset
from ..memory.host import DEFAULT_HEADROOM_BYTES, GiB, available_host_bytes
from ..memory.host import gib as _gib
from ..memory.distributed import plan_ranks
from ..memory.plan import MemoryPlan, plan_memory
from ..memory.shapes import PRESETS, ModelShape, format_count, model_config


def estimate_main(argv: list[str] | None = None) -> int:
    """``megatrain estimate``: print the memory plan of a model and what fits this machine."""
    parser = argparse.ArgumentParser(
        prog="megatrain estimate",
        description="Host RAM (exact) and GPU memory (estimate) needed to train a model with megatrain.",
    )
    parser.add_argument("--model", "--config", dest="model", required=True, metavar="MODEL",
                        help=f"preset ({', '.join(PRESETS)}), a model directory with config.json, or a config.json "
                             "(--config is the same option)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default 4096, or --max-seq-len's)")
    parser.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                        help="plan as the engine does with MegaTrainConfig(max_seq_len=N): the options not given "
                             "here (--offload-checkpoints, --checkpoint-interval, --host-staging, --offload-state) "
                             "take the exact placement at N tokens on the GPU (--gpu-gib, else GPU 0), the host RAM "
                             "and the disk; DECISIONS show it; exit code 1 with the engine's refusal when none fits")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="compute dtype (default bf16)")
    parser.add_argument("--layer-major", action=argparse.BooleanOptionalAction, default=True,
                        help="all grad-accum micro-batches in flight (layer-major schedule, Trainer's default "
                             "unless the model has dropout; --no-layer-major: one at a time)")
    parser.add_argument("--chunked-loss", action=argparse.BooleanOptionalAction, default=True,
                        help="head + loss chunk by chunk (the default under plain Trainer; --no-chunked-loss: "
                             "full logits, e.g. Trainer subclasses)")
    parser.add_argument("--host-staging", action=argparse.BooleanOptionalAction, default=None,
                        help="keep a bf16 host copy of the matrices (2 B/param); --no-host-staging: send fp32 "
                             "and round on the GPU (what host_staging='auto' does when RAM is short)")
    parser.add_argument("--offload-checkpoints", action="store_true",
                        help="activation checkpoints in pinned host memory (offload_checkpoints=True): GPU flat "
                             "with depth and micro-batches in flight, host RAM pays")
    parser.add_argument("--optimizer-state", choices=["fp32", "bf16", "8bit", "4bit"], default="fp32",
                        help="format of the AdamW moments, in host RAM or with --offload-dir on disk "
                             "(optimizer_state; default fp32, 8 B/param; 8bit ~2 B/param, docs/optimizer-state.md)")
    parser.add_argument("--experts-dtype", choices=["auto", "compute"], default="auto",
                        help="a mixture-of-experts model's routed experts: 'auto' (default) fp32 where plain bf16 "
                             "training computes them in fp32 (transformers' grouped_mm kernel), 'compute' in the "
                             "compute dtype (half their link bytes, not plain training's arithmetic)")
    parser.add_argument("--grad-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="the layers' matrices' gradient accumulators (grad_dtype; bf16: 2 B/param, exact at "
                             "--grad-accum 1 with bf16 compute)")
    parser.add_argument("--sequence-tile-tokens", type=_tile_arg, default="auto", metavar="auto|none|N",
                        help="tokens per MLP tile (sequence_tile_tokens; default auto)")
    parser.add_argument("--checkpoint-interval", type=int, default=None, metavar="K",
                        help="keep every K-th unit's activation checkpoint (checkpoint_interval; default 1)")
    parser.add_argument("--gpu-gib", type=float, default=None,
                        help="GPU memory to plan against: prints the joint plan at --seq-len (optimizer state and "
                             "activation checkpoints placed over GPU, host RAM and --disk-gib / --offload-dir), its "
                             "GPU and host peaks and the time each tier adds, and the longest sequence that fits; "
                             "exit code 1 when --seq-len does not fit")
    parser.add_argument("--tflops", type=float, default=long_context.SUSTAINED_FLOPS / 1e12,
                        help="sustained TFLOPS the joint plan's step time assumes (default: the paper's 400)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=None, help="tokens per loss chunk (default: auto)")
    parser.add_argument("--lora-rank", type=int, default=None, help="plan LoRA of this rank on all linears")
    parser.add_argument("--base-quantization", choices=["none", "int8", "nf4"], default="none",
                        help="with --lora-rank: the frozen base stored and streamed quantized "
                             "(MegaTrainConfig.base_quantization; docs/qlora.md)")
    parser.add_argument("--host-gib", type=float, default=None,
                        help="plan against this much RAM instead of this machine's available RAM")
    parser.add_argument("--offload-dir", default=None, metavar="DIR",
                        help="plan the disk tier (offload_dir=DIR): the AdamW moments on DIR's filesystem, RAM and "
                             "disk per tier, disk bytes per optimizer step, the largest model RAM + disk hold")
    parser.add_argument("--offload-state", choices=["auto", "moments", "all"], default="auto",
                        help="with --offload-dir: 'all' plans the fp32 masters of the matrices on disk too "
                             "(MegaTrainConfig.offload_state; needs bf16 compute and the host staging copy)")
    parser.add_argument("--offload-window", type=int, default=4, metavar="N",
                        help="with --offload-dir: the disk tier's RAM slots (MegaTrainConfig.offload_window, >= 2)")
    parser.add_argument("--disk-gib", type=float, default=None,
                        help="with --offload-dir: plan against this much free disk instead of DIR's free space")
    parser.add_argument("--world-size", type=int, default=1,
                        help="data-parallel processes (GPUs) in all: host RAM per rank and per host (default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="hosts the processes run on (default 1)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--chart", default=None, metavar="PNG", help="also write a bar chart of the plan")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help is 0, usage errors are 2
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    if args.seq_len is None:
        args.seq_len = args.max_seq_len or 4096
    try:
        shape = shape_of(args.model)
        if args.host_gib is not None:
            available, source = int(args.host_gib * GiB), "given by --host-gib"
        else:
            available, source = available_host_bytes(), "available on this machine now"
        disk_free, where = _disk_free(args)
        given = copy.copy(args)
        training = shape_plan(args, shape, available, disk_free)  # the engine's refusals, its decisions
        _take_placement(args, training[0])
        plan = plan_memory(
            shape,
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
            grad_accum=args.grad_accum,
            compute_dtype=args.dtype,
            layer_major=args.layer_major,
            chunked_loss=args.chunked_loss,
            host_staging=args.host_staging,
            offload_checkpoints=args.offload_checkpoints,
            loss_chunk_tokens=args.loss_chunk_tokens,
            lora_rank=args.lora_rank,
            base_quantization=args.base_quantization,
            optimizer_state=args.optimizer_state,
            sequence_tile_tokens=args.sequence_tile_tokens,
            checkpoint_interval=args.checkpoint_interval,
            grad_dtype=args.grad_dtype,
            experts_dtype=args.experts_dtype,
        )
        ranks = plan_ranks(plan, args.world_size, args.nodes, host_staging=args.host_staging)
        # the engine's decisions again, the resident units fitted to what the streamed step leaves of the GPU (the
        # flags as given: the placement taken above is the plan's own)
        training = shape_plan(given, shape, available, disk_free, plan.gpu_total)
    except ValueError as exc:
        print(f"megatrain estimate: error: {exc}", file=sys.stderr)
        return 2
    if args.world_size > 1:
        return _print_ranks(plan, ranks, args, available, source, training)
    required = plan.host_total + DEFAULT_HEADROOM_BYTES
    fits = required <= available
    # the same options as the plan: the bf16 host copy or not, the offloaded checkpoints' tokens
    options = dict(
        compute_dtype=plan.compute_dtype,
        lora_rank=args.lora_rank,
        base_quantization=args.base_quantization,
        host_staging=args.host_staging,
        offload_tokens=plan.seq_len * plan.micro_batch * plan.micro_batches_in_flight if args.offload_checkpoints else 0,
        optimizer_state=args.optimizer_state,
        grad_dtype=args.grad_dtype,
    )
    fit = largest_model(available, base=shape, **options)
    preset = largest_preset(available, **options)
    gpu_available = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    disk = _disk_plan(args, shape, plan, available, disk_free, where) if disk_free is not None else None
    if args.json:
        print(json.dumps({
            "plan": plan.to_dict(),
            "host_available_bytes": available,
            "host_required_bytes": required,
            "headroom_bytes": DEFAULT_HEADROOM_BYTES,
            "fits_host": fits,
            "gpu_available_bytes": gpu_available,
            "fits_gpu": None if gpu_available is None else plan.gpu_total <= gpu_available,
            "largest_preset": preset,
            "max_layers": fit.deepest.layers if fit.deepest else 0,
            "max_layers_params": fit.deepest.params() if fit.deepest else 0,
            "widest_hidden": fit.widest.hidden if fit.widest else None,
            "disk_tier": disk,
            "training_plan": as_dict(*training),
            "long_context": (_long_context_fit(shape, args, int(args.gpu_gib * GiB), available, disk_free)[2]
                             if args.gpu_gib is not None and args.lora_rank is None else None),
        }, indent=2))
        return 0
    print(_table(plan))
    print()
    print(activation_lines(plan))
    print()
    print(describe(*training))
    print()
    if args.chart:
        write_chart(plan, args.chart)
        print(f"chart written to {args.chart}")
    verdict = "fits" if fits else "does NOT fit"
    print(f"host RAM {source}: {_gib(available)} GiB; plan {_gib(plan.host_total)} + headroom "
          f"{_gib(DEFAULT_HEADROOM_BYTES)} = {_gib(required)} GiB -> {verdict}"
          + ("" if fits else f" (short by {_gib(required - available)} GiB)"))
    if gpu_available is not None:
        gpu_fits = "fits" if plan.gpu_total <= gpu_available else "does NOT fit"
        print(f"GPU 0: {_gib(gpu_available)} GiB; estimate {_gib(plan.gpu_total)} GiB -> {gpu_fits}")
    else:
        print(f"GPU: none visible here; the estimate above is {_gib(plan.gpu_total)} GiB")
    long_fits = True
    if args.gpu_gib is not None and args.lora_rank is None:
        text, long_fits, _ = _long_context_fit(shape, args, int(args.gpu_gib * GiB), available, disk_free)
        print()
        print(text)
        print()
    mode = f"LoRA r={args.lora_rank}, " if args.lora_rank is not None else ""
    if args.base_quantization != "none":
        mode += f"{args.base_quantization} base, "
    print(f"largest preset that fits ({mode}{plan.compute_dtype}): {preset or 'none'}")
    print(_describe(fit))
    if disk is not None:
        print()
        print(_disk_table(disk))
    if not fits:
        lora_hint = "" if args.lora_rank is not None else ", --lora-rank (LoRA)"
        print(f"to fit: fewer layers / a smaller model{lora_hint}, or more RAM")
    placed = args.max_seq_len is None or training[0].long_context is not None
    return 0 if long_fits and placed else 1


def _take_placement(args, training) -> None:
    """The options the training plan settled (``--max-seq-len``'s placement, or the flags' defaults) as the flags
    the memory plan reads."""
    config = training.config
    args.checkpoint_interval = config.resolve_checkpoint_interval()
    args.host_staging = config.host_staging is not False
    args.offload_checkpoints = config.offload_checkpoints in (True, "disk")


def _disk_free(args) -> tuple[int | None, str]:
    """Free disk to plan the tier against: ``--disk-gib``, or ``--offload-dir``'s free space (None: no tier)."""
    from ..memory import disk

    if args.disk_gib is not None:
        return int(args.disk_gib * GiB), "given by --disk-gib"
    if args.offload_dir is not None:
        return disk.disk_free_bytes(disk.check_offload_dir(args.offload_dir)), f"free in {args.offload_dir}"
    return None, ""


def _disk_plan(args, shape: ModelShape, plan: MemoryPlan, ram_available: int, free: int, where: str) -> dict:
    """The disk tier's numbers (AdamW moments on disk) for ``plan``, against RAM and free disk (the options
    were checked by the training plan: ``cli/decisions.py``)."""
    from ..memory import disk

    masters = args.offload_state == "all"
    tier = disk.shape_tier(shape, plan.compute_dtype, args.lora_rank, window=args.offload_window,
                           optimizer_state=plan.optimizer_state, masters=masters, experts_dtype=plan.experts_dtype)
    ram = disk.ram_with_tier(plan, tier)

    def plan_of(s: ModelShape) -> MemoryPlan:
        return plan_memory(s, seq_len=plan.seq_len, micro_batch=plan.micro_batch, grad_accum=plan.grad_accum,
                           compute_dtype=plan.compute_dtype, layer_major=args.layer_major,
                           chunked_loss=args.chunked_loss, host_staging=args.host_staging,
                           offload_checkpoints=args.offload_checkpoints, loss_chunk_tokens=args.loss_chunk_tokens,
                           lora_rank=args.lora_rank, optimizer_state=plan.optimizer_state,
                           grad_dtype=plan.grad_dtype, experts_dtype=plan.experts_dtype)

    layers, params = disk.deepest_with_tier(shape, ram_available, free, plan_of, masters=masters,
                                            window=args.offload_window)
    return {
        "optimizer_state": plan.optimizer_state, "offload_state": args.offload_state,
        "masters_on_disk_bytes": tier.master_bytes,
        "disk_bytes": tier.disk_bytes, "ram_window_bytes": tier.ram_bytes, "window_slots": args.offload_window,
        "host_ram_bytes": ram, "host_ram_required_bytes": ram + DEFAULT_HEADROOM_BYTES,
        "host_ram_available_bytes": ram_available, "disk_free_bytes": free, "disk_source": where,
        "disk_required_bytes": tier.disk_bytes + disk.DISK_HEADROOM_BYTES,
        "read_per_step_bytes": tier.read_per_step, "written_per_step_bytes": tier.written_per_step,
        "fits": ram + DEFAULT_HEADROOM_BYTES <= ram_available and tier.disk_bytes + disk.DISK_HEADROOM_BYTES <= free,
        "max_layers": layers, "max_layers_params": params,
    }


def _disk_table(d: dict) -> str:
    w = 52
    fits = "fits" if d["fits"] else "does NOT fit"
    return "\n".join([
        f"{'DISK TIER (offload_dir: AdamW moments' + (', matrix masters' if d['masters_on_disk_bytes'] else '') + ' on disk)':<{w}}{'GiB':>9}",
        f"  {'RAM: the plan without ' + ('the moments, matrix masters' if d['masters_on_disk_bytes'] else 'the moments'):<{w - 2}}"
        f"{_gib(d['host_ram_bytes'] - d['ram_window_bytes']):>9}",
        f"  {'RAM: window of ' + str(d['window_slots']) + ' unit slots':<{w - 2}}{_gib(d['ram_window_bytes']):>9}",
        f"  {'RAM total (+ headroom ' + _gib(DEFAULT_HEADROOM_BYTES) + ')':<{w - 2}}"
        f"{_gib(d['host_ram_required_bytes']):>9}   available {_gib(d['host_ram_available_bytes'])}",
        f"  {'disk: AdamW moments (exp_avg + exp_avg_sq, ' + d['optimizer_state'] + ')':<{w - 2}}"
        f"{_gib(d['disk_bytes'] - d['masters_on_disk_bytes']):>9}" + (
            f"\n  {'disk: fp32 masters of the matrices':<{w - 2}}{_gib(d['masters_on_disk_bytes']):>9}"
            if d['masters_on_disk_bytes'] else ""),
        f"  {'disk total (+ 1.00 headroom)':<{w - 2}}{_gib(d['disk_required_bytes']):>9}   "
        f"{d['disk_source']}: {_gib(d['disk_free_bytes'])}",
        f"  -> {fits}",
        f"  per optimizer step: {_gib(d['read_per_step_bytes'])} GiB read, {_gib(d['written_per_step_bytes'])} GiB "
        f"written (drive endurance: {d['written_per_step_bytes'] * 1000 / 1e12:.2f} TB written per 1000 steps)",
        f"  largest depth that fits RAM + disk: {d['max_layers']} layers = {format_count(d['max_layers_params'])} "
        "params",
    ])
def _print_ranks(plan: MemoryPlan, ranks, args, available: int, source: str, training) -> int:
    """Data parallelism: the single-GPU plan, then host RAM per rank and host and what one host has."""
    need = max(ranks.host_bytes) + DEFAULT_HEADROOM_BYTES
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "ranks": ranks.to_dict(), "host_available_bytes": available,
                          "host_required_bytes": need, "fits_host": need <= available,
                          "training_plan": as_dict(*training)}, indent=2))
        return 0
    print(_table(plan))
    print()
    print(ranks.table())
    print()
    print(describe(*training))
    verdict = "fits" if need <= available else "does NOT fit"
    print(f"host RAM {source}: {_gib(available)} GiB per host; the fullest host {_gib(max(ranks.host_bytes))} + "
          f"headroom {_gib(DEFAULT_HEADROOM_BYTES)} = {_gib(need)} GiB -> {verdict}")
    return 0
def _tile_arg(value: str):
    if value in ("auto", "none", "None"):
        return None if value.lower() == "none" else "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: allowed auto, none or a number of tokens") from None


def activation_lines(plan: MemoryPlan) -> str:
    """Where the activation bytes of one micro-batch go, per unit and per token."""
    s, tokens = plan.shape, plan.tokens_per_micro_batch
    cbytes = 2 if plan.compute_dtype == "bf16" else 4
    untiled = activations.layer_working_set(tokens, s.hidden, s.q_dim, s.kv_dim, s.intermediate, cbytes)
    kept = activations.kept_checkpoints(s.layers, plan.checkpoint_interval)
    chunk = plan.gpu_logits // (s.vocab * (cbytes + 12))  # tokens of the logits the plan holds at once
    tile = plan.sequence_tile_tokens
    ckpt_where = "host" if plan.host_checkpoints else "GPU"
    rows = [(f"checkpoint per unit (fp32 tokens x hidden), {kept} kept on the {ckpt_where}", tokens * s.hidden * 4),
            (f"inputs of a block held (checkpoint_interval={plan.checkpoint_interval})", plan.gpu_recomputed_inputs),
            ("one layer's recompute, MLP untiled", untiled),
            (f"one layer's recompute, MLP in {activations.tiles(tokens, tile)} tiles of {tile} tokens" if tile
             else "one layer's recompute as planned (untiled)", plan.gpu_layer_working_set),
            (f"logits chunk ({min(tokens, chunk)} tokens x vocab {s.vocab})", plan.gpu_logits)]
    lines = [f"{f'ACTIVATIONS ({tokens} tokens per micro-batch)':<64}{'GiB':>9}"]
    lines += [f"  {label:<62}{_gib(value):>9}" for label, value in rows]
    return "\n".join(lines)


def _long_context_fit(shape: ModelShape, args, gpu_bytes: int, host_bytes: int, disk_bytes: int | None) -> tuple[str, bool, dict]:
    """The joint plan at ``--seq-len`` (``memory/long_context.py``) and the longest length that fits: (text,
    whether it fits, JSON)."""
    options = dict(micro_batch=args.micro_batch, grad_accum=args.grad_accum, layer_major=args.layer_major,
                   compute_dtype=args.dtype, chunked_loss=args.chunked_loss, loss_chunk_tokens=args.loss_chunk_tokens,
                   lora_rank=args.lora_rank, flops=args.tflops * 1e12)
    budget = f"a {_gib(gpu_bytes)} GiB GPU and {_gib(host_bytes)} GiB host RAM" + (
        f" and {_gib(disk_bytes)} GiB of disk" if disk_bytes is not None else "")
    seq, best = long_context.longest(shape, gpu_bytes, host_bytes, disk_bytes, **options)
    longest_line = f"longest sequence that fits {budget}: {seq} tokens" + (f" ({best.placement()})" if best else "")
    try:
        plan = long_context.plan_long_context(shape, args.seq_len, gpu_bytes, host_bytes, disk_bytes, **options)
    except LongContextFitError as exc:
        return f"at seq {args.seq_len} on {budget}: does NOT fit\n{exc}\n{longest_line}", False, {
            "fits": False, "refusal": str(exc), "longest": seq, "longest_plan": best.to_dict() if best else None}
    text = "\n".join(plan.lines() + [f"at seq {args.seq_len} on {budget}: fits ({plan.placement()})", longest_line])
    return text, True, {"fits": True, "plan": plan.to_dict(), "longest": seq}


def _table(plan: MemoryPlan) -> str:
    """``plan.table()`` with its headline's parameter counts in a unit that suits the model (``104 K``, not
    ``0.00 B``)."""
    s = plan.shape
    lora = f", LoRA r={plan.lora_rank}" if plan.lora_rank is not None else ""
    if plan.base_quantization != "none":
        lora += f" on a {plan.base_quantization} base"
    headline = (f"memory plan: {s.name or 'model'}  ({format_count(plan.total_params)} params, "
                f"{format_count(plan.trainable_params)} trainable{lora}), compute {plan.compute_dtype}")
    return headline + "\n" + plan.table().split("\n", 1)[1]


def _describe(fit: ModelFit) -> str:
    """``fit.describe()`` with the parameter counts in a unit that suits them."""
    parts = [f"in {_gib(fit.available_bytes)} GiB (- {_gib(fit.headroom_bytes)} GiB headroom), at the width of "
             f"{fit.base.name or 'the base'}:"]
    if fit.deepest is None:
        parts.append("  not even one layer fits")
    else:
        parts.append(f"  deepest: {fit.deepest.layers} layers = {format_count(fit.deepest.params())} params "
                     f"({_gib(fit.deepest_host_bytes)} GiB host)")
    if fit.widest is not None:
        w = fit.widest
        parts.append(f"  widest at {w.layers} layers: hidden {w.hidden}, intermediate {w.intermediate}, heads "
                     f"{w.heads}/{w.kv_heads} = {format_count(w.params())} params "
                     f"({_gib(fit.widest_host_bytes)} GiB host)")
    return "\n".join(parts)


def write_chart(plan: MemoryPlan, path: str) -> None:
    """A PNG with two stacked bars: host RAM per tier and GPU memory per item (GiB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    breakdowns = (plan.host_breakdown(), plan.gpu_breakdown())
    scale = max(sum(b.values()) for b in breakdowns) / GiB
    for x, breakdown in enumerate(breakdowns):
        bottom = 0.0
        for name, nbytes in breakdown.items():
            value = nbytes / GiB
            if value <= 0:
                continue
            ax.bar(x, value, bottom=bottom, label=name)
            if value > 0.04 * scale:
                ax.text(x, bottom + value / 2, f"{name} {value:.1f}", ha="center", va="center", fontsize=7)
            bottom += value
        ax.text(x, bottom, f"{bottom:.1f} GiB", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([0, 1], ["host RAM", "GPU"])
    ax.set_ylabel("GiB")
    ax.set_title(f"{plan.shape.name or 'model'}: seq {plan.seq_len} x {plan.micro_batch} x {plan.grad_accum}, "
                 f"{plan.compute_dtype}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def shape_of(model: str) -> ModelShape:
    """A preset, or the shape of a config.json whose family the engine supports (else the engine's refusal).

    The top-level ``model_type`` is checked, as the engine checks ``model.config.model_type``: a
    multimodal checkpoint (``gemma3``, whose ``text_config`` is ``gemma3_text``) loads as a model of
    the top-level type."""
    if model in PRESETS:
        return PRESETS[model]
    config = model_config(model)
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    model_type = get("model_type")
    if model_type not in FAMILIES:
        architectures = get("architectures") or []
        raise UnsupportedModelError(
            unsupported_message(model_type, architectures[0] if architectures else f"config {model}"))
    return ModelShape.from_hf_config(config, name=model)

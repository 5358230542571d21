"""One benchmarked system in its own process: ``python -m megatrain_hf.bench.worker --system X``.

A fresh process per system makes peak host RSS and GPU memory that system's own, and lets one
crash or out-of-memory leave the others running. The worker builds the model from a
``LlamaConfig`` (fp32, random init, seeded), trains ``warmup + steps`` optimizer steps of random
token ids through ``Trainer`` and writes one JSON object to ``--json-out``: ``status`` "ok" with
the measurements, or "unavailable" / "failed" with the real error text and no numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from typing import Any

from ..errors import MegatrainConfigError
from .flops import model_flops_per_step, model_flops_per_token
from .presets import ModelShape, add_lora_arguments, add_shape_arguments, shape_from_args
from .systems import (DEEPSPEED_SYSTEMS, DISTRIBUTED_SYSTEMS, SYSTEMS, ZERO3_SYSTEMS, SystemCheck, base_system,
                      check_workload, extra_callbacks, training_arguments)

logger = logging.getLogger(__name__)


class Unavailable(RuntimeError):
    """The system cannot run here (a dependency or a device is missing); the message says which."""


class RandomTokens:
    """``torch.utils.data.Dataset`` of random token ids; sample ``i`` depends only on (seed, i)."""

    def __init__(self, n_samples: int, seq_len: int, vocab: int, seed: int) -> None:
        self.n_samples, self.seq_len, self.vocab, self.seed = n_samples, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.n_samples

    def __getitem__(self, i: int) -> dict:
        import torch

        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatrain_hf.bench.worker", description=__doc__)
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--json-out", required=True)
    add_shape_arguments(p)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--grad-accum", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup-steps", type=int, required=True)
    p.add_argument("--dtype", choices=("bf16", "fp32"), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--seed", type=int, default=0)
    add_lora_arguments(p)
    p.add_argument("--profile", action="store_true",
                   help="run two more steps after the measured ones and record the second (from the first's "
                   "optimizer step) with torch.profiler into <json-out>.trace.json (not part of any measurement)")
    return p.parse_args(argv)


def check_available(system: str, device: str, grad_accum: int = 1, base_quantization: str = "none") -> None:
    """Raise :class:`Unavailable` with the reason when ``system`` cannot run this workload here."""
    import torch

    if base_quantization != "none" and base_system(system) != "megatrain":
        raise Unavailable(f"--base-quantization {base_quantization}: only megatrain stores a quantized base here")

    try:
        check_workload(system, grad_accum)
    except ValueError as exc:
        raise Unavailable(str(exc)) from exc
    if system in ("megatrain_liger", "plain_liger") and importlib.util.find_spec("liger_kernel") is None:
        raise Unavailable(f"{system}: liger-kernel is not installed (pip install 'megatrain_hf[liger]')")
    if system in DEEPSPEED_SYSTEMS:
        try:
            import deepspeed  # noqa: F401
        except Exception as exc:  # ImportError, or a broken install raising anything else
            raise Unavailable(f"deepspeed cannot be imported: {type(exc).__name__}: {exc}") from exc
    if device == "cuda" and not torch.cuda.is_available():
        raise Unavailable(f"--device cuda but torch.cuda.is_available() is False (torch {torch.__version__})")
    if system in DISTRIBUTED_SYSTEMS and device != "cuda":
        raise Unavailable(f"{system} with CPU offload streams to a CUDA device; --device {device} was given")


def llama_config(shape: ModelShape, seq_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        max_position_embeddings=max(seq_len, 2048),
        tie_word_embeddings=False,
        use_cache=False,
    )


def build_lora_model(system: str, shape: ModelShape, seq_len: int, seed: int, rank: int, init_device: str):
    """LoRA of ``rank`` on every linear. megatrain's base is built without weights (its seeded init is
    drawn at attach, on ``init_device``, straight into the host store or the quantizer: a 70 B base is
    never fp32); the others build theirs as :func:`build_model`."""
    import peft
    import torch

    import megatrain_hf

    if base_system(system) == "megatrain":
        base = megatrain_hf.from_config(llama_config(shape, seq_len), seed=seed, device=init_device)
    else:
        base = build_model(shape, seq_len, seed, init_device)
    torch.manual_seed(seed)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                     lora_dropout=0.0))


def build_model(shape: ModelShape, seq_len: int, seed: int, init_device: str = "cpu"):
    """Random-init fp32 Llama of ``shape`` on the CPU (through ``from_config``: ZeRO-3 partitions it at build).

    ``init_device="cuda"`` draws the random weights on the GPU (seconds, where a 7B model takes
    over a minute on the CPU) and then moves the model to the CPU, where every system receives
    it, as from ``from_pretrained``; the values depend on the device's generator.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = llama_config(shape, seq_len)
    torch.manual_seed(seed)
    if init_device == "cpu":  # no device context: ZeRO-3's zero.Init places the partitions itself
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.device(init_device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to("cpu")


def trainable_params(model) -> int:
    """Trainable parameter count (``ds_numel``: ZeRO-3 leaves each local param with 0 elements)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)


def _cuda_index() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def profiled_step(args: argparse.Namespace) -> int:
    """--profile: the step recorded, the second after the measured ones (the first starts the recording)."""
    return args.warmup_steps + args.steps + 2


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Build, train, measure. Raises on any failure (classified by :func:`main`)."""
    import torch
    from transformers import Trainer

    from .metrics import PhaseMarks, ResourceSampler, StepProfiler, StepTimer

    check_available(args.system, args.device, args.grad_accum, args.base_quantization)
    if args.base_quantization != "none":  # megatrain's option, beside those MEGATRAIN_CONFIG names
        if args.lora_rank is None:
            raise MegatrainConfigError("--base-quantization quantizes a frozen LoRA base: give --lora-rank too")
        options = json.loads(os.environ.get("MEGATRAIN_CONFIG") or "{}")
        os.environ["MEGATRAIN_CONFIG"] = json.dumps({**options, "base_quantization": args.base_quantization})
    shape = shape_from_args(args)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(_cuda_index())
    sampler = ResourceSampler(cuda_device=_cuda_index() if cuda else None).start()
    setup: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory(prefix=f"bench-{args.system}-") as tmp:
            t0 = time.perf_counter()
            targs = training_arguments(
                args.system, shape=shape, output_dir=tmp, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                max_steps=profiled_step(args) if args.profile else args.warmup_steps + args.steps,
                bf16=args.dtype == "bf16", use_cpu=not cuda, seed=args.seed,
            )  # before the model: under ZeRO-3, from_config then builds it partitioned (zero.Init)
            # ZeRO-3 builds partitioned under zero.Init (its own device handling); others on the GPU
            init_device = "cuda" if cuda and args.system not in ZERO3_SYSTEMS else "cpu"
            if args.lora_rank is not None:
                model = build_lora_model(args.system, shape, args.seq_len, args.seed, args.lora_rank, init_device)
            else:
                model = build_model(shape, args.seq_len, args.seed, init_device)
            if init_device == "cuda":  # the init's blocks must not stay cached or count as a peak
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                sampler.reset_device_peak()
            sampler.mark("model_built")
            params = trainable_params(model)
            setup["model_build_s"] = time.perf_counter() - t0
            n_samples = (args.warmup_steps + args.steps) * args.grad_accum * args.micro_batch
            data = RandomTokens(n_samples, args.seq_len, shape.vocab, args.seed)
            timer, check = StepTimer(cuda_sync=cuda), SystemCheck(args.system)
            callbacks = [timer, check, PhaseMarks(sampler), *extra_callbacks(args.system)]
            if args.profile:  # a Chrome trace of one extra step, beside the JSON
                callbacks.append(StepProfiler(profiled_step(args), f"{args.json_out}.trace.json"))
            t1 = time.perf_counter()
            trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)
            check.trainer = trainer
            sampler.mark("trainer_built")  # megatrain: attached, host buffers allocated
            setup["trainer_init_s"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            trainer.train()
            setup["train_total_s"] = time.perf_counter() - t2
            attn = getattr(model.config, "_attn_implementation", None)
            engine_peaks = _engine_peaks(model)
    finally:
        sampler.stop()
    result = measurements(args, shape, params, timer, sampler, engine_peaks)
    result["setup_s"] = setup
    result["host_rss_by_phase"] = sampler.marks
    result["system_check"] = check.facts
    result["attn_implementation"] = attn
    if args.profile:
        result["profiled_step"] = profiled_step(args)
        result["profile_note"] = "the memory peaks include the two steps run for the profile"
    return result


def _engine_peaks(model) -> tuple[int, int]:
    """megatrain with max_gpu_memory resets CUDA peak statistics while it measures: its own maxima."""
    try:
        from megatrain_hf import engine_of
    except ImportError:
        return 0, 0
    engine = engine_of(model)
    return (engine.budget.max_peak_allocated, engine.budget.max_peak_reserved) if engine is not None else (0, 0)


def measurements(args, shape: ModelShape, params: int, timer, sampler, engine_peaks=(0, 0)) -> dict[str, Any]:
    """The numbers of a successful run (see the module docstring of :mod:`.metrics`)."""
    import torch

    from .metrics import ru_maxrss_bytes, summarize_steps

    last = args.warmup_steps + args.steps  # the two steps of a profile after it are not measured
    summary = summarize_steps([s for s in timer.steps if s["step"] <= last], args.warmup_steps)
    tokens = args.micro_batch * args.seq_len * args.grad_accum
    lora = getattr(args, "lora_rank", None) is not None  # LoRA: the frozen base costs no weight gradients
    flops = model_flops_per_step(shape, args.seq_len, tokens, params if lora else None)
    flops_causal = model_flops_per_step(shape, args.seq_len, tokens, params if lora else None, "palm_causal")
    mean_s, median_s = summary["step_time_mean_s"], summary["step_time_median_s"]
    gib = 2**30
    cuda = args.device == "cuda"
    result: dict[str, Any] = {
        "status": "ok",
        "params": params,
        "tokens_per_step": tokens,
        "model_flops_per_token": model_flops_per_token(shape, args.seq_len, params if lora else None),
        "model_flops_per_step": flops,
        **summary,
        "tokens_per_s": tokens / mean_s,
        "tokens_per_s_median_step": tokens / median_s,
        "tflops": flops / mean_s / 1e12,
        "model_flops_per_step_causal": flops_causal,
        "tflops_causal": flops_causal / mean_s / 1e12,
        "gpu_peak_allocated_gib": max(torch.cuda.max_memory_allocated(_cuda_index()), engine_peaks[0]) / gib
        if cuda else None,
        "gpu_peak_reserved_gib": max(torch.cuda.max_memory_reserved(_cuda_index()), engine_peaks[1]) / gib
        if cuda else None,
        "gpu_peak_device_used_gib": (sampler.peak_device_used_bytes / gib
                                     if sampler.peak_device_used_bytes is not None else None),
        "host_peak_rss_gib": sampler.peak_rss_bytes / gib,
        "host_ru_maxrss_gib": ru_maxrss_bytes() / gib,
        "losses": [{"step": s, "loss": v} for s, v in sorted(timer.losses.items())],
        "grad_norms": [{"step": s, "grad_norm": v} for s, v in sorted(timer.grad_norms.items())],
        "engine_logs": [{"step": s, **v} for s, v in sorted(timer.engine_logs.items())],
        "steps": timer.steps,
    }
    result.update(link_bytes(args.system, summary.get("engine_counters_per_step")))
    return result


def link_bytes(system: str, counters: dict[str, float] | None) -> dict[str, Any]:
    """Host<->device bytes per optimizer step: megatrain's engine counts them; others are not instrumented."""
    if base_system(system) != "megatrain":
        return {"link_bytes_per_step": None,
                "link_note": f"{system}: host<->device traffic is not instrumented by the benchmark"}
    if not counters or "h2d_bytes" not in counters:
        return {"link_bytes_per_step": None,
                "link_note": "megatrain engine counters (engine_of(model).stats.h2d_bytes/d2h_bytes) not found"}
    # device_update: the optimizer state its share moves counts too
    h2d = counters["h2d_bytes"] + counters.get("update_h2d_bytes", 0.0)
    d2h = counters.get("d2h_bytes", 0.0) + counters.get("update_d2h_bytes", 0.0)
    return {"link_bytes_per_step": {"h2d": h2d, "d2h": d2h, "total": h2d + d2h},
            "link_note": "megatrain engine counters (engine_of(model).stats; with device_update, the "
                         "optimizer state it moves included), mean over measured steps"}


def environment() -> dict[str, Any]:
    """What this worker ran on, as seen from inside it."""
    import platform

    import torch
    import transformers

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "cuda_runtime": torch.version.cuda}
    for name in ("accelerate", "deepspeed"):
        module = sys.modules.get(name)
        env[name] = getattr(module, "__version__", None) if module else None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        env["gpu"] = torch.cuda.get_device_name(_cuda_index())
    return env


def _failure(exc: BaseException) -> dict[str, Any]:
    import torch

    tb = traceback.format_exc()
    if isinstance(exc, Unavailable):
        return {"status": "unavailable", "reason": str(exc)}
    text = str(exc).lower()
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text:
        return {"status": "failed", "reason": f"out of memory: {type(exc).__name__}: {exc}", "traceback": tb}
    return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "traceback": tb}


def main(argv: list[str] | None = None) -> int:
    """Run one system; always write the JSON (exit 0 unless even that is impossible)."""
    args = parse_args(argv)
    try:
        result = train(args)
    except Exception as exc:  # any failure becomes a reported "failed" or "unavailable"
        logger.exception("%s failed", args.system)
        result = _failure(exc)
    result["system"] = args.system
    try:
        result["env"] = environment()
    except Exception as exc:  # noqa: BLE001 -- never lose the result for want of version strings
        result["env"] = {"error": repr(exc)}
    tmp_path = args.json_out + ".tmp"
    with open(tmp_path, "w") as f:
        json.dump(result, f, indent=2, default=str)
    os.replace(tmp_path, args.json_out)
    _shutdown_distributed()
    return 0


def _shutdown_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code = main()
    # The result is on disk. Skip interpreter teardown: freeing tens of GB of pinned memory and
    # joining library threads (DeepSpeed's) can take minutes or hang, and would count against
    # --timeout; the kernel reclaims everything at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

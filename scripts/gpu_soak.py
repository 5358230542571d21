"""Soak run: a Llama trained for many optimizer steps through Trainer + megatrain, resources sampled.

The reliability issue asks for >= 500 steps with host RSS and GPU memory flat (no growth), with
checkpoints saved along the way. Every ``--every`` steps this records host RSS, GPU allocated /
reserved, the number of threads and open file descriptors; the JSON says whether each stayed
flat between ``--from-step`` and the end (within the stated tolerances) and exits 1 if not.

    python scripts/gpu_soak.py --model llama-1.36b --layers 8 --seq-len 1024 --micro-batch 4 \
        --grad-accum 2 --steps 500 --save-steps 250 --from-step 300 --out soak.json   # on the H200
    python scripts/gpu_soak.py --model tiny --device cpu --dtype fp32 --steps 60 --every 10 \
        --from-step 20 --save-steps 30 --out soak.json                          # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time

import psutil
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from megatrain_hf import MegaTrainPlugin, engine_of
from megatrain_hf.bench.worker import RandomTokens, build_model
from megatrain_hf.memory import PRESETS

RSS_GROWTH_MIB = 64  # allowed host RSS growth between --from-step and the end
GPU_GROWTH_MIB = 16  # allowed growth of the GPU bytes allocated at a step's end


class Sampler(TrainerCallback):
    def __init__(self, every: int, cuda: bool, out: str) -> None:
        self.every, self.cuda, self.samples, self.out = every, cuda, {}, out
        self.process = psutil.Process()
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every:
            return
        engine = engine_of(kwargs["model"])
        if engine is not None:
            engine.synchronize()  # the background update of this step is part of the sample
        sample = {
            "time_s": time.perf_counter() - self.started,
            "rss_mib": self.process.memory_info().rss / 2**20,
            "threads": sorted(t.name for t in threading.enumerate()),
            "fds": self.process.num_fds(),
        }
        if self.cuda:
            torch.cuda.synchronize()
            sample["gpu_allocated_mib"] = torch.cuda.memory_allocated() / 2**20
            sample["gpu_reserved_mib"] = torch.cuda.memory_reserved() / 2**20
            sample["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20  # no budget here: never reset
        self.samples[state.global_step] = sample
        with open(self.out, "w") as f:  # partial results survive a killed run
            json.dump({"ok": None, "partial": True, "samples": self.samples}, f, indent=1)


def _ours(threads: list[str]) -> list[str]:
    return [t for t in threads if t.startswith("megatrain")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1.36b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--every", type=int, default=50, help="sample every N optimizer steps")
    p.add_argument("--from-step", type=int, default=300,
                   help="growth is measured from this sample on (after the first checkpoint save: saving "
                        "builds each shard's bytes once, which the allocator may keep)")
    p.add_argument("--save-steps", type=int, default=250, help="checkpoint every N steps (save_total_limit 1)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    shape = PRESETS[args.model]
    if args.layers is not None:
        shape = shape.with_layers(args.layers)
    cuda = args.device == "cuda"
    model = build_model(shape, args.seq_len, seed=0)
    params = sum(x.numel() for x in model.parameters())
    n = args.steps * args.grad_accum * args.micro_batch
    sampler = Sampler(args.every, cuda, args.out)
    with tempfile.TemporaryDirectory(prefix="megatrain-soak-") as out_dir:
        targs = TrainingArguments(
            output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.grad_accum, learning_rate=1e-5, warmup_steps=10,
            lr_scheduler_type="cosine", weight_decay=0.1, max_grad_norm=1.0, bf16=args.dtype == "bf16",
            logging_steps=args.every, save_strategy="steps", save_steps=args.save_steps, save_total_limit=1,
            report_to=[], use_cpu=not cuda, dataloader_num_workers=0, disable_tqdm=True, seed=0,
        )
        trainer = Trainer(model=model, args=targs, train_dataset=RandomTokens(n, args.seq_len, shape.vocab, 0),
                          callbacks=[MegaTrainPlugin(), sampler])
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
    samples = sampler.samples
    first = min(s for s in samples if s >= args.from_step)
    last = max(samples)
    rss_growth = samples[last]["rss_mib"] - samples[first]["rss_mib"]
    checks = {
        "host_rss_growth_mib": rss_growth,
        "host_rss_flat": rss_growth <= RSS_GROWTH_MIB,
        # megatrain's threads (tqdm starts its monitor thread once, at the first checkpoint save)
        "threads_flat": _ours(samples[last]["threads"]) == _ours(samples[first]["threads"]),
        "fds_flat": samples[last]["fds"] <= samples[first]["fds"],
        "finite_parameters": all(bool(torch.isfinite(x).all()) for x in model.parameters()),
    }
    if cuda:
        gpu_growth = samples[last]["gpu_allocated_mib"] - samples[first]["gpu_allocated_mib"]
        checks["gpu_allocated_growth_mib"] = gpu_growth
        checks["gpu_flat"] = gpu_growth <= GPU_GROWTH_MIB
    ok = all(v for k, v in checks.items() if isinstance(v, bool))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {
        "ok": ok, "checks": checks, "tolerances_mib": {"host_rss": RSS_GROWTH_MIB, "gpu_allocated": GPU_GROWTH_MIB},
        "model": shape.name, "layers": shape.layers, "params": params, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "grad_accum": args.grad_accum, "steps": args.steps,
        "save_steps": args.save_steps, "dtype": args.dtype, "device": args.device, "wall_s": wall,
        "steps_per_s": args.steps / wall, "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None, "samples": samples,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("ok", "checks", "wall_s", "params")}, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

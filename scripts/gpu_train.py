"""Train a random-init Llama of a given shape for N steps through Trainer, with or without megatrain.

Used by scripts/gpu_suite.sh on the GPU machine (issue: "a ~1B Llama trains 20 steps through Trainer
with the plugin"). Writes one JSON with per-step wall times, losses, tokens/s, GPU peak and host peak RSS.

    python scripts/gpu_train.py --system megatrain --hidden 2048 --intermediate 5632 --layers 24 \
        --heads 16 --seq 2048 --micro-batch 8 --steps 20 --out result.json

Under ``torchrun --nproc_per_node N`` (megatrain's data parallelism, docs/distributed.md) every rank
trains ``--micro-batch`` sequences per micro-batch (the same tokens per GPU as one process); rank 0
writes the JSON, with ``world_size``, the global ``tokens_per_s`` and every rank's host peak RSS.
"""

import argparse
import json
import resource
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._t = [], None

    def on_step_begin(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=["megatrain", "plain"], required=True)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    config = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.heads, vocab_size=a.vocab,
                         max_position_embeddings=a.seq)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = LlamaForCausalLM(config)
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    callbacks = [StepTimer()]
    if a.system == "megatrain":
        from megatrain_hf import MegaTrainPlugin
        callbacks.append(MegaTrainPlugin())
    args = TrainingArguments(output_dir="/tmp/gpu_train", max_steps=a.steps, per_device_train_batch_size=a.micro_batch,
                             gradient_accumulation_steps=a.grad_accum, bf16=True, learning_rate=1e-5,
                             logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=2,
                             gradient_checkpointing=a.checkpointing, disable_tqdm=True, max_grad_norm=1.0)
    ds = Tokens(a.steps * a.micro_batch * a.grad_accum + 64, a.seq, a.vocab)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    times = callbacks[0].times
    world = args.world_size
    tokens = a.seq * a.micro_batch * a.grad_accum * world  # the global batch
    steady = sorted(times[2:]) or times
    med = steady[len(steady) // 2]
    flops = 6 * n_params * tokens + 12 * a.layers * a.hidden * a.seq * tokens
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20])
    if world > 1:
        import torch.distributed as dist

        every = [torch.zeros(1, device=args.device) for _ in range(world)]
        dist.all_gather(every, rss.to(args.device))  # (the default group: NCCL on GPUs)
        rss_ranks = [float(t) for t in every]
    else:
        rss_ranks = [float(rss)]
    if args.process_index != 0:
        return
    out = {
        "system": a.system, "world_size": world, "params": n_params, "build_s": build_s, "tokens_per_step": tokens,
        "host_peak_rss_GiB_per_rank": rss_ranks,
        "step_times": times, "median_step_s": med, "tokens_per_s": tokens / med,
        "tflops": flops / med / 1e12, "tflops_per_gpu": flops / med / 1e12 / world, "gpu_peak_GiB": torch.cuda.max_memory_allocated() / 2**30,
        "host_peak_rss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "log_history": trainer.state.log_history,
        "args": vars(a),
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k not in ("log_history", "step_times", "losses")}))


if __name__ == "__main__":
    main()

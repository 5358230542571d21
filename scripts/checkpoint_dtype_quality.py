"""The loss band of ``checkpoint_dtype="bf16"``: 300 steps on the demo corpus, bf16 vs fp32 checkpoints.

The corpus, tokenizer and model family are the demo's (examples/demo.py: the Python standard
library's code; a byte-level BPE of 2,048 tokens; a Llama from a config), small enough that both runs
take a few minutes on a CPU. Both train the same model from the same seed on the same batches through
Trainer(bf16=True) + MegaTrainPlugin, one with fp32 activation checkpoints (exact), one with
``checkpoint_dtype="bf16"``; the checkpoints' home does not change the result (tests/parity/
test_checkpoint_homes.py), so both keep them on the device. Prints and writes (JSON) the per-step
training losses, their largest and mean absolute difference, and the held-out loss of each at the end.

    nice python scripts/checkpoint_dtype_quality.py --out docs/results/checkpoint-dtype-quality.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))


def run(dtype: str, args, train_texts, eval_texts, tokenizer) -> dict:
    import torch
    from common import tiny_llama
    from demo import EVAL_BLOCKS, Blocks
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from megatrain_hf import MegaTrainPlugin

    train_set = Blocks(train_texts, tokenizer, args.seq)
    eval_set = Blocks(eval_texts, tokenizer, args.seq, max_blocks=EVAL_BLOCKS)
    torch.manual_seed(0)
    model = tiny_llama(tokenizer, hidden=args.hidden, layers=args.layers, max_positions=args.seq)

    class Record(TrainerCallback):
        def __init__(self):
            self.train, self.eval = [], []

        def on_log(self, a, state, control, logs=None, **kw):
            if "loss" in (logs or {}):
                self.train.append(logs["loss"])
            if "eval_loss" in (logs or {}):
                self.eval.append(logs["eval_loss"])

    record = Record()
    targs = TrainingArguments(
        output_dir=os.path.join(args.work, dtype), max_steps=args.steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=16, learning_rate=args.lr, warmup_steps=args.steps // 10,
        lr_scheduler_type="cosine", weight_decay=0.1, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    plugin = MegaTrainPlugin(checkpoint_dtype=dtype, metrics="none")
    trainer = Trainer(model=model, args=targs, train_dataset=train_set, eval_dataset=eval_set,
                      callbacks=[plugin, record])
    started = time.time()
    trainer.train()
    trainer.evaluate()
    return {"train": record.train, "eval": record.eval[-1], "train_s": time.time() - started,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--chars", type=int, default=1_000_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", default="/tmp/checkpoint-dtype-quality")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "checkpoint-dtype-quality.json"))
    args = parser.parse_args()

    import torch
    from common import quiet, train_tokenizer
    from demo import stdlib_code

    quiet()
    torch.set_num_threads(args.threads)
    train_texts, eval_texts = stdlib_code(args.chars)
    tokenizer = train_tokenizer(train_texts, vocab_size=2048)
    results = {d: run(d, args, train_texts, eval_texts, tokenizer) for d in ("fp32", "bf16")}
    a, b = results["fp32"]["train"], results["bf16"]["train"]
    diffs = [abs(x - y) for x, y in zip(a, b)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    summary = {
        "commit": commit, "command": " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]), "settings": vars(args),
        "params": results["fp32"]["params"], "steps": len(diffs),
        "max_abs_train_loss_diff": max(diffs), "mean_abs_train_loss_diff": sum(diffs) / len(diffs),
        "last10_mean_train_loss": {d: sum(r["train"][-10:]) / 10 for d, r in results.items()},
        "final_eval_loss": {d: r["eval"] for d, r in results.items()},
        "train_s": {d: r["train_s"] for d, r in results.items()}, "train_loss": {d: r["train"] for d, r in results.items()},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    for key in ("params", "steps", "max_abs_train_loss_diff", "mean_abs_train_loss_diff", "last10_mean_train_loss",
                "final_eval_loss", "train_s"):
        print(f"{key}: {summary[key]}")


if __name__ == "__main__":
    main()

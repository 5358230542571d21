"""Training quality of the compressed AdamW moments: fp32 vs 8-bit vs 4-bit (and bf16) on real text.

The corpus, tokenizer and model family are the demo's (examples/demo.py: the Python standard
library's own code, docstrings and comments removed, every 20th file held out; a byte-level BPE of
2,048 tokens; a Llama from a config). Each mode trains the same model from the same seed on the
same batches through Trainer + MegaTrainPlugin(optimizer_state=mode), one subprocess per mode, all
started at once; each logs the training loss every step and the held-out loss every
``--eval_every`` steps. The parent writes a JSON of every curve and a chart (train and eval loss
per mode) and prints the final eval losses relative to fp32.

    nohup python scripts/optimizer_state_quality.py --out docs/results/optimizer-state-quality > q.log 2>&1 &
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
sys.path.insert(0, ROOT)  # this checkout's megatrain_hf, whatever is installed


def run_mode(args) -> None:
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import torch
    from common import quiet, tiny_llama, train_tokenizer
    from demo import EVAL_BLOCKS, Blocks, stdlib_code
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from megatrain_hf import MegaTrainPlugin

    quiet()
    torch.set_num_threads(args.threads)
    train_texts, eval_texts = stdlib_code(args.chars)
    tokenizer = train_tokenizer(train_texts, vocab_size=2048)
    train_set = Blocks(train_texts, tokenizer, args.seq)
    eval_set = Blocks(eval_texts, tokenizer, args.seq, max_blocks=EVAL_BLOCKS)
    model = tiny_llama(tokenizer, hidden=args.hidden, layers=args.layers, max_positions=args.seq)
    n_params = sum(p.numel() for p in model.parameters())

    class Record(TrainerCallback):
        def __init__(self):
            self.train, self.eval, self.started = [], [], time.time()

        def on_log(self, a, state, control, logs=None, **kw):
            logs = logs or {}
            if "loss" in logs:
                self.train.append([state.global_step, logs["loss"]])
            if "eval_loss" in logs:
                self.eval.append([state.global_step, logs["eval_loss"]])
                print(f"{args.mode} step {state.global_step} eval {logs['eval_loss']:.4f} "
                      f"({time.time() - self.started:.0f} s)", flush=True)

    class StepChange(TrainerCallback):
        """The largest change of any parameter element in each optimizer step, in units of that step's
        learning rate (the update waits to finish first), overall and of the input embedding."""

        def __init__(self):
            self.rows, self.before, self.lr = [], None, None

        def snapshot(self):
            return {n: p.detach().clone() for n, p in model.named_parameters()}

        def on_step_begin(self, a, state, control, optimizer=None, **kw):
            self.lr = float(optimizer.param_groups[0]["lr"])
            if self.before is None:
                self.before = self.snapshot()

        def on_step_end(self, a, state, control, optimizer=None, **kw):
            getattr(optimizer, "optimizer", optimizer).synchronize()
            now = self.snapshot()
            change = {n: float((now[n] - self.before[n]).abs().max()) for n in now}
            worst = max(change, key=change.get)
            embed = max(v for n, v in change.items() if "embed_tokens" in n)
            if self.lr > 0:
                self.rows.append([state.global_step, change[worst] / self.lr, embed / self.lr, worst])
            self.before = now

    record, step_change = Record(), StepChange()
    targs = TrainingArguments(
        output_dir=os.path.join(args.work, args.mode), max_steps=args.steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=16, learning_rate=args.lr, warmup_steps=args.steps // 10,
        lr_scheduler_type="cosine", weight_decay=0.1, max_grad_norm=1.0, logging_steps=1, eval_strategy="steps",
        eval_steps=args.eval_every, save_strategy="no", report_to=[], use_cpu=args.device == "cpu", seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    plugin = MegaTrainPlugin(optimizer_state=args.mode, host_adamw_kernel="native", metrics="none")
    trainer = Trainer(model=model, args=targs, train_dataset=train_set, eval_dataset=eval_set, callbacks=[plugin, record, step_change])
    trainer.train()
    if not record.eval or record.eval[-1][0] != args.steps:
        trainer.evaluate()  # recorded by on_log
    final = record.eval[-1][1]
    out = {"mode": args.mode, "params": n_params, "train": record.train, "eval": record.eval, "final_eval": final,
           "train_s": time.time() - record.started, "kernel": trainer.optimizer.optimizer.kernel,
           # per step: [step, max |change| / lr over all elements, the same over the input embedding, its parameter]
           "max_change_per_lr": step_change.rows,
           "max_change_per_lr_overall": max((r[1] for r in step_change.rows), default=None),
           "max_change_per_lr_embedding": max((r[2] for r in step_change.rows), default=None)}
    with open(os.path.join(args.work, f"{args.mode}.json"), "w") as f:
        json.dump(out, f)


def torch_device_name() -> str:
    import torch

    return f"{torch.cuda.get_device_name()} (fp32 compute)"


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, r in results.items():
        steps, losses = zip(*r["train"])
        k = 10  # a running mean of the training loss over 10 steps
        smooth = [sum(losses[max(0, i - k + 1): i + 1]) / len(losses[max(0, i - k + 1): i + 1]) for i in range(len(losses))]
        axes[0].plot(steps, smooth, label=mode)
        e_steps, e_losses = zip(*r["eval"])
        axes[1].plot(e_steps, e_losses, marker="o", label=f"{mode} (final {r['final_eval']:.4f})")
    axes[0].set_title("training loss (running mean of 10 steps)")
    axes[1].set_title("held-out loss")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def chart_log(args) -> None:
    """The held-out curves printed so far by a run (``MODE step N eval LOSS (T s)`` lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[tuple[int, float]]] = {}
    with open(args.from_log) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and parts[1] == "step" and parts[3] == "eval":
                curves.setdefault(parts[0], []).append((int(parts[2]), float(parts[4])))
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, points in curves.items():
        ax.plot(*zip(*points), marker="o", label=f"{mode} (step {points[-1][0]}: {points[-1][1]:.4f})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out loss")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"held-out loss per optimizer_state ({args.hidden}x{args.layers} llama, {args.batch}x{args.seq} tokens)")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    with open(args.out + ".json", "w") as f:
        json.dump({"log": os.path.basename(args.from_log), "eval": curves}, f, indent=1)
    for mode, points in curves.items():
        print(mode, points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="fp32,8bit,4bit")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # a child: train this mode
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--chars", type=int, default=3_000_000, help="characters of stdlib code in the corpus")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per mode's process")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the model computes (fp32 either way; the moments are on the host in both)")
    parser.add_argument("--from_json", default=None,
                        help="only draw the chart of a finished run's JSON (written where matplotlib is missing)")
    parser.add_argument("--work", default="/tmp/optimizer-state-quality")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "optimizer-state-quality"),
                        help="prefix of the .json and .png written")
    parser.add_argument("--from_log", default=None,
                        help="only chart the eval lines of a run's log (a run stopped before its end)")
    args = parser.parse_args()
    if args.from_log:
        chart_log(args)
        return
    if args.from_json:
        with open(args.from_json) as f:
            summary = json.load(f)
        plot(summary["results"], args.out + ".png", summary["title"])
        return
    if args.mode:
        run_mode(args)
        return
    os.makedirs(args.work, exist_ok=True)
    modes = args.modes.split(",")
    started = time.time()
    commit = os.environ.get("MEGATRAIN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    child = [a for a in sys.argv[1:]]
    procs = {m: subprocess.Popen([sys.executable, __file__, *child, "--mode", m]) for m in modes}
    failed = [m for m, p in procs.items() if p.wait() != 0]
    if failed:
        raise SystemExit(f"modes {failed} failed")
    results = {}
    for m in modes:
        with open(os.path.join(args.work, f"{m}.json")) as f:
            results[m] = json.load(f)
    n = results[modes[0]]["params"]
    where = "2-core CPU" if args.device == "cpu" else torch_device_name()
    title = (f"llama {n / 1e6:.1f} M params, {args.steps} steps x {args.batch} x {args.seq} tokens, stdlib code "
             f"(commit {commit}, {where})")
    summary = {"commit": commit, "title": title, "command": " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
               "wall_s": time.time() - started, "settings": vars(args), "results": results}
    with open(args.out + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    try:
        plot(results, args.out + ".png", title)
    except ImportError:  # no matplotlib here: chart the JSON elsewhere with --from_json
        print(f"matplotlib missing: no chart; run this script with --from_json {args.out}.json")
    base = results.get("fp32", {}).get("final_eval")
    for m, r in results.items():
        rel = f" ({(r['final_eval'] / base - 1) * 100:+.2f} % vs fp32)" if base else ""
        print(f"{m}: final eval loss {r['final_eval']:.4f}{rel}, {r['train_s']:.0f} s, largest step change "
              f"{r.get('max_change_per_lr_overall')} x lr (embedding {r.get('max_change_per_lr_embedding')})")


if __name__ == "__main__":
    main()

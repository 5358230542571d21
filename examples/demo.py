"""`make demo`: train a tiny Llama on the Python standard library's own source, through megatrain.

Everything is local. The corpus is the stdlib of the Python running this script: its top-level
`*.py` files in sorted order, docstrings and comments removed with `ast` so that the text is code,
files that are mostly string tables left out, every 20th file held out for evaluation. A
byte-level BPE tokenizer (2,048 tokens) is trained on the training files in a second or two and
the model is a small Llama built from a config (random init). Training runs through the stock
`Trainer` with one extra argument, `callbacks=[MegaTrainPlugin()]`: the fp32 masters and the
AdamW state stay in host RAM, layers stream to the GPU when there is one (bf16 compute), else
everything runs on the CPU.

The script prints the training and held-out loss as it goes, a code sample generated from the
same prompt before and after training, and a summary; it writes `loss.png` (train and eval
curves) and `summary.json` (every logged loss, the samples, the settings) to `--output_dir`.
On a slow or busy machine `--time_limit` ends training early (with a final evaluation), so
that the whole run stays within about three minutes; `--time_limit 0` trains all the steps.

    python examples/demo.py              # about 2-3 minutes on a 2-core CPU
    python examples/demo.py --smoke      # tiny corpus and model, seconds (what the tests run)
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
import time

STARTED = time.time()  # before the heavy imports: the wall time reported includes them

import logging  # noqa: E402

# transformers imports peft, which imports bitsandbytes where it is installed (the test extra); on a CPU
# with AVX-512 bitsandbytes then warns that the optional `kernels` package of its 4-bit CPU kernel is
# missing. The demo quantizes nothing: its warning is not the demo's.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

import torch  # noqa: E402
from common import n_params, quiet, stdlib_files, tiny_llama, train_tokenizer  # noqa: E402  (examples/common.py)
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from megatrain_hf import MegaTrainPlugin  # noqa: E402

PROMPT = "import os\n\ndef"
HELD_OUT_EVERY = 20  # file i of the sorted list is held out for evaluation when i % 20 == 19
EVAL_BLOCKS = 128  # held-out blocks scored at each evaluation
MAX_STRING_SHARE = 0.3  # files whose code is more than 30 % string literals are tables (locale, opcode), left out


def code_only(source: str) -> tuple[str, float]:
    """`source` without docstrings and comments, in `ast.unparse`'s uniform layout, and its share of string literals."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    node.body = body[1:] or [ast.Pass()]
    code = ast.unparse(tree)
    strings = sum(
        len(repr(n.value)) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, (str, bytes))
    )
    return code, strings / max(1, len(code))


def stdlib_code(max_chars: int) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts): stdlib files in sorted order until `max_chars` of code."""
    train, held_out, size = [], [], 0
    for i, path in enumerate(stdlib_files()):
        with open(path, encoding="utf-8", errors="replace") as f:
            try:
                text, string_share = code_only(f.read())
            except (SyntaxError, ValueError, RecursionError):
                continue
        if string_share > MAX_STRING_SHARE or not text.strip():
            continue
        (held_out if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(text)
        size += len(text)
        if size >= max_chars:
            break
    if not held_out:  # a corpus cut before the 20th file: hold out its last file
        held_out.append(train.pop())
    return train, held_out


class Blocks(torch.utils.data.Dataset):
    """Consecutive blocks of `seq_len` token ids (labels = inputs; the model shifts them)."""

    def __init__(self, texts: list[str], tokenizer, seq_len: int, max_blocks: int | None = None) -> None:
        ids = [i for row in tokenizer(texts)["input_ids"] for i in row + [tokenizer.eos_token_id]]
        n = len(ids) // seq_len if max_blocks is None else min(max_blocks, len(ids) // seq_len)
        self.data = torch.tensor(ids[: n * seq_len]).view(n, seq_len)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class Progress(TrainerCallback):
    """One short line per log (instead of Trainer's dict of every metric), and the time limit.

    It reads no weight or gradient at the step's end (only the clock), so it says so to megatrain: the
    background update keeps overlapping the next forward.
    """

    megatrain_observes_weights = False

    def __init__(self, max_steps: int, stop_at: float | None) -> None:
        self.max_steps = max_steps
        self.stop_at = stop_at  # time.time() after which training stops (after an evaluation)
        self.stopped_at_step: int | None = None
        self.train_started = time.time()

    def on_train_begin(self, args, state, control, **kwargs):
        self.train_started = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop_at is not None and time.time() >= self.stop_at and state.global_step < self.max_steps:
            self.stopped_at_step = state.global_step
            control.should_training_stop = True
            control.should_evaluate = True
            control.should_log = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        where = f"step {state.global_step:>4}/{self.max_steps}"
        if "loss" in logs:
            speed = logs.get("megatrain/tokens_per_s")
            speed = f" | {speed:7,.0f} tokens/s" if speed is not None else ""
            elapsed = time.time() - self.train_started
            print(f"{where} | train loss {logs['loss']:6.3f}{speed} | {elapsed:5.0f} s", flush=True)
        if "eval_loss" in logs:
            loss = logs["eval_loss"]
            print(f"{where} | eval  loss {loss:6.3f} | perplexity {math.exp(loss):8.1f}", flush=True)


def generate(model, tokenizer, max_new_tokens: int) -> str:
    """A sampled continuation of PROMPT (temperature 0.7, top-k 50, seed 0: the same draw each run)."""
    inputs = tokenizer(PROMPT, return_tensors="pt").to(model.device)
    torch.manual_seed(0)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=0.7,
            top_k=50,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0], skip_special_tokens=True)


def show(text: str) -> str:
    return "\n".join("    | " + line for line in text.splitlines())


def plot(path: str, train: list[tuple[int, float]], evals: list[tuple[int, float]], title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("(no chart: matplotlib is not installed; pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss (mean over each log interval)", color="tab:blue")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss (held-out stdlib files)", color="tab:orange")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="demo_output")
    parser.add_argument("--max_steps", type=int, default=None, help="optimizer steps (default 750; 40 with --smoke)")
    parser.add_argument("--seq_len", type=int, default=None, help="tokens per block (default 128; 64 with --smoke)")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=6e-3)
    parser.add_argument("--logging_steps", type=int, default=None, help="default: max_steps / 30")
    parser.add_argument("--eval_steps", type=int, default=None, help="default: max_steps / 10")
    parser.add_argument(
        "--time_limit", type=float, default=170.0,
        help="seconds for the whole script (imports included): training ends early, with a final evaluation, "
        "10 s before it (0: no limit)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny corpus and model, seconds (CI)")
    args = parser.parse_args()
    max_steps = args.max_steps or (40 if args.smoke else 750)
    seq_len = args.seq_len or (64 if args.smoke else 128)
    logging_steps = args.logging_steps or max(1, max_steps // 30)
    eval_steps = args.eval_steps or max(1, max_steps // 10)
    quiet()
    sys.stdout.reconfigure(line_buffering=True)  # keep prints and megatrain's log lines in order in a log file
    os.makedirs(args.output_dir, exist_ok=True)

    train_texts, eval_texts = stdlib_code(150_000 if args.smoke else 3_000_000)
    tokenizer = train_tokenizer(train_texts, vocab_size=512 if args.smoke else 2048)
    train_set = Blocks(train_texts, tokenizer, seq_len)
    eval_set = Blocks(eval_texts, tokenizer, seq_len, max_blocks=EVAL_BLOCKS)
    data_seconds = time.time() - STARTED
    chars = sum(map(len, train_texts))
    print(
        f"corpus: {len(train_texts)} stdlib files, {chars / 1e6:.2f} M characters of code (docstrings and comments "
        f"removed), {len(train_set.data.view(-1)) / 1e6:.2f} M tokens, {len(train_set)} blocks of {seq_len}; "
        f"held out: {len(eval_texts)} files, {len(eval_set)} blocks"
    )
    print(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens, trained on the training files "
          f"({data_seconds:.0f} s since start, imports included)")

    hidden, layers = (64, 2) if args.smoke else (128, 2)
    model = tiny_llama(tokenizer, hidden=hidden, layers=layers, max_positions=seq_len)
    cuda = torch.cuda.is_available()
    print(
        f"model: Llama, hidden {hidden}, {layers} layers, {n_params(model):.2f} M parameters; "
        f"device: {'cuda (bf16 compute)' if cuda else 'cpu (fp32)'}"
    )

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=32,
        learning_rate=args.learning_rate,
        warmup_steps=max(1, max_steps // 20),
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        adam_beta2=0.99,
        logging_steps=logging_steps,
        eval_strategy="steps",
        eval_steps=eval_steps,
        save_strategy="no",
        report_to=[],
        bf16=cuda,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    stop_at = STARTED + args.time_limit - 10 if args.time_limit > 0 else None
    progress = Progress(max_steps, stop_at)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        callbacks=[MegaTrainPlugin(), progress],
    )
    trainer.remove_callback(PrinterCallback)  # Progress prints a short line per log instead

    new_tokens = 32 if args.smoke else 72
    before = generate(model, tokenizer, new_tokens)
    print(f"training: {max_steps} steps of {args.batch_size} x {seq_len} tokens, lr {args.learning_rate:g} (cosine), "
          f"evaluation every {eval_steps} steps")
    first_eval = trainer.evaluate()["eval_loss"]  # the untrained model (Progress prints it as step 0)
    train_started = time.time()
    result = trainer.train()
    train_seconds = time.time() - train_started
    after = generate(model, tokenizer, new_tokens)

    history = trainer.state.log_history
    train_curve = [(h["step"], h["loss"]) for h in history if "loss" in h]
    eval_curve = [(0, first_eval)] + [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    eval_curve = [p for i, p in enumerate(eval_curve) if i == 0 or p[0] != eval_curve[i - 1][0]]  # one per step
    speeds = [h["megatrain/tokens_per_s"] for h in history if "megatrain/tokens_per_s" in h]
    steps = result.global_step

    chart = os.path.join(args.output_dir, "loss.png")
    title = f"tiny Llama ({n_params(model):.2f} M) on Python stdlib code, Trainer + MegaTrainPlugin"
    if not plot(chart, train_curve, eval_curve, title):
        chart = None
    summary = {
        "steps": steps,
        "max_steps": max_steps,
        "stopped_by_time_limit": progress.stopped_at_step is not None,
        "time_limit_s": args.time_limit,
        "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.time() - STARTED, 1),
        "tokens_per_step": args.batch_size * seq_len,
        "train_loss": train_curve,
        "eval_loss": eval_curve,
        "eval_perplexity_first": math.exp(eval_curve[0][1]),
        "eval_perplexity_last": math.exp(eval_curve[-1][1]),
        "megatrain_tokens_per_s_last": speeds[-1] if speeds else None,
        "prompt": PROMPT,
        "sample_before": before,
        "sample_after": after,
        "chart": chart,
        "model": {"hidden": hidden, "layers": layers, "params_M": round(n_params(model), 3), "vocab": len(tokenizer)},
        "corpus": {"train_files": len(train_texts), "eval_files": len(eval_texts), "train_chars": chars},
        "device": "cuda" if cuda else "cpu",
        "torch": torch.__version__,
    }
    summary_path = os.path.join(args.output_dir, "summary.json")
    with open(summary_path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)

    print("\n==== summary ====")
    how = f"{steps} of {max_steps}"
    if progress.stopped_at_step is not None:
        how += f" (stopped by --time_limit {args.time_limit:g}; --time_limit 0 trains them all)"
    print(f"steps:       {how}, {args.batch_size * seq_len} tokens each")
    print(f"time:        training + evaluations {train_seconds:.0f} s, whole script {time.time() - STARTED:.0f} s")
    if train_curve:
        print(f"train loss:  {train_curve[0][1]:.3f} (first log, step {train_curve[0][0]}) -> {train_curve[-1][1]:.3f} "
              f"(last log, step {train_curve[-1][0]}); each the mean since the log before")
    print(f"eval loss:   {eval_curve[0][1]:.3f} -> {eval_curve[-1][1]:.3f}   "
          f"perplexity {math.exp(eval_curve[0][1]):.1f} -> {math.exp(eval_curve[-1][1]):.1f} "
          f"({len(eval_set)} held-out blocks)")
    if speeds:
        print(f"megatrain:   {speeds[-1]:,.0f} tokens/s in the last log interval")
    print(f"sample before training (prompt {PROMPT!r}, {new_tokens} new tokens, temperature 0.7):")
    print(show(before))
    print("sample after training (same prompt and seed):")
    print(show(after))
    print(f"chart:       {chart}" if chart else "chart:       not written (no matplotlib)")
    print(f"summary:     {summary_path}")
    print(f"demo: done in {time.time() - STARTED:.0f} s")


if __name__ == "__main__":
    main()

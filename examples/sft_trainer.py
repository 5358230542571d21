"""Supervised fine-tuning (SFT) with the stock `Trainer` + `MegaTrainPlugin`, evaluated as it trains.

The task: given a Python function's signature and docstring (the prompt), write its body (the
completion). Pairs are cut with `ast` from the Python standard library's own source, read with
`datasets`; the loss covers the completion tokens only (prompt labels are -100). Every
`--eval_steps` steps Trainer evaluates on held-out pairs and `compute_metrics` reports token
accuracy through an `evaluate` metric loaded from a local module file
(examples/metrics/token_accuracy.py). The megatrain part is one argument:
`Trainer(..., callbacks=[MegaTrainPlugin()])`. GPU (bf16 compute) when there is one, else CPU.

    python examples/sft_trainer.py                 # about two minutes on a 2-core CPU
    python examples/sft_trainer.py --smoke         # seconds (CI)

With a real model, replace `train_tokenizer` / `tiny_llama` with
`AutoTokenizer.from_pretrained(path)` / `AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)`.
"""

from __future__ import annotations

import os
import time

import evaluate
import numpy as np
import torch
from common import docstring_pairs, example_parser, load_stdlib_text, n_params, quiet, tiny_llama, train_tokenizer, use_cuda
from transformers import Trainer, TrainingArguments

from megatrain_hf import MegaTrainPlugin

METRIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics", "token_accuracy.py")


def tokenize_pairs(pairs, tokenizer, max_len: int):
    """input_ids = prompt + completion + eos; labels = -100 on the prompt, the ids on the completion."""

    def encode(example):
        prompt = tokenizer(example["prompt"])["input_ids"]
        completion = tokenizer(example["completion"])["input_ids"] + [tokenizer.eos_token_id]
        ids = (prompt + completion)[:max_len]
        labels = ([-100] * len(prompt) + completion)[:max_len]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

    encoded = pairs.map(encode, remove_columns=pairs.column_names)
    # a pair whose prompt alone fills max_len has nothing to learn from
    return encoded.filter(lambda e: any(label != -100 for label in e["labels"]))


class PadCollator:
    """Pads a batch to its longest sequence: pad id for inputs, 0 for the mask, -100 for labels."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, features):
        longest = max(len(f["input_ids"]) for f in features)
        out = {"input_ids": [], "attention_mask": [], "labels": []}
        for f in features:
            pad = longest - len(f["input_ids"])
            out["input_ids"].append(f["input_ids"] + [self.pad_id] * pad)
            out["attention_mask"].append(f["attention_mask"] + [0] * pad)
            out["labels"].append(f["labels"] + [-100] * pad)
        return {k: torch.tensor(v) for k, v in out.items()}


def main() -> None:
    parser = example_parser(__doc__, "out/sft_trainer", max_steps=100, learning_rate=2e-3)
    parser.add_argument("--eval_steps", type=int, default=25)
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--max_len", type=int, default=192, help="tokens per prompt + completion (truncated)")
    args = parser.parse_args()
    if args.smoke:
        args.max_steps, args.eval_steps, args.logging_steps = 6, 3, 2
        args.batch_size, args.max_len, args.hidden, args.layers = 4, 128, 64, 2
    quiet()
    started = time.time()
    cuda = use_cuda()

    # data: stdlib source -> (signature + docstring, body) pairs -> token ids with prompt labels masked
    corpus = load_stdlib_text(max_files=12 if args.smoke else None)
    texts = corpus["text"]
    tokenizer = train_tokenizer(texts, vocab_size=512 if args.smoke else 4096)
    pairs = docstring_pairs(texts, max_pairs=96 if args.smoke else 20_000)
    split = pairs.train_test_split(test_size=0.1 if not args.smoke else 16, seed=0)
    train_ds = tokenize_pairs(split["train"], tokenizer, args.max_len)
    eval_ds = tokenize_pairs(split["test"], tokenizer, args.max_len)
    print(f"data: {len(texts)} stdlib files, {len(train_ds)} train / {len(eval_ds)} eval pairs")

    model = tiny_llama(tokenizer, hidden=args.hidden, layers=args.layers, max_positions=args.max_len)
    print(f"model: {n_params(model):.2f} M params, device: {'cuda (bf16)' if cuda else 'cpu (fp32)'}")

    # evaluation: an `evaluate` metric from a local module file; the logits become argmax ids
    # batch by batch (preprocess_logits_for_metrics), so eval never holds all logits at once
    metric = evaluate.load(METRIC)

    def argmax_ids(logits, labels):
        return logits.argmax(dim=-1)

    def compute_metrics(eval_pred):
        preds, labels = eval_pred.predictions, eval_pred.label_ids
        # the prediction at position t is for the token at t + 1 (the model shifts its labels the same way)
        preds, labels = np.asarray(preds)[:, :-1], np.asarray(labels)[:, 1:]
        keep = labels != -100
        return metric.compute(predictions=preds[keep], references=labels[keep])

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.learning_rate,
        warmup_steps=max(1, args.max_steps // 10),
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        max_grad_norm=1.0,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to=[],
        bf16=cuda,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=PadCollator(tokenizer.pad_token_id),
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=argmax_ids,
        callbacks=[MegaTrainPlugin()],  # <- the megatrain part
    )
    result = trainer.train()
    history = list(trainer.state.log_history)
    final = trainer.evaluate()

    losses = [h["loss"] for h in history if "loss" in h]
    evals = [(h["step"], h["eval_loss"], h["eval_token_accuracy"]) for h in history if "eval_token_accuracy" in h]
    megatrain_logs = [{k: v for k, v in h.items() if k.startswith("megatrain/")} for h in history]
    megatrain_logs = [m for m in megatrain_logs if m]
    for step, loss, acc in evals:
        print(f"eval @ step {step}: loss {loss:.3f}, token accuracy {acc:.3f}")
    if megatrain_logs:
        last = megatrain_logs[-1]
        print("megatrain (last log): " + ", ".join(f"{k.split('/')[1]}={v:.4g}" for k, v in sorted(last.items())))

    # generate a completion for one held-out prompt
    model.eval()
    prompt = split["test"][0]["prompt"]
    inputs = tokenizer(prompt, return_tensors="pt").to(training_args.device)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    print("prompt:", repr(prompt[-80:]))
    print("completion:", repr(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])))
    print(
        f"sft_trainer: done: {result.global_step} steps, train loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"eval loss {final['eval_loss']:.3f}, eval token accuracy {final['eval_token_accuracy']:.3f}, "
        f"{time.time() - started:.0f} s"
    )


if __name__ == "__main__":
    main()

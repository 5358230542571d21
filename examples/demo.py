"""`make demo`: fine-tune a small Llama on the Python standard library's own source text.

Everything is local: the corpus is the stdlib of the Python running this script, the tokenizer
is a byte-level BPE trained on it in a few seconds, the model is built from a config. Training
runs through the stock `Trainer` with one extra argument, `callbacks=[MegaTrainPlugin()]`: the
fp32 masters and AdamW state stay in host RAM, layers stream to the GPU when there is one
(bf16 compute), else everything runs on the CPU. Loss and megatrain's tokens/s are logged by
Trainer every `--logging_steps` steps.

    python examples/demo.py                      # ~2-3 min on a 2-core CPU
    python examples/demo.py --max_steps 5 --smoke  # seconds
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import sysconfig
import time

import torch
from common import train_tokenizer  # examples/common.py: byte-level BPE trained locally
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from megatrain_hf import MegaTrainPlugin


def stdlib_text(max_bytes: int) -> str:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    chunks, size = [], 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        chunks.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return "\n".join(chunks)


class Blocks(torch.utils.data.Dataset):
    """Consecutive blocks of `seq_len` token ids (labels = inputs; Trainer's model shifts them)."""

    def __init__(self, ids: list[int], seq_len: int) -> None:
        n = len(ids) // seq_len
        self.data = torch.tensor(ids[: n * seq_len]).view(n, seq_len)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="demo_output")
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny corpus and model (CI)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    started = time.time()
    text = stdlib_text(200_000 if args.smoke else 3_000_000)
    tokenizer = train_tokenizer([text], vocab_size=512 if args.smoke else 4096)
    ids = tokenizer(text)["input_ids"]
    dataset = Blocks(ids, args.seq_len)
    print(f"corpus: {len(text) / 1e6:.1f} MB of stdlib source, {len(ids) / 1e6:.2f} M tokens, {len(dataset)} blocks")

    hidden = 64 if args.smoke else 256
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=2 if args.smoke else 4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.seq_len,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # fp32 masters, on the CPU: megatrain's host store takes them
    cuda = torch.cuda.is_available()
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, device: {'cuda' if cuda else 'cpu'}")

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=3e-3,
        warmup_steps=max(1, args.max_steps // 10),
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to=[],
        bf16=cuda,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[MegaTrainPlugin()])
    result = trainer.train()

    model.eval()
    prompt = tokenizer("def ", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        sample = model.generate(prompt.to(training_args.device), max_new_tokens=24, do_sample=False)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    speeds = [h["megatrain/tokens_per_s"] for h in trainer.state.log_history if "megatrain/tokens_per_s" in h]
    if losses:
        print(f"loss: {losses[0]:.3f} -> {losses[-1]:.3f} over {result.global_step} steps")
    else:
        print(f"train loss {result.training_loss:.3f} over {result.global_step} steps (no log interval completed)")
    if speeds:
        print(f"megatrain tokens/s (last log interval): {speeds[-1]:.0f}")
    print("sample:", repr(tokenizer.decode(sample[0])))
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()

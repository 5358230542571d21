"""A user's unchanged training script (no megatrain import): plain Trainer on a tiny Llama.

Writes {"losses": [...], "engine": bool, "bf16": bool} to --out so that tests can compare a plain run
with the same script run under `megatrain launch` / `python -m megatrain_hf.run`.
"""

import argparse
import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--save_steps", type=int, default=0, help="save a checkpoint every N steps (0: none)")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, attention_dropout=0.1,
    )
    model = LlamaForCausalLM(config)
    losses = []
    model.register_forward_hook(lambda m, a, o: losses.append(o.loss.item()) if m.training else None)
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=2e-3, max_grad_norm=0.5, report_to=[],
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, use_cpu=True,
        seed=0, disable_tqdm=True, logging_steps=1,
    )
    Trainer(model=model, args=targs, train_dataset=Tokens()).train()
    engine = "megatrain_hf" in sys.modules and sys.modules["megatrain_hf"].engine_of(model) is not None
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "engine": engine}, f)


if __name__ == "__main__":
    main()

"""A hand-written Accelerate training loop with `MegaTrainAccelerator`.

The loop is stock Accelerate (`prepare`, `accumulate`, `backward`, `clip_grad_norm_`); the one
change is the class: `MegaTrainAccelerator` instead of `Accelerator`. `prepare()` attaches
megatrain to the model before Accelerate would move it, so the fp32 masters stay in host RAM
and layers stream to the GPU (bf16 compute) when there is one, else everything runs on the CPU.

By default the optimizer is `torch.optim.AdamW` on `model.parameters()` (it works on the host
parameters as on any CPU model). `--host_adamw` uses megatrain's `HostAdamW` instead: the same
AdamW math with per-layer state, updated layer by layer in the background; it is built after
`prepare()`, from the attached model's host store:

    optimizer = HostAdamW(model.parameters(), store=engine_of(model).store, lr=...)

The data: the Python standard library's source, read with `datasets`, cut into blocks.

    python examples/accelerate_loop.py [--host_adamw]          # about two minutes on a 2-core CPU
    python examples/accelerate_loop.py --smoke [--host_adamw]  # seconds (CI)
"""

from __future__ import annotations

import math
import time

import torch
from common import example_parser, group_texts, load_stdlib_text, n_params, quiet, tiny_llama, train_tokenizer, use_cuda
from torch.utils.data import DataLoader
from transformers import get_cosine_schedule_with_warmup

from megatrain_hf import HostAdamW, MegaTrainAccelerator, engine_of


def main() -> None:
    parser = example_parser(__doc__, "out/accelerate_loop", max_steps=20, learning_rate=3e-3)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--log_every", type=int, default=5, help="print the loss every N optimizer steps")
    parser.add_argument("--host_adamw", action="store_true", help="megatrain's HostAdamW instead of torch.optim.AdamW")
    parser.add_argument("--no_save", action="store_true", help="do not save the final model")
    args = parser.parse_args()
    if args.smoke:
        args.max_steps, args.log_every, args.batch_size = 4, 1, 4
        args.seq_len, args.hidden, args.layers = 64, 64, 2
    quiet()
    started = time.time()
    cuda = use_cuda()

    corpus = load_stdlib_text(max_files=8 if args.smoke else 150)
    tokenizer = train_tokenizer(corpus["text"], vocab_size=512 if args.smoke else 4096)
    dataset = group_texts(corpus, tokenizer, args.seq_len).with_format("torch")
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = tiny_llama(tokenizer, hidden=args.hidden, layers=args.layers, max_positions=args.seq_len)
    print(f"data: {len(corpus)} stdlib files, {len(dataset)} blocks of {args.seq_len} tokens")
    print(f"model: {n_params(model):.2f} M params, device: {'cuda (bf16)' if cuda else 'cpu (fp32)'}")

    accelerator = MegaTrainAccelerator(
        mixed_precision="bf16" if cuda else "no", cpu=not cuda, gradient_accumulation_steps=args.grad_accum
    )
    if args.host_adamw:
        model = accelerator.prepare(model)  # attaches megatrain: the host store exists from here on
        optimizer = HostAdamW(
            model.parameters(), store=engine_of(model).store, lr=args.learning_rate, weight_decay=0.01
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    scheduler = get_cosine_schedule_with_warmup(optimizer, max(1, args.max_steps // 10), args.max_steps)
    if args.host_adamw:
        optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    engine = engine_of(model)
    print(f"optimizer: {type(optimizer.optimizer).__name__}, megatrain engine: {len(engine.units)} streamed units")

    model.train()
    steps, window, losses = 0, [], []
    engine.stats.reset()
    tick = time.time()
    epochs = math.ceil(args.max_steps * args.grad_accum / max(1, len(loader)))
    for _ in range(epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window.append(loss.item())
            if not accelerator.sync_gradients:
                continue
            steps += 1
            losses.append(sum(window) / len(window))
            window = []
            if steps % args.log_every == 0 or steps == args.max_steps:
                elapsed, tick = time.time() - tick, time.time()
                stats = engine.stats
                accelerator.print(
                    f"step {steps:4d}  loss {losses[-1]:.4f}  lr {scheduler.get_last_lr()[0]:.2e}  "
                    f"tokens/s {stats.tokens / elapsed:.0f}  h2d {stats.h2d_bytes / 1e9:.3f} GB"
                )
                stats.reset()
            if steps == args.max_steps:
                break
        if steps == args.max_steps:
            break

    # HostAdamW may still be applying the last update in the background: wait before reading weights
    engine.synchronize()
    if not args.no_save:
        # training is over: detach() restores plain modules (the trained weights stay where they are,
        # in host RAM), so save_pretrained writes an ordinary checkpoint that from_pretrained loads
        engine.detach()
        accelerator.unwrap_model(model).save_pretrained(args.output_dir)
        tokenizer.save_pretrained(args.output_dir)
        print(f"saved to {args.output_dir}")
    print(
        f"accelerate_loop: done: {steps} optimizer steps with {type(optimizer.optimizer).__name__}, "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, {time.time() - started:.0f} s"
    )


if __name__ == "__main__":
    main()

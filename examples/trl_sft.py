"""Supervised fine-tuning with TRL's `SFTTrainer` + `MegaTrainPlugin`.

`SFTTrainer` is a `Trainer` subclass, so megatrain joins it the same way:
`SFTTrainer(..., callbacks=[MegaTrainPlugin()])`. TRL tokenizes the prompt/completion pairs
itself and, with `completion_only_loss`, trains on the completions only. The pairs: a Python
function's signature + docstring (prompt) -> its body (completion), cut with `ast` from the
standard library's source read with `datasets`. GPU (bf16 compute) when there is one, else CPU.

Needs `trl` (`pip install trl`; on a CPU-only machine `pip install --no-deps trl` keeps the
installed torch: TRL's own requirements are transformers, accelerate, datasets and friends,
which megatrain's install already brings).

    python examples/trl_sft.py                     # about three minutes on a 2-core CPU
    python examples/trl_sft.py --smoke             # seconds (CI)
"""

from __future__ import annotations

import time

import torch
from common import docstring_pairs, example_parser, load_stdlib_text, n_params, quiet, tiny_llama, train_tokenizer, use_cuda

from megatrain_hf import MegaTrainPlugin, engine_of


def main() -> None:
    parser = example_parser(__doc__, "out/trl_sft", max_steps=100, learning_rate=2e-3)
    parser.add_argument("--eval_steps", type=int, default=50)
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--max_length", type=int, default=192)
    args = parser.parse_args()
    if args.smoke:
        args.max_steps, args.eval_steps, args.logging_steps = 4, 4, 2
        args.batch_size, args.max_length, args.hidden, args.layers = 4, 128, 64, 2
    quiet()
    try:
        from trl import SFTConfig, SFTTrainer
    except ImportError as err:
        raise SystemExit(f"this example needs TRL: pip install trl (or --no-deps trl on a CPU-only machine): {err}")
    started = time.time()
    cuda = use_cuda()

    corpus = load_stdlib_text(max_files=12 if args.smoke else None)
    texts = corpus["text"]
    tokenizer = train_tokenizer(texts, vocab_size=512 if args.smoke else 4096)
    pairs = docstring_pairs(texts, max_pairs=96 if args.smoke else 20_000)
    split = pairs.train_test_split(test_size=16 if args.smoke else 0.1, seed=0)
    model = tiny_llama(tokenizer, hidden=args.hidden, layers=args.layers, max_positions=args.max_length)
    print(f"data: {len(texts)} stdlib files, {len(split['train'])} train / {len(split['test'])} eval pairs")
    print(f"model: {n_params(model):.2f} M params, device: {'cuda (bf16)' if cuda else 'cpu (fp32)'}")

    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        warmup_steps=max(1, args.max_steps // 10),
        lr_scheduler_type="cosine",
        max_length=args.max_length,
        completion_only_loss=True,  # loss on the completion tokens only
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
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=split["train"],
        eval_dataset=split["test"],
        processing_class=tokenizer,
        callbacks=[MegaTrainPlugin()],  # <- the megatrain part
    )
    assert engine_of(trainer.model) is not None, "megatrain is not attached to the SFTTrainer's model"
    result = trainer.train()

    history = trainer.state.log_history
    logs = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval_loss" in h]
    last = logs[-1]
    extra = {k: v for k, v in last.items() if k.startswith("megatrain/") or k in ("mean_token_accuracy", "num_tokens")}
    print("last training log: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(extra.items())))

    model.eval()
    prompt = split["test"][0]["prompt"]
    inputs = tokenizer(prompt, return_tensors="pt").to(config.device)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    print("completion:", repr(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])))
    eval_text = f", eval loss {evals[-1]['eval_loss']:.3f}" if evals else ""
    print(
        f"trl_sft: done: {result.global_step} steps with trl.SFTTrainer, loss {logs[0]['loss']:.3f} -> "
        f"{last['loss']:.3f}{eval_text}, {time.time() - started:.0f} s"
    )


if __name__ == "__main__":
    main()

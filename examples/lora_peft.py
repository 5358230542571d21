"""LoRA fine-tuning with PEFT + `Trainer` + `MegaTrainPlugin`; the adapter is reloaded with plain PEFT.

1. A base model is saved as a normal checkpoint (here a small Llama built from a config, with a
   tokenizer trained on the Python standard library's source; with a real model this is the
   directory you download).
2. `get_peft_model` wraps it with LoRA adapters; `Trainer(..., callbacks=[MegaTrainPlugin()])`
   trains them on stdlib source read with `datasets` (`load_dataset("text", ...)`), cut into
   blocks. megatrain streams the frozen base weights to the GPU with the adapters.
3. `trainer.save_model()` writes the adapter only, exactly as without megatrain.
4. Without megatrain: `AutoModelForCausalLM.from_pretrained(base)` + `PeftModel.from_pretrained(adapter)`
   reloads it; its logits are compared with the trained model's and it generates.

The base model here is randomly initialised, so the adapter has little to build on and the loss
falls slowly; the point is the mechanics. With a real model, load it instead of building `base`
(`AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)`, `AutoTokenizer.from_pretrained(path)`)
and reload from `path` in step 4.

    python examples/lora_peft.py                   # about a minute on a 2-core CPU
    python examples/lora_peft.py --smoke           # seconds (CI)
"""

from __future__ import annotations

import os
import time

import torch
from common import example_parser, group_texts, load_stdlib_text, n_params, quiet, tiny_llama, train_tokenizer, use_cuda
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from megatrain_hf import MegaTrainPlugin


def main() -> None:
    parser = example_parser(__doc__, "out/lora_peft", max_steps=100, learning_rate=3e-3)
    parser.add_argument("--logging_steps", type=int, default=20)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--lora_r", type=int, default=16)
    args = parser.parse_args()
    if args.smoke:
        args.max_steps, args.logging_steps, args.batch_size = 4, 2, 4
        args.seq_len, args.hidden, args.layers, args.lora_r = 64, 64, 2, 4
    quiet()
    started = time.time()
    cuda = use_cuda()
    base_dir = os.path.join(args.output_dir, "base")
    adapter_dir = os.path.join(args.output_dir, "adapter")

    # 1. the base model, saved as an ordinary checkpoint (your downloaded model in real use)
    corpus = load_stdlib_text(max_files=8 if args.smoke else 150)
    tokenizer = train_tokenizer(corpus["text"], vocab_size=512 if args.smoke else 4096)
    base = tiny_llama(tokenizer, hidden=args.hidden, layers=args.layers, max_positions=args.seq_len)
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    dataset = group_texts(corpus, tokenizer, args.seq_len)
    print(f"data: {len(corpus)} stdlib files, {len(dataset)} blocks of {args.seq_len} tokens")

    # 2. LoRA adapters on the attention and MLP projections; the base stays frozen
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    print(
        f"model: {n_params(model):.2f} M params, {n_params(model, trainable_only=True):.3f} M trainable (LoRA r={args.lora_r}), "
        f"device: {'cuda (bf16)' if cuda else 'cpu (fp32)'}"
    )
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        warmup_steps=max(1, args.max_steps // 10),
        lr_scheduler_type="cosine",
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to=[],
        bf16=cuda,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[MegaTrainPlugin()])
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    # 3. the adapter only (adapter_config.json + adapter_model.safetensors), as without megatrain
    trainer.save_model(adapter_dir)
    adapter_files = sorted(os.listdir(adapter_dir))
    adapter_bytes = sum(os.path.getsize(os.path.join(adapter_dir, f)) for f in adapter_files)
    print(f"adapter saved to {adapter_dir}: {', '.join(adapter_files)} ({adapter_bytes / 1e6:.2f} MB)")

    probe = torch.tensor([dataset[0]["input_ids"]])
    model.eval()
    with torch.no_grad():
        trained_logits = model(input_ids=probe.to(training_args.device)).logits.float().cpu()

    # 4. plain PEFT, no megatrain: base checkpoint + adapter, on the CPU in fp32
    reloaded = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(reloaded, adapter_dir)
    reloaded.eval()
    lora_b = [p for n, p in reloaded.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b), (
        "the reloaded adapter has all-zero lora_B: nothing was trained"
    )
    with torch.no_grad():
        reloaded_logits = reloaded(input_ids=probe).logits
    max_diff = (trained_logits - reloaded_logits).abs().max().item()
    agree = (trained_logits.argmax(-1) == reloaded_logits.argmax(-1)).float().mean().item()
    print(f"reloaded vs trained logits: max |diff| {max_diff:.2e}, argmax agreement {agree:.3f}")
    if cuda:  # the trained model computed in bf16 on the GPU
        assert agree > 0.9, f"reloaded adapter disagrees with the trained model (argmax agreement {agree:.3f})"
    else:  # both fp32 on the CPU: the same numbers
        assert max_diff < 1e-4, f"reloaded adapter differs from the trained model (max |diff| {max_diff})"

    tok = AutoTokenizer.from_pretrained(base_dir)
    prompt = tok("def ", return_tensors="pt")
    with torch.no_grad():
        sample = reloaded.generate(**prompt, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    assert sample.shape[1] > prompt["input_ids"].shape[1], "generation produced no tokens"
    print("sample (reloaded with plain peft):", repr(tok.decode(sample[0])))
    print(
        f"lora_peft: done: {result.global_step} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, adapter reloaded "
        f"with plain peft (max |logit diff| {max_diff:.1e}), {time.time() - started:.0f} s"
    )


if __name__ == "__main__":
    main()

"""Peak resident memory of loading a save_pretrained checkpoint and attaching megatrain, in one process.

    python tests/tools/load_rss.py --make DIR [--hidden 768 --layers 12 --dtype bf16]   # write a checkpoint
    python tests/tools/load_rss.py --load DIR --path megatrain|transformers [--lora] [--bf16] [--save OUT]

``--path megatrain``: ``megatrain_hf.from_pretrained(DIR)``, then ``attach``; ``--path transformers``:
``AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32)``, then ``attach`` (the usual path).
``--lora`` applies a LoRA adapter (PEFT) between loading and attaching; ``--base-quantization nf4|int8``
puts it on every linear and quantizes their base weights as they are read (``base_quantization``). The same steps run first on a
tiny model of the same class (imports, first-use initializations), then it prints one JSON line: the
resident memory after that (``baseline``), the peak from there to the end of ``attach`` (``peak``,
Linux's VmHWM, reset through /proc/self/clear_refs after the warm-up), the host bytes the
store allocated (``store``) and what the memory plan says it allocates (``plan``, from
``megatrain_hf.memory.host_breakdown_for_units``), the checkpoint's bytes on disk (``checkpoint``).
``--save OUT`` then builds HostAdamW (its moments) and measures ``save_pretrained(OUT)`` plus the
optimizer's sharded save into OUT/megatrain_optimizer the same way (``save_baseline``, ``save_peak``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def make(folder: str, hidden: int, layers: int, dtype: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                         vocab_size=32000, max_position_embeddings=256, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(folder, max_shard_size="100MB")  # buffers are not saved (the model computes them)


def _load_and_attach(folder: str, path: str, lora: bool, bf16: bool, quant: str = "none"):
    import torch
    from transformers import AutoModelForCausalLM

    import megatrain_hf

    if path == "megatrain":
        model = megatrain_hf.from_pretrained(folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if lora:
        import peft

        targets = ["q_proj", "v_proj"] if quant == "none" else ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))
    config = megatrain_hf.MegaTrainConfig(check_host_memory=False, base_quantization=quant)
    return model, megatrain_hf.attach(model, config, device="cpu", bf16=bf16)


def _warm_up(folder: str, path: str, lora: bool, bf16: bool, quant: str) -> None:
    """The same steps on a tiny model of the same class: imports and first-use work out of the measurement."""
    import gc
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    config.update({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "vocab_size": 128})
    with tempfile.TemporaryDirectory() as tiny:
        AutoModelForCausalLM.from_config(config).save_pretrained(tiny)
        model, engine = _load_and_attach(tiny, path, lora, bf16, quant)
        engine.detach()
        del model, engine
    gc.collect()


def save(model, engine, out: str) -> dict:
    import gc

    from megatrain_hf import HostAdamW
    from megatrain_hf.optim.state_files import save_optimizer

    optimizer = HostAdamW([p for p in model.parameters() if p.requires_grad], store=engine.store, lr=1e-4)
    gc.collect()
    baseline = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    model.save_pretrained(out)
    save_optimizer(optimizer, os.path.join(out, "megatrain_optimizer"))
    return {"save_baseline": baseline * 1024, "save_peak": status_kib("VmHWM") * 1024}


def load(folder: str, path: str, lora: bool, bf16: bool, out: str | None = None, quant: str = "none") -> dict:
    from megatrain_hf.models.base_quantization import quantized_weights
    from megatrain_hf.memory import host_breakdown_for_units

    _warm_up(folder, path, lora, bf16, quant)
    baseline = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    model, engine = _load_and_attach(folder, path, lora, bf16, quant)
    peak = status_kib("VmHWM")
    schemes = quantized_weights(model, quant)
    located = engine.family.locate(model)
    plan = host_breakdown_for_units(list(zip(located.names, located.modules)), compute_dtype=engine.compute_dtype,
                                    staging=engine.store.staging.enabled, embedding_units=located.embedding_units,
                                    optimizer_state=False, quantize=lambda p: schemes.get(id(p)))
    on_disk = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".safetensors"))
    quantized = sum(e.numel for entries in engine.store.entries for e in entries if e.quant is not None)
    result = {"path": path, "lora": lora, "bf16": bf16, "base_quantization": quant, "quantized": quantized, "baseline": baseline * 1024, "peak": peak * 1024,
              "store": engine.store.host_bytes(), "plan": sum(plan.values()), "checkpoint": on_disk,
              "params": sum(p.numel() for p in model.parameters())}
    if out is not None:
        result.update(save(model, engine, out))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--load")
    parser.add_argument("--path", choices=["megatrain", "transformers"], default="megatrain")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--save")
    parser.add_argument("--base-quantization", choices=["none", "int8", "nf4"], default="none")
    args = parser.parse_args()
    if args.make:
        make(args.make, args.hidden, args.layers, args.dtype)
    if args.load:
        json.dump(load(args.load, args.path, args.lora, args.bf16, args.save, args.base_quantization), sys.stdout)
        print()


if __name__ == "__main__":
    main()

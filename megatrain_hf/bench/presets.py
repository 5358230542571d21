"""Model shapes the benchmark knows by name.

Every system in one benchmark run trains the same Llama-architecture shape (untied embeddings,
full multi-head attention unless ``kv_heads`` says otherwise), built from a config with random
weights: no hub access, and the numbers do not depend on what a checkpoint contains. The FLOP
convention the bench reports with is in :mod:`.flops`.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from ..errors import MegatrainConfigError
from ..memory import PRESETS as MEMORY_PRESETS
from ..memory import ModelShape


# One source of model shapes for the planner and the benchmark: memory.PRESETS. The benchmark
# trains every shape as an untied Llama (LlamaConfig), which is what those presets describe,
# except qwen2.5-14b (q/k/v biases) -- the benchmark rejects presets it cannot build faithfully.
BENCH_PRESETS = ("tiny", "llama-1.36b", "llama-3.14b", "llama-7b", "llama3-8b", "llama-13b", "llama-70b", "llama-3-70b",
                 "mistral-large-123b")
PRESETS: dict[str, ModelShape] = {name: MEMORY_PRESETS[name] for name in BENCH_PRESETS}


SHAPE_FIELDS = ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab")


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model PRESET`` plus one override flag per :class:`ModelShape` field."""
    parser.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model shape preset")
    for name in SHAPE_FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"override the preset's {name}")


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """``--lora-rank R`` (LoRA on every linear instead of full fine-tuning) and ``--base-quantization``."""
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="train LoRA adapters of this rank on every linear (PEFT) instead of every weight; "
                        "megatrain's model is then built without weights, its seeded random init drawn at attach "
                        "(megatrain_hf.from_config)")
    parser.add_argument("--base-quantization", choices=("none", "int8", "nf4"), default="none",
                        help="with --lora-rank: megatrain stores and streams the frozen base quantized "
                        "(MegaTrainConfig.base_quantization); the other systems are reported unavailable")


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    """The preset named by ``args.model`` with any ``--hidden/--layers/...`` overrides applied."""
    overrides = {name: getattr(args, name) for name in SHAPE_FIELDS if getattr(args, name, None) is not None}
    shape = replace(PRESETS[args.model], **overrides)
    if "heads" in overrides and "kv_heads" not in overrides and shape.kv_heads > shape.heads:
        shape = replace(shape, kv_heads=shape.heads)
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise MegatrainConfigError(
            f"hidden={shape.hidden}, heads={shape.heads}, kv_heads={shape.kv_heads}: hidden must be a multiple "
            "of heads and heads a multiple of kv_heads; fix --hidden/--heads/--kv-heads."
        )
    return shape

"""Model shapes the benchmark knows by name, and the FLOP convention it reports with.

Every system in one benchmark run trains the same Llama-architecture shape (untied embeddings,
full multi-head attention unless ``kv_heads`` says otherwise), built from a config with random
weights: no hub access, and the numbers do not depend on what a checkpoint contains.

TFLOPS convention (the same everywhere in the project, docs/architecture section 5)::

    useful FLOPs per optimizer step = 6 * P * T + 12 * L * H * S * T

with P the trainable parameters, T the tokens per optimizer step, L layers, H hidden size, S the
sequence length. Activation recompute is NOT counted as useful work, so a system that recomputes
more does not look faster for it.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A Llama-architecture model shape (fields map to ``transformers.LlamaConfig``)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    def to_dict(self) -> dict:
        return asdict(self)

    def approx_params(self) -> int:
        """Parameter count of the untied Llama shape (embeddings + layers + norm + head)."""
        head_dim = self.hidden // self.heads
        attn = self.hidden * self.hidden * 2 + 2 * self.hidden * self.kv_heads * head_dim
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attn + mlp + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


PRESETS: dict[str, ModelShape] = {
    # A CPU-test size; keeps GQA so the structure matches the big shapes' code paths.
    "tiny": ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=128),
    # 1.36B, 3.14B, 6.74B parameters: the shapes docs/architecture section 5 measured.
    "llama-1.36b": ModelShape(hidden=2048, intermediate=5632, layers=24, heads=16, kv_heads=16, vocab=32000),
    "llama-3.14b": ModelShape(hidden=3072, intermediate=8192, layers=26, heads=24, kv_heads=24, vocab=32000),
    "llama-7b": ModelShape(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, vocab=32000),
}

_OVERRIDES = ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab")


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model PRESET`` plus one override flag per :class:`ModelShape` field."""
    parser.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model shape preset")
    for name in _OVERRIDES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"override the preset's {name}")


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    """The preset named by ``args.model`` with any ``--hidden/--layers/...`` overrides applied."""
    overrides = {name: getattr(args, name) for name in _OVERRIDES if getattr(args, name, None) is not None}
    shape = replace(PRESETS[args.model], **overrides)
    if "heads" in overrides and "kv_heads" not in overrides and shape.kv_heads > shape.heads:
        shape = replace(shape, kv_heads=shape.heads)
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(
            f"hidden={shape.hidden}, heads={shape.heads}, kv_heads={shape.kv_heads}: hidden must be a multiple "
            "of heads and heads a multiple of kv_heads; fix --hidden/--heads/--kv-heads."
        )
    return shape


def useful_flops_per_step(params: int, shape: ModelShape, seq_len: int, tokens_per_step: int) -> float:
    """``6 * P * T + 12 * L * H * S * T`` (recompute not counted)."""
    return 6.0 * params * tokens_per_step + 12.0 * shape.layers * shape.hidden * seq_len * tokens_per_step


FLOPS_FORMULA = (
    "TFLOPS = (6 * P * T + 12 * L * H * S * T) / step_time / 1e12; P trainable params, T tokens per optimizer "
    "step, L layers, H hidden, S sequence length; recompute not counted"
)

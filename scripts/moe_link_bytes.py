"""Link bytes of mixture-of-experts training, and what fetching only the routed experts in backward
would save (an estimate).

1. Measured: one optimizer step (2 micro-batches of 2 x 16 tokens) of the tests' tiny Mixtral on
   the CPU with the CUDA transfer pipeline emulated (``EmulatedStreams``: every upload and
   gradient transfer is a real copy, counted by ``engine.stats``), bf16 compute with the experts in
   fp32 (``experts_dtype="auto"``, the default under transformers' grouped_mm) and in bf16
   (``"compute"``), per micro-batch and layer-major; next to it the same bytes from the store's layout.
2. Computed from the shapes (``ModelShape.from_hf_config``) of Mixtral-8x7B and Qwen3-30B-A3B: the
   bytes of one layer on the link and the experts' share, per optimizer step under layer-major, with
   the experts in bf16 and in fp32.
3. Estimate: the share of expert bytes a backward that fetched only the routed experts would not
   fetch, with uniform routing ((1 - k/E)^T idle experts for T tokens routed in the step), beside
   the idle share measured on the tiny random-init model. Not a measurement of a real model's
   routing: no trained weights are used here.

Run: ``PYTHONPATH=. python scripts/moe_link_bytes.py`` (CPU only, about a minute).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from helpers import RandomTokens, tiny_model  # noqa: E402

from megatrain_hf import MegaTrainConfig, attach  # noqa: E402
from megatrain_hf.core.layout import Kind  # noqa: E402
from megatrain_hf.core.streams import EmulatedStreams  # noqa: E402
from megatrain_hf.memory import ModelShape  # noqa: E402

MIXTRAL_8X7B = dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                    num_experts_per_tok=2, tie_word_embeddings=False)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False)


def measured(layer_major: bool, experts_dtype: str, k: int = 2) -> None:
    model = tiny_model("mixtral", attention_dropout=0.0)
    engine = attach(model, MegaTrainConfig(experts_dtype=experts_dtype), device="cpu", bf16=True,
                    streams=EmulatedStreams())
    data = RandomTokens(n=2 * k)
    batches = [{key: torch.stack([data[2 * i + j][key] for j in range(2)]) for key in data[0]} for i in range(k)]
    engine.stats.reset()
    if layer_major:
        engine.accumulate([lambda b=b: model(**b).loss / k for b in batches])
    else:
        for b in batches:
            (model(**b).loss / k).backward()
    engine.synchronize()
    st = engine.stats
    wire = [sum(e.numel * e.wire.itemsize for e in entries if e.owner == u and e.kind is not Kind.BUFFER)
            for u, entries in enumerate(engine.store.entries)]
    grads = 4 * engine.store.trainable_numel()
    experts = sum(e.numel * e.wire.itemsize for e in engine.store.entries[1] if "experts." in e.name)
    mode = f"layer-major (K={k})" if layer_major else f"per micro-batch (K={k})"
    print(f"tiny Mixtral, experts_dtype={experts_dtype!r}, {mode}: measured h2d {st.h2d_bytes} B, d2h {st.d2h_bytes} B, uploads {st.uploads}")
    up = (2 if layer_major else 2 * k) * sum(wire) - (1 if layer_major else k) * wire[-1]  # head stays resident
    print(f"  from the layout: weights up {up} B + accumulators up {(k - 1) * grads if not layer_major else 0} B,"
          f" gradients down {(1 if layer_major else k) * grads} B; a layer {wire[1]} B, experts {experts} B"
          f" ({experts / wire[1]:.1%})")
    engine.detach()


def computed(name: str, config: dict, tokens_per_step: list[int]) -> None:
    shape = ModelShape.from_hf_config(config)
    moe_layer = next(i for i in range(shape.layers) if shape.is_moe_layer(i))
    matrices = sum(fi * fo for fi, fo, _ in shape.linears(moe_layer).values())
    experts = sum(n for key, n in shape.expert_tensors(moe_layer).items() if key.startswith("experts."))
    router = shape.expert_tensors(moe_layer)["gate.weight"]
    vectors = sum(shape.norm_vectors())
    layer_bytes = 2 * (matrices + experts + router) + 4 * vectors
    up = 2 * shape.layers * layer_bytes  # forward + backward upload of every layer, once per step (layer-major)
    down = 4 * (shape.layers * (matrices + experts + router + vectors))  # fp32 gradients, once per step
    print(f"{name}: {shape.params() / 1e9:.2f} B params; a layer {layer_bytes / 1e9:.3f} GB on the link (bf16), "
          f"experts {2 * experts / layer_bytes:.1%} of it; per step (layer-major), layers only: "
          f"{up / 1e9:.0f} GB up + {down / 1e9:.0f} GB gradients down")
    fp32_layer = layer_bytes + 2 * experts  # the experts in fp32 (experts_dtype="auto" under grouped_mm)
    fp32_up = 2 * shape.layers * fp32_layer
    print(f"  experts in fp32: a layer {fp32_layer / 1e9:.3f} GB ({fp32_layer / layer_bytes:.2f}x); per step "
          f"{fp32_up / 1e9:.0f} GB up + {down / 1e9:.0f} GB down = {(fp32_up + down) / (up + down):.2f}x the bf16 "
          "experts' link bytes")
    e, k = shape.experts, shape.experts_per_token
    backward_experts = shape.layers * 2 * experts
    for t in tokens_per_step:
        idle = (1 - k / e) ** t
        print(f"  ESTIMATE, uniform routing, {t} tokens per step: idle experts {idle:.3g} -> a routed-only backward "
              f"fetch saves {idle * backward_experts / 1e9:.3g} GB of {(up + down) / 1e9:.0f} GB per step")


def tiny_routing(tokens: list[int]) -> None:
    """Idle share of experts per layer and step on the tiny random-init Mixtral (8 experts, top-2)."""
    model = tiny_model("mixtral", attention_dropout=0.0, num_local_experts=8).eval()
    counts = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, a, out: counts.append(out[2]))
    for t in tokens:
        counts.clear()
        idle = []
        for seed in range(20):
            ids = RandomTokens(n=1, seq=t, seed=seed).ids
            with torch.no_grad():
                model(input_ids=ids)
        for routed in counts:
            idle.append((torch.bincount(routed.reshape(-1), minlength=8) == 0).float().mean().item())
        print(f"  tiny random-init Mixtral, 8 experts top-2, {t} tokens: measured idle share {sum(idle) / len(idle):.3f}"
              f" (uniform routing: {(1 - 2 / 8) ** t:.3f})")


if __name__ == "__main__":
    torch.manual_seed(0)
    for experts_dtype in ("auto", "compute"):
        measured(False, experts_dtype)
        measured(True, experts_dtype)
    computed("Mixtral-8x7B", MIXTRAL_8X7B, [16, 64, 4096, 65536])
    computed("Qwen3-30B-A3B", QWEN3_30B_A3B, [16, 64, 4096, 65536])
    tiny_routing([4, 8, 16, 32])

"""Peak CPU tensor memory of a streamed decoder layer's backward (recompute with grad) vs sequence
length, against the plan's per-layer working set (issue 34: "CPU peak memory per token, measured
with torch's profiler at 4K-64K, is bounded by the plan's per-layer working set").

The model: a Llama of hidden 256, intermediate 688, 4 heads of 64 with 2 key/value heads (GQA),
vocab 256, SDPA attention, fp32, 2 decoder layers, attached with megatrain on the CPU
(``sequence_tile_tokens`` tiles of 1024 tokens: every per-token operation of a layer tiled through its
layer recipe; chunked loss). One training forward + ``loss.backward()`` of one sequence (batch 1),
after a warm step. Measured with torch's memory profiler (``torch.profiler.profile(profile_memory=True)``,
``megatrain_hf/bench/cpu_memory.py``): the running sum of the CPU allocator's allocation and free
events in time order (tensor storage only).

* ``step_peak``: that sum's maximum over the whole step (checkpoints, embedding, head included);
* ``layer_peak``: inside each decoder layer's ``StreamedUnitBackward`` (the layer's recompute with
  grad and its backward), the maximum of the sum minus its value when the backward starts, plus the
  gradient flowing in (fp32 ``tokens x hidden``, allocated by the unit after it but counted by the
  plan); the largest over the layers. That is what ``memory/activations.layer_working_set`` models
  (the plan's ``gpu_layer_working_set``); ``long_context_working_set`` (the joint plan's) also counts
  the layer's input as loaded from its checkpoint, so it is compared with ``layer_peak`` plus the
  fp32 ``tokens x hidden`` input.

    python scripts/longctx_memory.py                        # 4K .. 64K tokens, tiles of 1024
    python scripts/longctx_memory.py --seq-lens 2048 4096 --json out.json --md out.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch
import transformers

from megatrain_hf import MegaTrainConfig, attach
from megatrain_hf.bench.cpu_memory import streamed_layer_peak
from megatrain_hf.memory import activations

SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


def build_model(seq: int, **overrides) -> torch.nn.Module:
    config = transformers.LlamaConfig(**{**SHAPE, **overrides}, max_position_embeddings=max(seq, 2048))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def measure(seq: int, tile: int | None, **shape) -> dict:
    model = build_model(seq, **shape)
    cfg = model.config
    engine = attach(model, MegaTrainConfig(sequence_tile_tokens=tile, chunked_loss=True), device="cpu")
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
    warm = ids[:, : min(seq, 1024)]
    model(input_ids=warm, labels=warm).loss.backward()  # the allocator's and the engine's first-call state
    model.zero_grad()
    tiled_before = engine.stats.tiled_layer_calls
    started = time.perf_counter()
    step_peak, layer_peak, windows = streamed_layer_peak(lambda: model(input_ids=ids, labels=ids).loss.backward(),
                                                         cfg.num_hidden_layers, seq, cfg.hidden_size)
    seconds = time.perf_counter() - started
    tiled_calls = engine.stats.tiled_layer_calls - tiled_before
    engine.detach()
    h, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = h // heads
    q_dim, kv_dim, inter = heads * head_dim, kv_heads * head_dim, cfg.intermediate_size
    c = 4  # fp32 compute
    plan = activations.layer_working_set(seq, h, q_dim, kv_dim, inter, c, tile)
    joint = activations.long_context_working_set(seq, h, q_dim, kv_dim, inter, c, tile or seq)
    return {"tokens": seq, "tile": tile, "tiled_layer_calls": tiled_calls, "step_peak_bytes": step_peak,
            "unit_backward_peaks_above_entry": windows, "layer_peak_bytes": layer_peak,
            "layer_peak_per_token": round(layer_peak / seq, 1), "plan_layer_working_set": plan,
            "ratio_layer_to_plan": round(layer_peak / plan, 4),
            "plan_long_context_working_set": joint,
            "ratio_layer_plus_input_to_joint_plan": round((layer_peak + seq * h * 4) / joint, 4),
            "seconds": round(seconds, 2)}


def table(rows: list[dict]) -> str:
    lines = ["| tokens | step peak (MiB) | layer peak (MiB) | layer peak per token (B) | plan `layer_working_set` "
             "(MiB) | measured / plan | (+ input) / `long_context_working_set` | s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['step_peak_bytes'] / 2**20:.1f} | {r['layer_peak_bytes'] / 2**20:.1f} | "
                     f"{r['layer_peak_per_token']:.0f} | {r['plan_layer_working_set'] / 2**20:.1f} | "
                     f"{r['ratio_layer_to_plan']:.3f} | {r['ratio_layer_plus_input_to_joint_plan']:.3f} | "
                     f"{r['seconds']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--tile", type=int, default=1024, help="sequence_tile_tokens (0: untiled)")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"],
                        help="decoder layers (the layer peak is per layer; fewer: a shorter step)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--md", default=None, help="also write the markdown table to this file")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = []
    for seq in args.seq_lens:
        rows.append(measure(seq, args.tile or None, num_hidden_layers=args.layers))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:  # after every length: a run stopped by a timeout keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"commit": commit, "torch": torch.__version__, "shape": {**SHAPE, "num_hidden_layers": args.layers}, "dtype": "float32",
                           "tile": args.tile or None, "rows": rows}, f, indent=1)
    print(table(rows))
    if args.md:
        with open(args.md, "w") as f:
            f.write(table(rows) + "\n")
    if len(rows) > 1:
        lo, hi = rows[0], rows[-1]
        growth = (hi["layer_peak_bytes"] - lo["layer_peak_bytes"]) / (hi["tokens"] - lo["tokens"])
        print(f"layer peak growth per token {lo['tokens']}..{hi['tokens']}: {growth:.0f} B/token")


if __name__ == "__main__":
    main()

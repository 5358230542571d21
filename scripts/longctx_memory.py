"""Peak CPU tensor memory of one decoder layer's streamed forward + backward vs sequence length,
MLP tiled and untiled (``sequence_tile_tokens``), with the growth per token.

The model: a Llama of one decoder layer (hidden 64, intermediate 512, 2 heads of 32, vocab 256,
SDPA attention), attached with megatrain on the CPU, chunked loss on, fp32. One training
forward + ``loss.backward()`` of one sequence; the peak is the layer unit's recompute with grad
(the embedding, norm and chunked head hold far less). Measured with torch's memory profiler
(``torch.profiler.profile(profile_memory=True)``: the running sum of the CPU allocator's
allocation and free events, ``megatrain_hf/bench/cpu_memory.py``): tensor storage only.

    python scripts/longctx_memory.py                        # 4K .. 64K tokens, tiles of 1024
    python scripts/longctx_memory.py --seq-lens 1024 2048 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from megatrain_hf import MegaTrainConfig, attach
from megatrain_hf.bench.cpu_memory import peak_tensor_bytes


def _model() -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=512, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=1 << 20)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def measure(seq: int, tile: int | None) -> dict:
    model = _model()
    engine = attach(model, MegaTrainConfig(sequence_tile_tokens=tile, chunked_loss=True), device="cpu")
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    step()  # warm: the allocator and the engine's first-call state
    model.zero_grad()
    started = time.perf_counter()
    peak = peak_tensor_bytes(step)
    seconds = time.perf_counter() - started
    engine.detach()
    return {"seq": seq, "tile": tile, "peak_bytes": peak, "seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--tile", type=int, default=1024, help="tokens per MLP tile of the tiled runs")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    for seq in args.seq_lens:
        for tile in (None, args.tile):
            rows.append(measure(seq, tile))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| tokens | untiled peak (MiB) | tiled peak (MiB) | untiled s | tiled s |")
    print("|---:|---:|---:|---:|---:|")
    by = {(r["seq"], r["tile"]): r for r in rows}
    for seq in args.seq_lens:
        u, t = by[(seq, None)], by[(seq, args.tile)]
        print(f"| {seq} | {u['peak_bytes'] / 2**20:.1f} | {t['peak_bytes'] / 2**20:.1f} | {u['seconds']} | {t['seconds']} |")
    lo, hi = args.seq_lens[0], args.seq_lens[-1]
    for tile, name in ((None, "untiled"), (args.tile, f"tiled ({args.tile})")):
        growth = (by[(hi, tile)]["peak_bytes"] - by[(lo, tile)]["peak_bytes"]) / (hi - lo)
        print(f"growth per token {lo}..{hi}, {name}: {growth:.0f} B/token")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

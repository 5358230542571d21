"""CPU timing of HostAdamW: one training step (forward, backward, step) and the optimizer's update alone.

A small llama (random weights, built here) is attached on the CPU and trained with HostAdamW(model.parameters(),
engine.store). Prints one JSON line: the median seconds of a whole step and of ``step()`` + ``synchronize()``
(the background update, waited for) over ``--steps`` steps after ``--warmup``, and the tree it ran from.
Meant to compare two checkouts through PYTHONPATH, alternating, in one shell command, e.g.

    for i in 1 2 3; do for t in /tmp/before /tmp/after; do PYTHONPATH=$t python scripts/optim_step_bench.py; done; done
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import megatrain_hf
from megatrain_hf import HostAdamW, attach


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--state", default="fp32", help="optimizer_state of HostAdamW (fp32, bf16, 8bit, 4bit)")
    ap.add_argument("--kernel", default="torch", choices=["torch", "native"])
    args = ap.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875),
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=2 * args.seq,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    engine = attach(model, device="cpu")
    optimizer = HostAdamW(model.parameters(), engine.store, lr=1e-4, weight_decay=0.1, state=args.state,
                          kernel=args.kernel)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    whole, update = [], []
    for i in range(args.warmup + args.steps):
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        stepped = time.perf_counter()
        optimizer.step()
        optimizer.synchronize()
        done = time.perf_counter()
        optimizer.zero_grad()
        engine.synchronize()
        if i >= args.warmup:
            whole.append(done - started)
            update.append(done - stepped)
    optimizer.close()
    engine.detach()
    print(json.dumps({"tree": megatrain_hf.__file__.rsplit("/megatrain_hf/", 1)[0], "state": args.state,
                      "kernel": args.kernel, "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                      "step_s": round(statistics.median(whole), 4), "update_s": round(statistics.median(update), 5),
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()

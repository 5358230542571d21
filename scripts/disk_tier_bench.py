"""Host peak RSS per trainable parameter and the update's disk rate, with and without the disk tier.

Builds a Llama-shaped model from a config (random weights, fp32, CPU compute; ``--bf16``: bf16
compute through the staging copy, as on a GPU), attaches megatrain, runs ``--steps`` optimizer steps
(forward + backward + HostAdamW update), and prints JSON:

* ``peak_rss_B_per_param``: the process's peak RSS (VmHWM) from the imports to the end, per trainable
  parameter; ``peak_above_base_B_per_param``: the same less the RSS of the imports before the model
  existed (``base_rss_bytes``); ``attach_peak_*`` / ``built_peak_*`` / ``steps_peak_*``: the peak of each
  phase alone (VmHWM reset through /proc/self/clear_refs between them): building and attaching the model
  (``--loader eager``: HF builds it in fp32 first, 4 B/param; ``from_config``: its weights drawn at attach
  straight into the host store), building the optimizer, the training steps;
  ``ram_bytes``: what the store and the optimizer hold in RAM, tier by tier;
* ``update_s``: wall time of ``step()`` + ``synchronize()`` (the update, its reads ahead and its writes
  behind overlapping it), the last step's; ``disk_GBps``: bytes read + written by the tier in that step
  over that time; ``raw_fraction``: the time the disk alone needs for those bytes at ``--raw-read`` /
  ``--raw-write`` GB/s (from scripts/disk_rates.py) over ``update_s``.

    python scripts/disk_tier_bench.py --offload-dir /nvme/tmp --raw-read 1.2 --raw-write 1.7
    python scripts/disk_tier_bench.py --offload-dir /nvme/tmp --optimizer-state 8bit --kernel native
    python scripts/disk_tier_bench.py --offload-dir /nvme/tmp --offload-state all --bf16
    python scripts/disk_tier_bench.py --offload-dir /nvme/tmp --disk-io deepspeed   # DeepSpeed's libaio op
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import transformers

from megatrain_hf import HostAdamW, MegaTrainConfig, attach


def rss_peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--offload-dir", default=None, help="the state on disk there (--offload-state)")
    parser.add_argument("--offload-state", default="moments", choices=["moments", "all"],
                        help="with --offload-dir: the moments on disk, or the moments and the matrices' fp32 masters "
                             "(needs --bf16)")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute (the matrices stream their bf16 copy)")
    parser.add_argument("--grad-dtype", default="fp32", choices=["fp32", "bf16"],
                        help="the layers' matrices' gradient accumulators (MegaTrainConfig.grad_dtype; bf16 needs --bf16)")
    parser.add_argument("--window", type=int, default=None, help="RAM slots of the disk tier (default 4)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--loader", choices=["eager", "from_config"], default="eager",
                        help="eager: HF builds the model in fp32, then it attaches; from_config: the weights are drawn at "
                             "attach straight into the host store (megatrain_hf.from_config)")
    parser.add_argument("--optimizer-state", default="fp32", choices=["fp32", "bf16", "8bit", "4bit"],
                        help="the moments' format (MegaTrainConfig.optimizer_state)")
    parser.add_argument("--kernel", default="torch", choices=["torch", "native"], help="HostAdamW's host kernel")
    parser.add_argument("--disk-io", default="threads", choices=["threads", "auto", "deepspeed"],
                        help="the tier's I/O engine (MegaTrainConfig.disk_io)")
    parser.add_argument("--raw-read", type=float, default=None, help="GB/s, from scripts/disk_rates.py")
    parser.add_argument("--raw-write", type=float, default=None, help="GB/s, from scripts/disk_rates.py")
    args = parser.parse_args()

    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=args.hidden // 64, vocab_size=args.vocab,
                                      max_position_embeddings=args.seq)
    base_rss = rss_now()  # the imports' (torch, transformers, megatrain) before the model exists
    rss_peak_reset()
    torch.manual_seed(0)
    if args.loader == "from_config":
        import megatrain_hf

        model = megatrain_hf.from_config(config, seed=0)
    else:
        model = transformers.LlamaForCausalLM(config)
    engine = attach(model, MegaTrainConfig(offload_dir=args.offload_dir, offload_state=args.offload_state,
                                           grad_dtype=args.grad_dtype, optimizer_state=args.optimizer_state,
                                           offload_window=args.window or 4, disk_io=args.disk_io),
                    device="cpu", bf16=args.bf16)
    trainable = engine.store.trainable_numel()
    attach_peak = rss_peak()
    rss_peak_reset()
    opt = HostAdamW(model.parameters(), engine.store, lr=1e-4, offload_dir=args.offload_dir,
                    state=args.optimizer_state, kernel=args.kernel, offload_window=args.window,
                    offload_masters=args.offload_dir is not None and args.offload_state == "all", disk_io=args.disk_io)
    built_peak = rss_peak()
    rss_peak_reset()
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1))
    steps = []
    for _ in range(args.steps):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        compute_s = time.perf_counter() - start
        pager = opt.disk_tier
        before = (pager.bytes_read, pager.bytes_written) if pager else (0, 0)
        start = time.perf_counter()
        opt.step()
        opt.synchronize()
        update_s = time.perf_counter() - start
        opt.zero_grad()
        read, written = ((pager.bytes_read - before[0], pager.bytes_written - before[1]) if pager else (0, 0))
        row = {"compute_s": compute_s, "update_s": update_s, "read_bytes": read, "written_bytes": written,
               "disk_GBps": (read + written) / update_s / 1e9}
        if pager and args.raw_read and args.raw_write:
            row["raw_fraction"] = (read / (args.raw_read * 1e9) + written / (args.raw_write * 1e9)) / update_s
        steps.append(row)
    steps_peak = rss_peak()
    peak = max(attach_peak, built_peak, steps_peak)
    bufs = engine.store.buffers
    ram = {"masters": sum(4 * (b.master_host.numel() if b.master_host is not None else 0) for b in bufs),
           "masters_tail": sum(4 * b.master_tail.numel() for b in bufs if b.master_tail is not None),
           "grads": sum(4 * b.grad_host.numel() for b in bufs if b.grad_host is not None)
           + sum(2 * b.grad_low.numel() for b in bufs if b.grad_low is not None),
           "staging": sum(b.staging_host.numel() * b.staging_host.element_size() for b in bufs
                          if b.staging_host is not None),
           "moments": opt.moments.nbytes(),
           "window": opt.disk_tier.ram_bytes() if opt.disk_tier else 0}
    print(json.dumps({
        "offload_dir": args.offload_dir, "offload_state": args.offload_state if args.offload_dir else None,
        "compute": "bf16" if args.bf16 else "fp32", "optimizer_state": args.optimizer_state, "kernel": opt.kernel,
        "trainable_params": trainable, "peak_rss_bytes": peak, "peak_rss_B_per_param": peak / trainable,
        "steps_peak_rss_B_per_param": steps_peak / trainable, "grad_dtype": args.grad_dtype,
        "base_rss_bytes": base_rss, "steps_peak_above_base_B_per_param": (steps_peak - base_rss) / trainable,
        "peak_above_base_B_per_param": (peak - base_rss) / trainable, "loader": args.loader,
        "attach_peak_B_per_param": attach_peak / trainable, "built_peak_B_per_param": built_peak / trainable,
        "adopted_attach_tier": engine.store.tier_files is not None and opt.disk_tier is engine.store.tier_files.pager,
        "ram_bytes": ram, "ram_B_per_param": {k: v / trainable for k, v in ram.items()},
        "update_elements_per_s": trainable / steps[-1]["update_s"],
        "o_direct": all(opt.disk_tier.io.direct.values()) if opt.disk_tier else None,
        "disk_io_engine": type(opt.disk_tier.io).__name__ if opt.disk_tier else None, "steps": steps,
    }, indent=2))
    opt.close()


if __name__ == "__main__":
    main()

"""Host peak RSS per trainable parameter of a few-hundred-M-parameter Llama, per ``optimizer_state``.

One fresh subprocess per mode: build the model from a config (fp32, random init), train
``--steps`` optimizer steps through Trainer + MegaTrainPlugin(optimizer_state=mode) on the CPU
(fp32 compute: no staging copy; ``--bf16``: bf16 compute with it, ``--grad-dtype bf16`` its bf16 gradient
accumulators; ``--loader from_config``: the weights drawn at attach straight into the
host store, so the model never exists whole in fp32), then report the process's peak RSS (``ru_maxrss``), the RSS of the
same imports before the model existed, and both per trainable parameter.

    python scripts/optimizer_state_rss.py --json docs/results/optimizer-state-rss.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # this checkout's megatrain_hf, whatever is installed


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> None:
    import torch
    import transformers
    from transformers import Trainer, TrainingArguments

    from megatrain_hf import MegaTrainPlugin

    torch.set_num_threads(args.threads)
    base = rss_now()
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=args.hidden // 64, vocab_size=args.vocab,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    if args.loader == "from_config":  # drawn at attach straight into the host store: never whole in fp32
        import megatrain_hf

        model = megatrain_hf.from_config(config, seed=0)
    else:
        model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(0, args.vocab, (args.seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    targs = TrainingArguments(output_dir=os.path.join(args.work, args.mode), max_steps=args.steps,
                              per_device_train_batch_size=1, learning_rate=1e-4, save_strategy="no", report_to=[],
                              use_cpu=True, disable_tqdm=True, logging_steps=1, dataloader_num_workers=0,
                              bf16=args.bf16)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(),
                      callbacks=[MegaTrainPlugin(optimizer_state=args.mode, host_adamw_kernel="native",
                                                 metrics="none", grad_dtype=args.grad_dtype)])
    trainer.train()
    trainer.optimizer.optimizer.synchronize()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"mode": args.mode, "params": params, "peak_rss": peak, "base_rss": base,
                      "peak_per_param": peak / params, "above_base_per_param": (peak - base) / params}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="fp32,bf16,8bit,4bit")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loader", choices=["eager", "from_config"], default="eager",
                        help="eager: transformers builds the model in fp32, attaching moves it into the store; "
                             "from_config: megatrain_hf.from_config, the weights drawn into the store at attach")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 compute (TrainingArguments(bf16=True)): the matrices stream their bf16 staging copy, "
                             "as on a GPU (2 B/param more in RAM)")
    parser.add_argument("--grad-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="MegaTrainConfig.grad_dtype (bf16 needs --bf16)")
    parser.add_argument("--work", default="/tmp/optimizer-state-rss")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.mode:
        child(args)
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rows = []
    for mode in args.modes.split(","):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{mode:>5}: {row['params'] / 1e6:.0f} M params, peak RSS {row['peak_rss'] / 2**30:.2f} GiB = "
              f"{row['peak_per_param']:.2f} B/param ({row['above_base_per_param']:.2f} B/param above the "
              f"{row['base_rss'] / 2**20:.0f} MiB of the imports)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "command": " ".join(["scripts/optimizer_state_rss.py", *sys.argv[1:]]),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

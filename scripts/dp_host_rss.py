"""Host memory of data-parallel training: the same model trained by 1 and by N ranks on one host.

    python tests/scripts/load_rss.py --make DIR --hidden 1024 --layers 12 --dtype fp32   # a ~218 M model
    python scripts/dp_host_rss.py --model DIR --nproc 1 --out one.json
    python scripts/dp_host_rss.py --model DIR --nproc 2 --out two.json

Each run is ``torchrun --nproc_per_node N`` of this file: every rank reads the model with
``megatrain_hf.from_pretrained`` (each rank reads only its own units), trains it for ``--steps``
optimizer steps with plain ``Trainer`` + megatrain (fp32 on the CPU, AdamW, one sequence of 64
tokens per rank and step) and reports its peak resident memory (Linux's VmHWM) and its peak
proportional set size (PSS: pages shared between the ranks -- the torch and Python libraries --
counted once over the host), sampled every 50 ms, and its resident memory once the imports are done
(``baseline``: what every process costs before any model). ``--out`` gets the per-rank values and their
sums: the host's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's megatrain_hf


def _kib(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class PeakPss(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kib = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak_kib = max(self.peak_kib, _kib("/proc/self/smaps_rollup", "Pss"))
            time.sleep(0.05)


def rank_main(args) -> None:
    import torch
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    import megatrain_hf

    baseline_kib = _kib("/proc/self/status", "VmRSS")  # Python, torch, transformers, megatrain imported
    pss = PeakPss()
    pss.start()

    class Tokens(Dataset):
        def __init__(self, n: int) -> None:
            self.ids = torch.randint(0, 32000, (n, 64), generator=torch.Generator().manual_seed(1))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    model = megatrain_hf.from_pretrained(args.model)
    targs = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=1,
                              learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                              disable_tqdm=True, dataloader_num_workers=0)
    plugin = megatrain_hf.MegaTrainPlugin(check_host_memory=False)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(64), callbacks=[plugin])
    trainer.train()
    megatrain_hf.engine_of(model).synchronize()
    pss.stop.set()
    pss.join()
    engine = megatrain_hf.engine_of(model)
    result = {"rank": targs.process_index, "baseline_kib": baseline_kib, "vmhwm_kib": _kib("/proc/self/status", "VmHWM"),
              "peak_pss_kib": pss.peak_kib, "store_bytes": engine.store.host_bytes(),
              "optimizer_bytes": sum(t.numel() * 4 for t in (*trainer.optimizer.optimizer._exp_avg.values(),
                                                             *trainer.optimizer.optimizer._exp_avg_sq.values())),
              "params": sum(p.numel() for p in model.parameters())}
    with open(f"{args.out}.rank{targs.process_index}", "w") as f:
        json.dump(result, f)


def launch(args) -> None:
    port = 29500 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(port), os.path.abspath(__file__), "--rank-worker", "--model", args.model,
           "--steps", str(args.steps), "--out", args.out, "--output_dir", args.output_dir]
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    ranks = []
    for r in range(args.nproc):
        path = f"{args.out}.rank{r}"
        with open(path) as f:
            ranks.append(json.load(f))
        os.remove(path)
    total = {"nproc": args.nproc, "ranks": ranks,
             "host_peak_rss_GiB": sum(r["vmhwm_kib"] for r in ranks) / 2**20,
             "host_peak_pss_GiB": sum(r["peak_pss_kib"] for r in ranks) / 2**20,
             "host_baseline_rss_GiB": sum(r["baseline_kib"] for r in ranks) / 2**20,
             "store_GiB": sum(r["store_bytes"] for r in ranks) / 2**30,
             "optimizer_GiB": sum(r["optimizer_bytes"] for r in ranks) / 2**30}
    with open(args.out, "w") as f:
        json.dump(total, f, indent=1)
    print(json.dumps({k: v for k, v in total.items() if k != "ranks"}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--output_dir", default="/tmp/dp_host_rss")
    parser.add_argument("--rank-worker", action="store_true")
    args = parser.parse_args()
    (rank_main if args.rank_worker else launch)(args)


if __name__ == "__main__":
    main()

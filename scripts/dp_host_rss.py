"""Host memory of data-parallel training: the same model trained by 1 and by N ranks on one host.

    python tests/tools/load_rss.py --make DIR --hidden 1024 --layers 12 --dtype fp32   # a ~0.2 B model
    python scripts/dp_host_rss.py --model DIR --nproc 0 --out plain.json   # one plain process, no torch.distributed
    python scripts/dp_host_rss.py --model DIR --nproc 1 --out one.json     # torchrun, 1 rank
    python scripts/dp_host_rss.py --model DIR --nproc 2 --out two.json     # torchrun, 2 ranks

Each run is ``torchrun --nproc_per_node N`` of this file (``--nproc 0``: the same worker as one plain
``python`` process): every rank reads the model with ``megatrain_hf.from_pretrained`` (each rank reads
only its own units), trains it for ``--steps`` optimizer steps with plain ``Trainer`` + megatrain (fp32
on the CPU, AdamW, one sequence of 64 tokens per rank and step).

Every rank samples, every 50 ms, its resident memory (VmRSS) and proportional set size (PSS: pages
shared between the ranks -- the torch and Python libraries -- counted once over the host), each sample
stamped with the wall clock and the phase it ran in (``load``: from_pretrained; ``build``: Trainer
built; ``stepK``: optimizer step K, its forward, backward and update). ``--out`` gets:

* ``host_peak_rss_GiB``: the peak over time of the ranks' summed RSS (the host's peak: the samples
  are put in 50 ms bins, each rank's largest sample of a bin, its last one carried over a bin it has
  none in, summed over the ranks);
* ``sum_of_rank_vmhwm_GiB``: the sum of the ranks' own peaks (Linux's exact VmHWM; an upper bound:
  the ranks peak at different times);
* the same by phase, the baseline after the imports (what every process costs before any model),
  and the store's and the optimizer's bytes.
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

BIN_S = 0.05


def _kib(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class Sampler(threading.Thread):
    """(wall time, phase, VmRSS KiB, PSS KiB) every 50 ms, in the phase set by the training code."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.phase = "imports"
        self.samples: list[tuple[float, str, int, int]] = []
        self.stop = threading.Event()

    def sample(self) -> None:
        self.samples.append((time.time(), self.phase, _kib("/proc/self/status", "VmRSS"),
                             _kib("/proc/self/smaps_rollup", "Pss")))

    def set_phase(self, phase: str) -> None:
        self.sample()  # the end of the phase before
        self.phase = phase
        self.sample()

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            time.sleep(BIN_S)


def rank_main(args) -> None:
    import torch
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import megatrain_hf

    baseline_kib = _kib("/proc/self/status", "VmRSS")  # Python, torch, transformers, megatrain imported
    sampler = Sampler()
    sampler.start()

    class Tokens(Dataset):
        def __init__(self, n: int) -> None:
            self.ids = torch.randint(0, 32000, (n, 64), generator=torch.Generator().manual_seed(1))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Phases(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            sampler.set_phase(f"step{state.global_step + 1}")

    sampler.set_phase("load")
    model = megatrain_hf.from_pretrained(args.model)
    sampler.set_phase("build")
    targs = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=1,
                              learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                              disable_tqdm=True, dataloader_num_workers=0)
    plugin = megatrain_hf.MegaTrainPlugin(check_host_memory=False)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(64), callbacks=[plugin, Phases()])
    trainer.train()
    megatrain_hf.engine_of(model).synchronize()
    sampler.stop.set()
    sampler.join()
    sampler.sample()
    engine = megatrain_hf.engine_of(model)
    result = {"rank": targs.process_index, "baseline_kib": baseline_kib, "vmhwm_kib": _kib("/proc/self/status", "VmHWM"),
              "samples": sampler.samples, "store_bytes": engine.store.host_bytes(),
              "optimizer_bytes": trainer.optimizer.optimizer.moments.nbytes(),
              "params": sum(p.numel() for p in model.parameters())}
    with open(f"{args.out}.rank{targs.process_index}", "w") as f:
        json.dump(result, f)


def host_peaks(ranks: list[dict], column: int) -> tuple[float, dict[str, int]]:
    """Peak over time of the ranks' summed sample ``column`` (2: RSS, 3: PSS), overall and by phase
    (the phase of rank 0's sample; KiB)."""
    start = min(r["samples"][0][0] for r in ranks)
    binned = []  # per rank: {bin: (largest value, phase)}
    for r in ranks:
        bins: dict[int, tuple[int, str]] = {}
        for t, phase, *values in r["samples"]:
            b = int((t - start) / BIN_S)
            v = values[column - 2]
            if b not in bins or v > bins[b][0]:
                bins[b] = (v, phase)
        binned.append(bins)
    last_bin = max(max(b) for b in binned)
    current = [(0, "imports")] * len(ranks)
    peak, by_phase = 0, {}
    for b in range(last_bin + 1):
        current = [bins.get(b, cur) for bins, cur in zip(binned, current)]
        total = sum(v for v, _ in current)
        phase = current[0][1]
        peak = max(peak, total)
        by_phase[phase] = max(by_phase.get(phase, 0), total)
    return peak, by_phase


def launch(args) -> None:
    worker = [os.path.abspath(__file__), "--rank-worker", "--model", args.model, "--steps", str(args.steps),
              "--out", args.out, "--output_dir", args.output_dir]
    if args.nproc == 0:  # one plain process: no torchrun, no torch.distributed
        cmd = [sys.executable, *worker]
    else:
        port = 29500 + os.getpid() % 1000
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(port), *worker]
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    ranks = []
    for r in range(max(args.nproc, 1)):
        path = f"{args.out}.rank{r}"
        with open(path) as f:
            ranks.append(json.load(f))
        os.remove(path)
    gib = 2**20  # KiB per GiB
    rss_peak, rss_phase = host_peaks(ranks, 2)
    pss_peak, _ = host_peaks(ranks, 3)
    per_rank_phase = []
    for r in ranks:
        peaks: dict[str, float] = {}
        for _, phase, rss, _ in r["samples"]:
            peaks[phase] = max(peaks.get(phase, 0), rss / gib)
        per_rank_phase.append(peaks)
    total = {"nproc": args.nproc, "params": ranks[0]["params"],
             "host_peak_rss_GiB": rss_peak / gib,
             "host_peak_rss_by_phase_GiB": {k: v / gib for k, v in rss_phase.items()},
             "host_peak_pss_GiB": pss_peak / gib,
             "sum_of_rank_vmhwm_GiB": sum(r["vmhwm_kib"] for r in ranks) / gib,
             "rank_vmhwm_GiB": [r["vmhwm_kib"] / gib for r in ranks],
             "rank_peak_rss_by_phase_GiB": per_rank_phase,
             "host_baseline_rss_GiB": sum(r["baseline_kib"] for r in ranks) / gib,
             "store_GiB": sum(r["store_bytes"] for r in ranks) / 2**30,
             "optimizer_GiB": sum(r["optimizer_bytes"] for r in ranks) / 2**30}
    with open(args.out, "w") as f:
        json.dump(total, f, indent=1)
    print(json.dumps(total))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--nproc", type=int, default=1, help="ranks (torchrun); 0: one plain process")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--output_dir", default="/tmp/dp_host_rss")
    parser.add_argument("--rank-worker", action="store_true")
    args = parser.parse_args()
    (rank_main if args.rank_worker else launch)(args)


if __name__ == "__main__":
    main()

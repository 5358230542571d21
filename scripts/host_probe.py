"""Host-side numbers that decide the CPU optimizer's speed: threads, fused AdamW and copy rates."""
import os
import threading
import time

import torch

n = 256 * 2**20  # 268M params in 8 tensors
print("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS"), "torch threads", torch.get_num_threads(),
      "affinity", len(os.sched_getaffinity(0)))
ps = [torch.randn(n // 8) for _ in range(8)]
gs = [torch.randn(n // 8) for _ in range(8)]
ms = [torch.zeros(n // 8) for _ in range(8)]
vs = [torch.zeros(n // 8) for _ in range(8)]
step = torch.tensor(1.0)


def adam():
    torch._fused_adamw_(ps, gs, ms, vs, [], [step] * 8, amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999,
                        weight_decay=0.0, eps=1e-8, maximize=False, grad_scale=None, found_inf=None)


def rate(fn, reps=3):
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return n * reps / (time.perf_counter() - t) / 1e9


for threads in (torch.get_num_threads(), len(os.sched_getaffinity(0))):
    torch.set_num_threads(threads)
    print(f"threads={threads}: fused AdamW {rate(adam):.2f} Gparam/s")
    res = {}
    def in_thread():
        torch.set_num_threads(threads)
        res["r"] = rate(adam)
    t = threading.Thread(target=in_thread); t.start(); t.join()
    print(f"threads={threads}: fused AdamW in a worker thread {res['r']:.2f} Gparam/s")
    flat = torch.cat(ps)
    bf = torch.empty(n, dtype=torch.bfloat16)
    print(f"threads={threads}: fp32->bf16 copy {rate(lambda: bf.copy_(flat)):.2f} Gelem/s")
    acc = torch.zeros(n)
    print(f"threads={threads}: fp32 += bf16 {rate(lambda: acc.add_(bf)):.2f} Gelem/s")

# The engine's update per unit: clip multiply + fused AdamW + bf16 staging copy (torch, 3 passes)
# against megatrain's native kernel (1 pass), on the same tensors.
import math  # noqa: E402

from megatrain_hf.optim import native  # noqa: E402

lib = native.host_adamw()
stages = [torch.empty(n // 8, dtype=torch.bfloat16) for _ in range(8)]
coef = torch.tensor(0.5)
torch.set_num_threads(len(os.sched_getaffinity(0)))


def torch_three_pass():
    torch._foreach_mul_(gs, coef)
    adam()
    for s, p in zip(stages, ps):
        s.copy_(p)


def native_one_pass():
    sc = dict(decay=[1.0] * 8, lerp=[0.1] * 8, beta2=[0.999] * 8, sq_coef=[0.001] * 8,
              bc2_sqrt=[math.sqrt(0.001)] * 8, eps=[1e-8] * 8, neg_step_size=[-1e-2] * 8)
    native.adamw(lib, ps, gs, ms, vs, stages, sc, 0.5, False, torch.get_num_threads())


def native_no_staging():
    """host_staging=False: 28 B per parameter (no bf16 copy written); against torch's fused AdamW
    alone (also 28 B, without the clip multiply) it says how close the native pass is to the rate
    that the same bytes allow on this host."""
    sc = dict(decay=[1.0] * 8, lerp=[0.1] * 8, beta2=[0.999] * 8, sq_coef=[0.001] * 8,
              bc2_sqrt=[math.sqrt(0.001)] * 8, eps=[1e-8] * 8, neg_step_size=[-1e-2] * 8)
    native.adamw(lib, ps, gs, ms, vs, [None] * 8, sc, 0.5, False, torch.get_num_threads())


print(f"threads={torch.get_num_threads()}: clip+AdamW+staging, torch 3 passes {rate(torch_three_pass):.2f} Gparam/s")
if lib is not None:
    print(f"threads={torch.get_num_threads()}: clip+AdamW+staging, native 1 pass {rate(native_one_pass):.2f} Gparam/s")
    print(f"threads={torch.get_num_threads()}: clip+AdamW, native 1 pass, no staging {rate(native_no_staging):.2f} Gparam/s")
    print(f"threads={torch.get_num_threads()}: AdamW alone, torch fused (same 28 B) {rate(adam):.2f} Gparam/s")

# Transparent huge pages were measured on the H200 host at 5181798 (3.26 vs 3.38 G params/s on
# ordinary pages: no gain), so the store keeps ordinary allocations and the probe no longer times them.

# Does DMA traffic (weights up, gradients down, as during training) take host memory bandwidth from
# the update? The native pass alone, the copy engines alone (pinned <-> device, both directions at
# once), then both together. If the update slows by about what the DMA moves, host DRAM is the
# bound and moving part of the update to the GPU would not help; if not, the 16 cores are.
if lib is not None and torch.cuda.is_available():
    numel = 2**29  # 2 GiB of fp32 each way
    host_up, host_down = torch.empty(numel, pin_memory=True), torch.empty(numel, pin_memory=True)
    dev_up, dev_down = torch.empty(numel, device="cuda"), torch.empty(numel, device="cuda")
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    stop = threading.Event()
    moved = []

    def pump():
        while not stop.is_set():
            started = time.perf_counter()
            with torch.cuda.stream(streams[0]):
                dev_up.copy_(host_up, non_blocking=True)
            with torch.cuda.stream(streams[1]):
                host_down.copy_(dev_down, non_blocking=True)
            for stream in streams:
                stream.synchronize()
            moved.append((2 * numel * 4, time.perf_counter() - started))

    def dma_rate() -> float:
        done = sum(b for b, _ in moved)
        spent = sum(t for _, t in moved)
        moved.clear()
        return done / spent / 1e9 if spent else 0.0

    pumping = threading.Thread(target=pump)
    pumping.start()
    time.sleep(3)
    alone = dma_rate()
    together = rate(native_one_pass)
    with_update = dma_rate()
    stop.set()
    pumping.join()
    print(f"DMA both ways, alone: {alone:.1f} GB/s; during the native update: {with_update:.1f} GB/s")
    print(f"threads={torch.get_num_threads()}: clip+AdamW+staging, native 1 pass while DMA runs {together:.2f} Gparam/s")

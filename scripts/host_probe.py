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

from megatrain_hf import native  # noqa: E402

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


print(f"threads={torch.get_num_threads()}: clip+AdamW+staging, torch 3 passes {rate(torch_three_pass):.2f} Gparam/s")
if lib is not None:
    print(f"threads={torch.get_num_threads()}: clip+AdamW+staging, native 1 pass {rate(native_one_pass):.2f} Gparam/s")

# The same native pass on buffers advised as transparent huge pages (madvise MADV_HUGEPAGE on
# 2 MiB-aligned memory, before first touch): fewer TLB misses while streaming ~30 B/param.
# Whether the store should allocate its flats this way is decided by this number on the GPU host.
if lib is not None:
    import ctypes  # noqa: E402

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    huge_page = 2 * 2**20
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip() if os.path.exists(
        "/sys/kernel/mm/transparent_hugepage/enabled") else "absent"
    keep = []

    def huge(numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        raw = torch.empty(nbytes + 2 * huge_page, dtype=torch.uint8)
        start = -raw.data_ptr() % huge_page
        length = (nbytes + huge_page - 1) // huge_page * huge_page
        if libc.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(length), 14) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
        keep.append(raw)
        return raw[start : start + nbytes].view(dtype)

    def filled(like: torch.Tensor) -> torch.Tensor:
        t = huge(like.numel(), like.dtype)
        t.copy_(like)
        return t

    ps, gs, ms, vs = ([filled(t) for t in ts] for ts in (ps, gs, ms, vs))
    stages = [huge(n // 8, torch.bfloat16) for _ in range(8)]
    anon_huge = [line for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")]
    print(f"THP {thp}; {anon_huge[0].strip() if anon_huge else ''}")
    print(f"threads={torch.get_num_threads()}: clip+AdamW+staging, native 1 pass on huge pages "
          f"{rate(native_one_pass):.2f} Gparam/s")

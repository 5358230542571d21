"""Update throughput of HostAdamW's kernels per ``optimizer_state`` on one unit of a few hundred MB.

A unit like a decoder layer: ``--tensors`` fp32 parameters of ``--numel`` elements in all (default
64 M elements = 256 MB of masters), gradients, the moments in each format and a bf16 staging copy
(written by the native kernel in its pass; the torch path's separate staging pass is timed too).
Each (mode, kernel) runs ``--reps`` updates after one warm-up; the best is reported as parameters
updated per second. With ``--bnb PATH`` (a ``pip install --target`` directory of bitsandbytes) its
8-bit blockwise AdamW on the same CPU tensors is timed as well, if it runs on the CPU.

    python scripts/optimizer_state_throughput.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # this checkout's megatrain_hf, whatever is installed

import torch  # noqa: E402

from megatrain_hf.optim import native  # noqa: E402
from megatrain_hf.optim.compressed import EntryState  # noqa: E402
from megatrain_hf.optim.kernels import GroupWork, native_update, torch_update  # noqa: E402
from megatrain_hf.optim.moment_formats import format_of  # noqa: E402
from megatrain_hf.optim.moment_store import Fp32State, layout_of  # noqa: E402


def work(mode: str, sizes: list[int]) -> tuple[GroupWork, list[torch.Tensor]]:
    fmt = format_of(mode)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g) * 1e-3 for n in sizes]
    stages = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    compressed = None
    m = v = []
    if mode == "fp32":
        m, v = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    else:
        def codes(n):
            return torch.zeros(fmt.code_bytes(n) // (2 if mode == "bf16" else 1),
                               dtype=torch.bfloat16 if mode == "bf16" else torch.uint8)

        compressed = [EntryState(fmt, n, (codes(n), codes(n)),
                                 (torch.zeros(fmt.blocks(n)), torch.zeros(fmt.blocks(n))) if fmt.quantized else (None, None))
                      for n in sizes]
    states = compressed if compressed is not None else [Fp32State(a, b) for a, b in zip(m, v)]
    w = GroupWork(entries=[], steps=[torch.zeros(()) for _ in sizes], params=params, grads=grads, lr=1e-3,
                  beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, maximize=False, clip=None,
                  layout=layout_of(fmt, {}, {}), states=states)
    return w, stages


def timed(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bnb_rate(path: str, sizes: list[int], reps: int) -> tuple[float | None, str]:
    sys.path.insert(0, path)
    try:
        import bitsandbytes as bnb

        params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = bnb.optim.AdamW8bit(params, lr=1e-3, weight_decay=0.1, min_8bit_size=0)
        seconds = timed(opt.step, reps)
        kind = type(opt.state[params[0]].get("state1")).__name__, str(opt.state[params[0]]["state1"].dtype)
        return sum(sizes) / seconds, f"bitsandbytes {bnb.__version__} AdamW8bit, state1 {kind}"
    except Exception as exc:  # noqa: BLE001 -- recorded: why the comparison did not run
        return None, f"bitsandbytes: {type(exc).__name__}: {str(exc)[:300]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 * 2**20)
    parser.add_argument("--tensors", type=int, default=7)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--modes", default="fp32,bf16,8bit,4bit")
    parser.add_argument("--kernels", default="native,torch")
    parser.add_argument("--bnb", default=None, help="a --target directory holding bitsandbytes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [args.numel // args.tensors] * args.tensors
    lib = native.host_adamw()
    rows = []
    for mode in args.modes.split(","):
        for kernel in args.kernels.split(","):
            if kernel == "native" and lib is None:
                continue
            w, stages = work(mode, sizes)
            if kernel == "native":
                def fn():
                    native_update(lib, w, stages)
            else:
                def fn():
                    torch_update(w)
                    for p, s in zip(w.params, stages):  # the store's staging refresh after torch's kernel
                        s.copy_(p)
            seconds = timed(fn, args.reps)
            rows.append({"mode": mode, "kernel": kernel, "params_per_s": sum(sizes) / seconds, "seconds": seconds})
            print(f"{mode:>5} {kernel:>6}: {sum(sizes) / seconds / 1e6:8.1f} M params/s ({seconds:.3f} s per update)",
                  flush=True)
            del w, stages
    if args.bnb:
        rate, what = bnb_rate(args.bnb, sizes, args.reps)
        rows.append({"mode": "8bit", "kernel": "bitsandbytes", "params_per_s": rate, "what": what})
        print(f"{what}: " + (f"{rate / 1e6:.1f} M params/s" if rate else "did not run"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": sum(sizes), "tensors": args.tensors, "threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

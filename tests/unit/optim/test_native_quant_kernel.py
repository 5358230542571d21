"""The native compressed-moments kernel (8-bit / 4-bit) bit for bit against a plain-torch step.

The reference does the kernel's arithmetic op for op in fp32 torch: expand the codes (quant.expand),
the AdamW element of csrc/host_adamw.cpp (its two fused multiply-adds computed exactly: the product
in float64, the sum corrected for double rounding; the square root in float64, which rounds to
the correctly rounded fp32 one), then quant.compress (absmax per block, x /
absmax, bucketize on the midpoints: the count of midpoints <= x; a positive v floored to the lowest
non-zero level; the m of an element without a gradient rounded toward zero). Codes, scales, parameters and the
bf16 staging copy must be equal as bits, over several steps, on data with zeros, all-zero blocks,
values exactly on a midpoint and one float either side, denormals, huge and tiny magnitudes,
partial blocks, odd lengths (4-bit: a half-filled last byte), bf16 gradients and tensors spanning
several of the kernel's work chunks. Both builds are checked: the AVX-512 decode / encode (where the
CPU has it) and the scalar loops alone (``-DMEGATRAIN_SCALAR``); on NaNs, infinities, zero blocks
and block sizes that are not a multiple of the vector width the two are compared with each other.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from megatrain_hf.optim import native
from megatrain_hf.optim.moment_formats import compress, expand, format_of

pytestmark = pytest.mark.skipif(native.host_adamw() is None, reason="no C++ compiler to build the kernel")

F32 = torch.float32


@functools.lru_cache(maxsize=1)
def scalar_lib():
    return native.load(native.build(defines=("MEGATRAIN_SCALAR",)))


def libs(name: str):
    return native.host_adamw() if name == "simd" else scalar_lib()


def cpu_has_avx512() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return {"avx512f", "avx512bw", "avx512vl"} <= set(flags)


LIBS = ["simd", "scalar"]


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F32)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c), correctly rounded: a * b is exact in float64, the float64 sum s is corrected
    when it lands on a midpoint between two floats while the exact sum (s + err) lies off it."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)  # TwoSum: s + err == p + c exactly
    r = s.float()
    other = torch.where(r.double() > s, torch.nextafter(r, f32(-float("inf"))), torch.nextafter(r, f32(float("inf"))))
    tie = (r.double() + other.double()) / 2 == s  # s is exactly halfway between r and its neighbour
    nudged = torch.where(err > 0, torch.nextafter(s, torch.tensor(float("inf"), dtype=torch.float64)),
                         torch.nextafter(s, torch.tensor(-float("inf"), dtype=torch.float64)))
    return torch.where(tie & (err != 0), nudged.float(), r)


def reference_step(fmt, p, g, codes, scales, hyper, clip):
    """One step of one tensor, in place on p / codes / scales; returns the bf16 staging copy."""
    n = p.numel()
    mo, vo = (expand(fmt, k, codes[k], scales[k], n) for k in (0, 1))
    lerp = f32(hyper["lerp"])
    small = bool(lerp.abs() < 0.5)
    coeff = lerp if small else lerp - 1
    gs = g.float() * f32(clip)
    param = p * f32(hyper["decay"])
    mi = fma32(coeff.expand(n), gs - mo, mo if small else gs)
    vi = fma32(f32(hyper["sq_coef"]) * gs, gs, vo * f32(hyper["beta2"]))
    root = torch.sqrt(vi.double()).float()  # correctly rounded (torch's fp32 sqrt may use an 0.5001-ulp one)
    denom = root / f32(hyper["bc2_sqrt"]) + f32(hyper["eps"])
    p.copy_(param + (f32(hyper["neg_step_size"]) * mi) / denom)
    compress(fmt, 0, mi, codes[0], scales[0], toward_zero=gs == 0)  # no gradient: m rounds toward zero
    compress(fmt, 1, vi, codes[1], scales[1])  # (a positive v at least the map's lowest non-zero value)
    return p.to(torch.bfloat16)


def edge_values(fmt, n: int, gen: torch.Generator) -> torch.Tensor:
    """Gradients that with beta1 = 0 become exp_avg exactly: every block opens with +-1 (its absmax, a power
    of two times it), then the map's midpoints, a float either side, zeros, denormals, random values."""
    mids = fmt.midpoints(0)
    near = torch.cat((mids, torch.nextafter(mids, f32(2.0)), torch.nextafter(mids, f32(-2.0)), torch.zeros(4),
                      -torch.zeros(2), torch.tensor([1e-40, -1e-40, 1e-45, 1e-30, -3e-20, 0.999999, -0.999999])))
    pool = torch.cat((near, torch.rand(n, generator=gen) * 2 - 1))
    x = pool[torch.randint(pool.numel(), (n,), generator=gen)]
    x[: near.numel()] = near[: min(n, near.numel())]
    x[:: fmt.block] = torch.where(torch.rand(x[:: fmt.block].shape, generator=gen) < 0.5, 1.0, -1.0)
    powers = 2.0 ** torch.randint(-60, 60, (fmt.blocks(n),), generator=gen).float()
    return x * powers.repeat_interleave(fmt.block)[:n]


def run_both(mode, sizes, hyper, steps, clip, grad_dtype, make_grad, threads=2, lib_name="simd"):
    fmt = format_of(mode)
    gen = torch.Generator().manual_seed(sum(sizes) + steps)
    lib = libs(lib_name)
    base = [torch.randn(n, generator=gen) * 10.0 ** float(torch.randint(-3, 3, ())) for n in sizes]
    states = []
    for _ in range(2):
        codes = tuple([torch.zeros(fmt.code_bytes(n), dtype=torch.uint8) for n in sizes] for _ in (0, 1))
        scales = tuple([torch.zeros(fmt.blocks(n)) for n in sizes] for _ in (0, 1))
        states.append(([b.clone() for b in base], codes, scales))
    # a random starting state: random codes (4-bit: both nibbles), scales of all magnitudes, some zero
    for k in (0, 1):
        for i, n in enumerate(sizes):
            c = torch.randint(256, (fmt.code_bytes(n),), generator=gen, dtype=torch.uint8)
            if mode == "4bit" and n % 2:
                c[-1] &= 0x0F
            s = torch.rand(fmt.blocks(n), generator=gen) * 10.0 ** torch.randint(-30, 5, (fmt.blocks(n),), generator=gen)
            s[::5] = 0.0  # all-zero blocks
            for st in states:
                st[1][k][i].copy_(c)
                st[2][k][i].copy_(s)
    for step in range(steps):
        grads = [make_grad(fmt, n, gen).to(grad_dtype) for n in sizes]
        for i in range(len(sizes)):
            grads[i][: fmt.block] = 0.0  # with the zero scales above: blocks whose new moments are all 0
        stages = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        params, codes, scales = states[1]
        native.adamw_compressed(lib, params, grads, codes, scales, stages, {k: [v] * len(sizes) for k, v in hyper.items()},
                                fmt, clip, False, threads)
        params_r, codes_r, scales_r = states[0]
        for i in range(len(sizes)):
            staged = reference_step(fmt, params_r[i], grads[i], (codes_r[0][i], codes_r[1][i]),
                                    (scales_r[0][i], scales_r[1][i]), hyper, clip)
            where = f"{mode} step {step} tensor {i} ({sizes[i]})"
            assert torch.equal(params[i].view(torch.int32), params_r[i].view(torch.int32)), where
            assert torch.equal(stages[i].view(torch.int16), staged.view(torch.int16)), where
            for k in (0, 1):
                assert torch.equal(codes[k][i], codes_r[k][i]), (where, k)
                assert torch.equal(scales[k][i].view(torch.int32), scales_r[k][i].view(torch.int32)), (where, k)
    return states[1]


def hyper_of(beta1, beta2, step=1, lr=1e-3, wd=0.1, eps=1e-8):
    return dict(decay=1 - lr * wd, lerp=1 - beta1, beta2=beta2, sq_coef=1 - beta2,
                bc2_sqrt=(1 - beta2**step) ** 0.5, eps=eps, neg_step_size=-(lr / (1 - beta1**step)) if beta1 else -lr)


SIZES = [1, 2, 3, 127, 129, 256, 255, 1000, 4 * 256 + 7]


@pytest.mark.parametrize("lib_name", LIBS)
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_edge_values_on_midpoints(mode, lib_name):
    """beta1 = 0: exp_avg is the gradient itself, so the codes see exact midpoints and their neighbours."""
    run_both(mode, SIZES, hyper_of(0.0, 0.999), 2, 1.0, torch.float32, edge_values, lib_name=lib_name)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_random_steps(mode, grad_dtype, lib_name="simd"):
    """Several steps from a random state with the usual betas and clipping; one tensor spans two work
    chunks (the bf16 gradient path updates a view that starts inside the codes). The default build
    only: the scalar one matches it bit for bit (test_vector_matches_scalar_bitwise)."""
    def grad(fmt, n, gen):
        g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 2, (n,), generator=gen).float()
        return torch.where(torch.rand(n, generator=gen) < 0.2, 0.0, g)  # elements without a gradient

    run_both(mode, SIZES + [(1 << 18) + 3 * 128 + 1], hyper_of(0.9, 0.95, step=3), 3, 0.37, grad_dtype, grad,
             lib_name=lib_name)


def test_builds_differ_where_the_cpu_allows():
    """The default build takes the AVX-512 path exactly where the CPU has it; the scalar one never."""
    assert native.host_adamw().megatrain_simd() == int(cpu_has_avx512())
    assert scalar_lib().megatrain_simd() == 0


def hostile_grad(fmt, n, gen):
    """Magnitudes over 60 decades, ~2 % NaN, ~1 % +-inf, zeros, denormals; whole blocks of zeros and
    of NaNs; the last block (partial where the block does not divide n) random."""
    g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-40, 20, (n,), generator=gen).float()
    pick = torch.rand(n, generator=gen)
    g[pick < 0.02] = float("nan")
    g[(pick >= 0.02) & (pick < 0.025)] = float("inf")
    g[(pick >= 0.025) & (pick < 0.03)] = -float("inf")
    g[(pick >= 0.03) & (pick < 0.05)] = 0.0
    g[(pick >= 0.05) & (pick < 0.06)] = 1e-41
    blocks = fmt.blocks(n)
    if blocks > 2:
        g[fmt.block: 2 * fmt.block] = 0.0
        g[2 * fmt.block: 3 * fmt.block] = float("nan")
    return g


def random_state(fmt, mode, n, gen):
    codes = [torch.randint(256, (fmt.code_bytes(n),), generator=gen, dtype=torch.uint8) for _ in (0, 1)]
    if mode == "4bit" and n % 2:
        for c in codes:
            c[-1] &= 0x0F
    scales = []
    for _ in (0, 1):
        s = torch.rand(fmt.blocks(n), generator=gen) * 10.0 ** torch.randint(-40, 30, (fmt.blocks(n),), generator=gen)
        s[::4] = 0.0
        s[1::7] = float("inf")  # expands to +-inf, or NaN where the code's map value is 0
        scales.append(s)
    return codes, scales


@pytest.mark.skipif(not cpu_has_avx512(), reason="no AVX-512: both builds are the scalar loops")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,block", [("8bit", 256), ("8bit", 30), ("8bit", 4096), ("8bit", 2),
                                        ("4bit", 128), ("4bit", 34), ("4bit", 62), ("4bit", 4096)])
def test_vector_matches_scalar_bitwise(mode, block, grad_dtype):
    """Three steps of both builds from the same hostile state: codes, scales, parameters and the bf16
    staging copy equal as bits, NaNs included; tensor lengths around the vector widths and the block,
    one spanning two work chunks."""
    fmt = dataclasses.replace(format_of(mode), block=block)
    gen = torch.Generator().manual_seed(block + (grad_dtype == torch.bfloat16))
    sizes = [1, 2, 3, 15, 16, 17, 31, 32, 33, 63, block - 1, block + 1, 3 * block + 5, (1 << 18) + 77]
    sizes = [n for n in sizes if n > 0]
    params = [torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 3, (n,), generator=gen).float() for n in sizes]
    states = [random_state(fmt, mode, n, gen) for n in sizes]
    runs = []
    for lib in (native.host_adamw(), scalar_lib()):
        runs.append(([p.clone() for p in params],
                     tuple([st[0][k].clone() for st in states] for k in (0, 1)),
                     tuple([st[1][k].clone() for st in states] for k in (0, 1)), lib))
    hyper = hyper_of(0.9, 0.999, step=2)
    for step in range(3):
        grads = [hostile_grad(fmt, n, gen).to(grad_dtype) for n in sizes]
        staged = []
        for p, codes, scales, lib in runs:
            stages = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
            scalars = {k: [v] * len(sizes) for k, v in hyper.items()}
            native.adamw_compressed(lib, p, grads, codes, scales, stages, scalars, fmt, 0.37, False, 2)
            staged.append(stages)
        (pv, cv, sv, _), (ps, cs, ss, _) = runs
        for i, n in enumerate(sizes):
            where = f"{mode} block {block} step {step} tensor {i} ({n})"
            assert torch.equal(pv[i].view(torch.int32), ps[i].view(torch.int32)), where
            assert torch.equal(staged[0][i].view(torch.int16), staged[1][i].view(torch.int16)), where
            for k in (0, 1):
                assert torch.equal(cv[k][i], cs[k][i]), (where, k)
                assert torch.equal(sv[k][i].view(torch.int32), ss[k][i].view(torch.int32)), (where, k)
    # the data really was hostile: some blocks saw infinite moments
    assert any(bool(torch.isinf(s).any()) for s in runs[0][2][0])

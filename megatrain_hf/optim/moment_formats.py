"""Compressed AdamW moments: the formats, their maps, and the torch reference of (de)quantization.

``optimizer_state`` picks how HostAdamW keeps ``exp_avg`` (m) and ``exp_avg_sq`` (v):

* ``"fp32"``: one fp32 flat each (8 B/param), the exact default.
* ``"bf16"``: one bf16 flat each (4 B/param), rounded to nearest even after every update.
* ``"8bit"``: blockwise dynamic quantization as bitsandbytes' blockwise 8-bit optimizers: blocks
  of 256 elements, one fp32 scale per block (the block's absmax), a 256-value map: the signed
  dynamic-tree map for m, the unsigned one for v (2 B/param + 2 x 4/256 B of scales).
* ``"4bit"``: as torchao's 4-bit AdamW (after "Memory Efficient Optimizers with 4-bit States"):
  blocks of 128, the signed 4-bit dynamic-tree map for m, a linear map without zero
  (1/16 ... 16/16) for v, so that no v rounds to zero; two codes per byte (1 B/param + scales).

A code is the index of the map value nearest to ``x / absmax``: the number of midpoints between
adjacent map values that are ``<=`` it (ties round up). Expanding is ``map[code] * absmax``. Two
exceptions keep one step of AdamW bounded where a block holds large and tiny moments (an embedding's
rows absent from the batch beside a frequent one; issue 33):

* a positive v never takes the value 0 (8-bit v: code 1, ``3.25e-7 * absmax``, where the nearest is
  0): a v rounded to 0 while m is not turned ``m / (sqrt(v) + eps)`` into ``m / eps``, ~400x lr;
* the m of an element whose gradient is 0 this step takes the nearest map value not larger in
  magnitude (one code back toward 0 where the nearest is larger), so that it shrinks every step and
  reaches 0, as exact AdamW's decays by beta1; rounded to nearest it could stay on a coarse level
  while v stayed too, and move the row by the same step for ever. Blocks
start at each tensor's first element (a block never spans two tensors), so a parameter without a
gradient keeps its codes. Both kernels (``csrc/host_adamw.cpp`` and :func:`expand` /
:func:`compress` here) do these operations in fp32 with the same IEEE ops: they agree bitwise.

Round-trip bound (m of an element without a gradient: up to a whole gap, twice it):
``|x - expand(compress(x))| <= absmax(block) * max_error(map)``, where
``max_error`` is half the largest gap between adjacent map values (for the map without zero, also
the distance from 0 to its smallest value): 8-bit m 0.0070, v 0.0035; 4-bit m 0.1125, v 0.0625
(:func:`error_bound`; ``tests/parity/test_quant_state.py`` checks it).

Each unit's state is a small set of contiguous named tensors (``exp_avg.codes``, ``exp_avg.scales``,
``exp_avg_sq.codes``, ``exp_avg_sq.scales``; bf16: ``exp_avg``, ``exp_avg_sq``), laid out like the
unit's master flat (codes at the entry's offset, halved for 4-bit; scales at a per-entry block
offset), so they are saved, loaded and paged as bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import MegatrainConfigError
from ..core.layout import MOMENT_FORMATS

MODES = tuple(MOMENT_FORMATS)
MOMENTS = ("exp_avg", "exp_avg_sq")


def dynamic_map(signed: bool, exponent_bits: int, total_bits: int) -> list[float]:
    """The dynamic-tree quantization map (Dettmers 2015; bitsandbytes' ``create_dynamic_map``).

    For each exponent ``10**-(exponent_bits-1) ... 10**0`` a linear fraction between 0.1 and 1
    (the midpoints of ``linspace(0.1, 1, k + 1)``), more fraction points for larger exponents;
    signed maps mirror them; plus 0 and 1. Exactly ``2**total_bits`` sorted values.
    """
    values: list[float] = []
    fraction_bits = total_bits - 1
    extra = 2 ** (fraction_bits - exponent_bits) - 1
    for i in range(exponent_bits):
        items = 2 ** (i + fraction_bits - exponent_bits) + 1 if signed else 2 ** (i + fraction_bits - exponent_bits + 1) + 1
        bounds = torch.linspace(0.1, 1, int(items))
        means = ((bounds[:-1] + bounds[1:]) / 2.0) * 10 ** (-(exponent_bits - 1) + i)
        values += means.tolist() + ((-means).tolist() if signed else [])
    if extra > 0:
        bounds = torch.linspace(0.1, 1, extra + 1)
        means = ((bounds[:-1] + bounds[1:]) / 2.0) * 10 ** (-(exponent_bits - 1) + exponent_bits - 1)
        values += means.tolist() + ((-means).tolist() if signed else [])
    values += [0.0, 1.0]
    if len(values) != 2**total_bits:
        raise AssertionError(f"dynamic map of {len(values)} values, expected {2 ** total_bits}")
    return sorted(values)


@dataclass(frozen=True)
class Format:
    """One compressed mode: its block size, bits per code and the maps of m and v."""

    mode: str
    bits: int  # 16 (bf16: no map), 8 or 4
    block: int  # elements per scale (0: no scales)
    maps: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())  # (m's, v's)

    @property
    def quantized(self) -> bool:
        return self.bits in (8, 4)

    def code_bytes(self, numel: int) -> int:
        """Bytes of one moment's codes for ``numel`` elements (bf16: 2 B each)."""
        return {16: 2 * numel, 8: numel, 4: (numel + 1) // 2}[self.bits]

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block) if self.quantized else 0

    def bytes_per_param(self) -> float:
        """Host bytes of both moments per trainable element (the planner's number), scales included."""
        if self.mode == "fp32":
            return 8.0
        per = self.code_bytes(2) / 2
        return 2 * (per + (4 / self.block if self.quantized else 0.0))

    def table(self, k: int) -> torch.Tensor:
        return torch.tensor(self.maps[k], dtype=torch.float32)

    def floor_code(self, k: int) -> int:
        """The lowest code a positive value of moment ``k`` may take: 1 where the map's lowest value
        is 0 and ``k`` is v (a positive v never expands to 0), else 0 (no floor)."""
        return 1 if k == 1 and self.quantized and self.maps[1][0] == 0.0 else 0

    def midpoints(self, k: int) -> torch.Tensor:
        q = self.table(k)
        return (q[:-1] + q[1:]) / 2  # fp32, the same numbers the native kernel receives


@functools.lru_cache(maxsize=None)
def format_of(mode: str) -> Format:
    if not isinstance(mode, str) or mode not in MOMENT_FORMATS:
        raise unknown_state(mode)
    bits, block = MOMENT_FORMATS[mode]  # fp32 32/0, bf16 16/0, 8bit 8/256, 4bit 4/128
    if mode == "8bit":
        return Format(mode, bits, block, (tuple(dynamic_map(True, 7, 8)), tuple(dynamic_map(False, 7, 8))))
    if mode == "4bit":
        linear = tuple(float(i) / 16 for i in range(1, 17))  # no zero: a v never expands to 0
        return Format(mode, bits, block, (tuple(dynamic_map(True, 3, 4)), linear))
    return Format(mode, bits, block)


def unknown_state(value, where: str = "optimizer_state") -> MegatrainConfigError:
    return MegatrainConfigError(
        f"{where}={value!r} is not a known optimizer state format; allowed: {list(MODES)}. Fix: pass "
        "'fp32' (exact, 8 B/param), 'bf16' (4 B/param), '8bit' (~2.03 B/param) or '4bit' (~1.06 B/param)."
    )


def error_bound(mode: str, k: int) -> float:
    """Largest ``|x - expand(compress(x))| / absmax(block)`` of moment ``k`` (0: m, 1: v)."""
    q = format_of(mode).table(k).double()
    low = -1.0 if float(q.min()) < 0 else 0.0  # normalized values lie in [-1, 1] (signed) or [0, 1]
    # half the largest gap, or the distance from an end of the range to the nearest map value (the
    # signed maps stop short of -1; the map without zero starts above 0)
    return max(float(((q[1:] - q[:-1]) / 2).max()), float(q.min()) - low, 1.0 - float(q.max()))


# ---------------------------------------------------------------------------------- torch reference
def _unpack(codes: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes[:numel].long()
    pairs = torch.stack((codes & 0x0F, codes >> 4), dim=1).reshape(-1)  # element 2i: low nibble
    return pairs[:numel].long()


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    if codes.numel() % 2:
        codes = torch.cat((codes, codes.new_zeros(1)))
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def expand(fmt: Format, k: int, codes: torch.Tensor, scales: torch.Tensor | None, numel: int) -> torch.Tensor:
    """One tensor's moment ``k`` as fp32 (``codes``: its slice of the codes flat)."""
    if fmt.bits == 16:
        return codes[:numel].float()
    values = fmt.table(k)[_unpack(codes, numel, fmt.bits)]
    return values * scales.repeat_interleave(fmt.block)[:numel]


def compress(fmt: Format, k: int, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None,
             toward_zero: torch.Tensor | None = None) -> None:
    """Write fp32 ``x`` (one tensor, 1-D) into its codes (and scales) slice, in place.

    The code is the nearest map value's, with two exceptions (the rules of :func:`floor_code` and
    ``toward_zero``, see the module's docstring): a positive v never takes a zero level, and where
    ``toward_zero`` (a bool mask, m only: the elements without a gradient this step) is set, m takes
    the nearest map value not larger in magnitude.
    """
    if fmt.bits == 16:
        codes.copy_(x)  # round to nearest even
        return
    numel, block = x.numel(), fmt.block
    padded = torch.zeros(fmt.blocks(numel) * block, dtype=torch.float32)
    padded[:numel] = x
    absmax = padded.view(-1, block).abs().amax(dim=1)
    scales.copy_(absmax)
    per = absmax.repeat_interleave(block)[:numel]
    normed = torch.where(per > 0, x / torch.where(per > 0, per, 1.0), 0.0)
    found = torch.bucketize(normed, fmt.midpoints(k), right=True)  # count of midpoints <= x
    floor = fmt.floor_code(k)
    if floor:
        found = torch.where((x > 0) & (found < floor), floor, found)
    if toward_zero is not None:
        value = fmt.table(k)[found]
        away = toward_zero & (value.abs() > normed.abs())  # rounded away from zero: one code back
        found = torch.where(away, found - torch.sign(value).long(), found)
    codes.copy_(_pack(found, fmt.bits))


__all__ = ["MODES", "MOMENTS", "Format", "format_of", "dynamic_map", "error_bound", "expand", "compress"]

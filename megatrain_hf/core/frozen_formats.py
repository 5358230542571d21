"""Quantized frozen weights: bitsandbytes' NF4 and LLM.int8 schemes, stored as bytes in a host flat.

A quantized tensor is one byte range of its unit's ``uint8`` frozen flat (:class:`QuantFormat`
says where each piece lies); it crosses the link as bytes and is dequantized on the device right
before the unit computes (``Streamer.fetch``). The schemes are bitsandbytes' (its
``functional.py`` and the ops of its CPU/default backends), so that the dequantized weights are
bit for bit what bitsandbytes computes from the same stored state:

* ``nf4``: blocks of 64 elements (row-major over the tensor), each scaled by its absmax and
  rounded to the nearest of the 16 NF4 values (two codes per byte, the first in the high nibble);
  the absmaxes are double-quantized: their mean (the *offset*) is subtracted and the rest stored
  as 8-bit codes of the dynamic map in blocks of 256, each with an fp32 absmax. Dequantized:
  ``absmax = dynamic[q] * absmax2 + offset`` then ``w = NF4[code] * absmax``, in fp32, then rounded
  to the compute dtype. 0.5 + 1/64 + 4/16384 bytes per parameter.
* ``int8``: LLM.int8's row-wise absmax (``Int8Params``: ``CB`` int8, ``SCB`` fp32 per row):
  ``CB = round(w * (127 / SCB))``, dequantized ``CB * SCB * (1/127)`` in fp32 (bitsandbytes'
  ``int8_vectorwise_dequant``). 1 + 4/columns bytes per parameter.

Quantizing reads its input chunk by chunk (:func:`quantize_into`): a tensor is never needed whole
in fp32, only ``CHUNK_ELEMENTS`` of it at a time (plus, for NF4, the tensor's fp32 absmaxes:
1/64 of its elements). Torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import MegatrainConfigError

SCHEMES = ("int8", "nf4")
BLOCK = 64  # NF4 elements per absmax (bitsandbytes' default blocksize)
BLOCK2 = 256  # absmaxes per second-level absmax (bitsandbytes' nested blocksize)
PIECE_ALIGN = 16  # bytes: every piece of a quantized tensor starts on this boundary
CHUNK_ELEMENTS = 1 << 20
"""Elements of the input quantized at a time, on the host: bounds the fp32 temporaries of loading
(4 MiB of fp32 values each, about six of them)."""
DEQUANT_CHUNK_ELEMENTS = 1 << 24
"""Elements dequantized at a time, on the device: bounds its temporaries (int32 codes, their fp32
values and products: ``DEQUANT_TEMP_BYTES`` per element) to 192 MiB while keeping the kernels few."""
DEQUANT_TEMP_BYTES = 12
INT8_SCALE = 7.874015718698502e-3  # bitsandbytes' 1/127 in int8_vectorwise_dequant

NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)
"""bitsandbytes' NF4 table (``get_4bit_type("nf4")``): quantiles of N(0, 1), as fp32."""


def dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map(signed=True)``), 256 fp32 values."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional > 0:
        bounds = torch.linspace(0.1, 1, additional + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def table(name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The NF4 (``"nf4"``) or dynamic (``"dynamic"``) code table on ``device`` (cached)."""
    key = (name, torch.device(device))
    found = _TABLES.get(key)
    if found is None:
        found = torch.tensor(NF4_CODE, dtype=torch.float32) if name == "nf4" else dynamic_map()
        found = _TABLES[key] = found.to(device)
    return found


def _up(n: int) -> int:
    return (n + PIECE_ALIGN - 1) // PIECE_ALIGN * PIECE_ALIGN


@dataclass(frozen=True)
class QuantFormat:
    """Where the pieces of one quantized tensor lie in its byte range (offsets in bytes)."""

    scheme: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # what it dequantizes to (the compute dtype)
    codes: int = 0  # nf4: packed codes (numel / 2 bytes); int8: CB (numel bytes)
    scales: int = 0  # nf4: 8-bit absmax codes (numel / 64 bytes); int8: SCB (rows fp32)
    scales2: int = 0  # nf4: fp32 absmax per 256 absmaxes, then the fp32 offset
    nbytes: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def blocks(self) -> int:
        return self.numel // BLOCK

    @property
    def blocks2(self) -> int:
        return -(-self.blocks // BLOCK2)

    @property
    def rows(self) -> int:
        return self.shape[0]


def quant_format(scheme: str, shape: tuple[int, ...], dtype: torch.dtype) -> QuantFormat | None:
    """The layout of a ``shape`` tensor quantized with ``scheme``; None if the scheme cannot take it
    (not a matrix, or for NF4 a size that is not a multiple of the block)."""
    if scheme not in SCHEMES:
        raise MegatrainConfigError(f"quantization scheme {scheme!r}; allowed: {SCHEMES}")
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or 0 in shape:
        return None
    numel = shape[0] * shape[1]
    if scheme == "int8":
        scales = _up(numel)
        return QuantFormat(scheme, shape, dtype, 0, scales, 0, scales + _up(4 * shape[0]))
    if numel % BLOCK:
        return None
    scales = _up(numel // 2)
    scales2 = scales + _up(numel // BLOCK)
    blocks2 = -(-(numel // BLOCK) // BLOCK2)
    return QuantFormat(scheme, shape, dtype, 0, scales, scales2, scales2 + _up(4 * (blocks2 + 1)))


def _pieces(fmt: QuantFormat, raw: torch.Tensor):
    """Typed views of the pieces of ``raw`` (the tensor's uint8 byte range)."""
    if fmt.scheme == "int8":
        cb = raw[: fmt.numel].view(torch.int8)
        scb = raw[fmt.scales : fmt.scales + 4 * fmt.rows].view(torch.float32)
        return cb, scb
    packed = raw[: fmt.numel // 2]
    qabsmax = raw[fmt.scales : fmt.scales + fmt.blocks]
    stats = raw[fmt.scales2 : fmt.scales2 + 4 * (fmt.blocks2 + 1)].view(torch.float32)
    return packed, qabsmax, stats[: fmt.blocks2], stats[fmt.blocks2 :]


# ---------------------------------------------------------------------------------- quantize
def _blockwise(x: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(absmax per block, values scaled into [-1, 1]) of fp32 ``x``, the last block possibly partial
    (bitsandbytes' default ``quantize_blockwise`` / ``quantize_4bit``)."""
    n = x.numel()
    full = n - n % blocksize
    whole = x[:full].view(-1, blocksize)
    absmax = whole.abs().max(dim=-1)[0]
    scaled = torch.clamp(whole * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if full < n:
        am = x[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, am.view(1)])
        scaled = torch.cat([scaled, torch.clamp(x[full:] / am, -1, 1)])
    return absmax, scaled


def _nearest(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest code value (``code`` sorted), as bitsandbytes' bucketize on midpoints."""
    return torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)


class QuantWork:
    """The buffers one quantization chunk computes in, reused from tensor to tensor (fresh
    temporaries per chunk would let the C heap grow past them: glibc's dynamic mmap threshold
    keeps freed blocks of this size in the heap, fragmented between the store's flats)."""

    def __init__(self, elements: int | None = None) -> None:
        n = elements or CHUNK_ELEMENTS
        self.x = torch.empty(n, dtype=torch.float32)  # the chunk read
        self.a = torch.empty(n, dtype=torch.float32)
        self.b = torch.empty(n, dtype=torch.float32)
        self.half = torch.empty(n, dtype=torch.float16)
        self.idx = torch.empty(n, dtype=torch.int32)
        self.q = torch.empty(n, dtype=torch.uint8)

    @staticmethod
    def nbytes(elements: int | None = None) -> int:
        """Host bytes of the buffers (19 MiB for the default chunk)."""
        return (elements or CHUNK_ELEMENTS) * (3 * 4 + 2 + 4 + 1)


def quantize_into(fmt: QuantFormat, read: Callable[[int, int, torch.Tensor], None], raw: torch.Tensor,
                  work: QuantWork | None = None) -> None:
    """Quantize a tensor into ``raw`` (its uint8 byte range), reading it chunk by chunk:
    ``read(first, n, dest)`` fills the fp32 ``dest`` with elements ``[first, first + n)`` of the
    tensor in row-major order. ``work``: the chunk buffers (reuse one across tensors)."""
    rows, cols = fmt.shape
    work = work if work is not None and work.x.numel() >= CHUNK_ELEMENTS else QuantWork()
    size = work.x.numel()
    per = max(1, size // cols) * cols if fmt.scheme == "int8" else size // BLOCK * BLOCK
    if per > size:  # an int8 row longer than a chunk: a workspace of one row
        work, per = QuantWork(cols), cols
    pieces = _pieces(fmt, raw)
    absmax_all = torch.empty(fmt.blocks if fmt.scheme == "nf4" else 0, dtype=torch.float32)
    nf4 = table("nf4")
    bounds = (nf4[:-1] + nf4[1:]) / 2
    for first in range(0, fmt.numel, per):
        n = min(per, fmt.numel - first)
        x, a, b, idx, q = work.x[:n], work.a[:n], work.b[:n], work.idx[:n], work.q[:n]
        read(first, n, x)
        if fmt.scheme == "int8":  # bnb: round(A * (127 / absmax_row)), A the fp16 weight (Int8Params)
            cb, scb = pieces
            r0, r1 = first // cols, (first + n) // cols
            half = work.half[:n]
            half.copy_(x)
            a.copy_(half)
            torch.abs(a, out=b)
            stats = b.view(r1 - r0, cols).amax(dim=1)
            scb[r0:r1] = stats
            torch.mul(a.view(r1 - r0, cols), (127.0 / stats).unsqueeze(-1), out=b.view(r1 - r0, cols))
            torch.round(b, out=b)
            b.nan_to_num_(0.0)  # an all-zero row: zeros
            cb[first : first + n].copy_(b)
            continue
        torch.abs(x, out=a)  # bnb: clamp(A * (1 / absmax_block), -1, 1), then the nearest NF4 value
        absmax = a.view(-1, BLOCK).amax(dim=1)
        absmax_all[first // BLOCK : (first + n) // BLOCK] = absmax
        torch.mul(x.view(-1, BLOCK), (1.0 / absmax.clamp(min=1e-38)).view(-1, 1), out=a.view(-1, BLOCK))
        a.clamp_(-1, 1)
        torch.bucketize(a, bounds, out_int32=True, out=idx)
        q.copy_(idx)
        packed = pieces[0][first // 2 : (first + n) // 2]
        torch.bitwise_left_shift(q[::2], 4, out=packed)
        packed.bitwise_or_(q[1::2])
    if fmt.scheme == "nf4":  # double quantization of the absmaxes (bitsandbytes' compress_statistics)
        _, qabsmax, absmax2, offset = pieces
        mean = absmax_all.mean()
        absmax2_values, scaled = _blockwise(absmax_all - mean, BLOCK2)
        qabsmax.copy_(_nearest(scaled, table("dynamic")))
        absmax2.copy_(absmax2_values)
        offset.copy_(mean.view(1))


def quantize_tensor(fmt: QuantFormat, tensor: torch.Tensor, raw: torch.Tensor, work: QuantWork | None = None) -> None:
    """:func:`quantize_into` from a tensor in memory (any float dtype, any device's copy is read to the CPU)."""
    flat = tensor.detach().reshape(-1)
    quantize_into(fmt, lambda first, n, dest: dest.copy_(flat[first : first + n]), raw, work)


# ---------------------------------------------------------------------------------- dequantize
def dequantize_into(fmt: QuantFormat, raw: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Dequantize the byte range ``raw`` into ``out`` (``fmt.numel`` elements of any float dtype, on
    ``raw``'s device), chunk by chunk: each chunk in fp32 as bitsandbytes computes it, then rounded
    to ``out``'s dtype. Returns ``out`` viewed in ``fmt.shape``."""
    flat = out.view(-1)
    rows, cols = fmt.shape
    if fmt.scheme == "int8":
        cb, scb = _pieces(fmt, raw)
        step = max(1, DEQUANT_CHUNK_ELEMENTS // cols)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            block = cb[r0 * cols : r1 * cols].view(r1 - r0, cols)
            flat[r0 * cols : r1 * cols].view(r1 - r0, cols).copy_(block * scb[r0:r1].view(-1, 1) * INT8_SCALE)
        return out.view(fmt.shape)
    packed, qabsmax, absmax2, offset = _pieces(fmt, raw)
    absmax = table("dynamic", raw.device)[qabsmax.to(torch.int32)]
    expanded = absmax2.repeat_interleave(BLOCK2)[: fmt.blocks]
    absmax = absmax * expanded  # two separate fp32 operations, as bitsandbytes (never a fused FMA)
    absmax += offset
    nf4 = table("nf4", raw.device)
    per = max(BLOCK, DEQUANT_CHUNK_ELEMENTS // BLOCK * BLOCK)
    for first in range(0, fmt.numel, per):
        n = min(per, fmt.numel - first)
        byte = packed[first // 2 : (first + n) // 2]
        idx = torch.empty(n, dtype=torch.int32, device=raw.device)
        idx[::2] = byte >> 4
        idx[1::2] = byte & 0xF
        values = nf4[idx].view(-1, BLOCK) * absmax[first // BLOCK : (first + n) // BLOCK].view(-1, 1)
        flat[first : first + n].copy_(values.view(-1))
    return out.view(fmt.shape)


def dequantize(fmt: QuantFormat, raw: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``fmt.shape`` and ``fmt.dtype``: :func:`dequantize_into`."""
    return dequantize_into(fmt, raw, torch.empty(fmt.numel, dtype=fmt.dtype, device=raw.device))


def bytes_per_param(scheme: str, cols: int = 8192) -> float:
    """Stored bytes per parameter of a matrix with ``cols`` columns (the planner's rate)."""
    if scheme == "int8":
        return 1 + 4 / cols
    return 0.5 + 1 / BLOCK + 4 / (BLOCK * BLOCK2)

"""The safetensors shards of a ``save_pretrained`` folder, read tensor by tensor into given memory.

A tensor is read with ``readinto`` straight into its destination (a slice of a host flat) when the
file holds it in the destination's dtype, else through one bounded bounce buffer
(:data:`CHUNK_BYTES`) whose chunks are cast into place. Nothing is memory-mapped: the file pages
``safe_open`` maps count into the process's resident memory until the file is closed (a whole
shard, up to the 50 GB that ``save_pretrained`` writes into one file by default), and loading
must cost the host plan and no more. The format is the one of the safetensors specification: an
8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte
range, then the bytes (little-endian, C order).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from ..errors import CheckpointError

CHUNK_BYTES = 16 << 20
"""Bytes of the bounce buffer a tensor stored in another dtype than its destination is cast through."""

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER_BYTES = 100 << 20  # the safetensors reference implementation's own limit

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Stored:
    """Where one tensor lies in a shard: its file, dtype, shape and absolute byte range."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str) -> dict[str, Stored]:
    """The tensors of one ``.safetensors`` file, validated against the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path} is not a safetensors file (header length {n}, file {size} bytes)")
        header = json.loads(f.read(n))
    base, out = 8 + n, {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {key!r} has dtype {info.get('dtype')!r}; readable: {sorted(DTYPES)}")
        begin, end = info["data_offsets"]
        stored = Stored(path, dtype, tuple(info["shape"]), base + begin, base + end)
        if end - begin != stored.numel * dtype.itemsize or stored.end > size:
            raise CheckpointError(f"{path}: tensor {key!r} has {end - begin} bytes for shape {stored.shape} of "
                                  f"{info['dtype']}, or lies past the end of the file (truncated?)")
        out[key] = stored
    return out


def index_folder(folder: str) -> dict[str, Stored]:
    """Every tensor of a ``save_pretrained`` folder: its ``model.safetensors.index.json`` shards, or
    its ``model.safetensors``."""
    index = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, SINGLE_NAME)):
        files = [SINGLE_NAME]
    else:
        found = sorted(n for n in os.listdir(folder)) if os.path.isdir(folder) else []
        raise CheckpointError(
            f"{folder} holds neither {INDEX_NAME} nor {SINGLE_NAME} (found: {found[:10]}). Pass the folder "
            "model.save_pretrained(...) wrote (safetensors; pytorch_model.bin pickles are not read)."
        )
    tensors: dict[str, Stored] = {}
    for name in files:
        tensors.update(read_header(os.path.join(folder, name)))
    return tensors


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class ShardReader:
    """Reads stored tensors into destination tensors; files stay open until :meth:`close`."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._files: dict[str, object] = {}
        self._bounce: torch.Tensor | None = None
        self.bytes_read = 0

    def _file(self, path: str):
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open(path, "rb", buffering=0)
        return f

    def _read(self, path: str, offset: int, view: memoryview) -> None:
        f = self._file(path)
        f.seek(offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise CheckpointError(f"{path} ended at byte {offset + done}: the file is truncated")
            done += n
        self.bytes_read += done

    def read_into(self, stored: Stored, dest: torch.Tensor) -> None:
        """Fill ``dest`` (a contiguous CPU tensor of ``stored.numel`` elements) with the stored tensor,
        cast to ``dest.dtype``."""
        if dest.numel() != stored.numel or dest.device.type != "cpu" or not dest.is_contiguous():
            raise ValueError(f"destination of {tuple(dest.shape)} on {dest.device} for a tensor of {stored.shape}")
        if dest.dtype == stored.dtype:
            self._read(stored.path, stored.start, bytes_of(dest))
            return
        itemsize = stored.dtype.itemsize
        per_chunk = max(1, self.chunk_bytes // itemsize)
        if self._bounce is None or self._bounce.numel() < self.chunk_bytes:
            self._bounce = torch.empty(self.chunk_bytes, dtype=torch.uint8)
        flat = dest.reshape(-1)
        for first in range(0, stored.numel, per_chunk):
            n = min(per_chunk, stored.numel - first)
            chunk = self._bounce[: n * itemsize]
            self._read(stored.path, stored.start + first * itemsize, memoryview(chunk.numpy()))
            flat[first : first + n].copy_(chunk.view(stored.dtype))

    def close(self) -> None:
        while self._files:
            self._files.popitem()[1].close()
        self._bounce = None

"""Checkpoints: HostAdamW's state as one safetensors file per unit, written atomically.

Layout inside a Trainer checkpoint folder (``checkpoint-N/``)::

    megatrain_optimizer/unit-00000.safetensors   exp_avg, exp_avg_sq: the unit's fp32 flats
    megatrain_optimizer/unit-00001.safetensors   ...

With compressed moments (``optimizer_state`` "bf16" / "8bit" / "4bit") a file holds the unit's
compressed tensors instead, by their names (``exp_avg.codes``, ``exp_avg.scales``, ...; bf16:
``exp_avg``, ``exp_avg_sq`` in bf16), and the metadata names the format (``optimizer_state``).

Each file's safetensors metadata (JSON strings) holds the format tag, the unit's index and name,
the number of units, the flat's length, for each param group the Adam step count and the
parameters' positions (torch's state-dict index, offset in the flat, shape), and the hyper-
parameters of every param group. Files are written straight from the host flats, unit by unit
(no second copy of the whole state in RAM), each to a temporary name that is fsync'ed and then
``os.replace``-d. Loading validates every header first, then copies unit by unit into the flats
in place. Nothing here unpickles: the format is tensors plus JSON.

:func:`to_torch_state_dict` turns such a folder into ``torch.optim.AdamW``'s ``state_dict``
layout (a full copy in RAM, compressed moments expanded to fp32), for tools that expect
``optimizer.pt``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import torch

from ..errors import CheckpointError
from .compressed import tensor_names
from .moment_formats import expand, format_of

FORMAT = "megatrain-hostadamw-v1"
OPTIMIZER_DIR = "megatrain_optimizer"


def unit_file(folder: str, u: int) -> str:
    return os.path.join(folder, f"unit-{u:05d}.safetensors")


def has_sharded_optimizer(checkpoint: str) -> bool:
    return os.path.isdir(os.path.join(checkpoint, OPTIMIZER_DIR))


# ---------------------------------------------------------------------------------- atomic files
def fsync_path(path: str) -> None:
    """fsync a file or a directory (directories: where the OS allows it)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` to a temporary name in the same folder, fsync it, then rename it to ``path``.

    A process killed at any moment leaves either the old ``path`` (or none) or the complete new
    one, never a partial file under the final name.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


def fsync_tree(root: str) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


# ---------------------------------------------------------------------------------- JSON of hyper-parameters
def _encode(value):
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.detach().cpu().tolist(), "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"HostAdamW param group value {value!r} ({type(value).__name__}) cannot be saved in the sharded "
        "optimizer checkpoint (JSON metadata); param groups may hold numbers, strings, tuples, lists, "
        "dicts and tensors."
    )


def _decode(value):
    if isinstance(value, dict):
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _hyper(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(param) -> its index in ``optimizer.state_dict()`` (numbered across groups, in order)."""
    out, i = {}, 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            out.setdefault(id(p), i)
            i += 1
    return out


def _layout(optimizer, u: int) -> dict[str, list]:
    """{group index: [[state index, offset, shape], ...]} of unit ``u`` (as JSON keys: strings)."""
    index = _indices(optimizer)
    return {
        str(gi): [[index[id(e.tensor)], e.offset, list(e.shape)] for e in entries]
        for gi, entries in optimizer.groups_of(u).items()
    }


# ---------------------------------------------------------------------------------- save / load
def save_optimizer(optimizer, folder: str) -> None:
    """Write ``optimizer``'s (a HostAdamW) state into ``folder``, one safetensors file per unit.

    Under data parallelism each rank writes the files of the units it owns (every file names all
    units), so the folder is complete once every rank wrote, and loads on any number of ranks."""
    optimizer.synchronize()
    os.makedirs(folder, exist_ok=True)
    hyper = json.dumps(_encode(_hyper(optimizer)))
    units = list(optimizer.all_units)
    for u in optimizer.units:
        with optimizer.unit_state(u) as tensors:  # paged in from the disk tier when it is there
            _save_unit(optimizer, folder, u, units, hyper, dict(tensors))
    fsync_path(folder)


def _save_unit(optimizer, folder: str, u: int, units: list[int], hyper: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    metadata = {
        "format": FORMAT,
        "optimizer_state": optimizer.format.mode,
        "unit": str(u),
        "unit_name": optimizer.store.names[u],
        "units": json.dumps(units),
        "numel": str(optimizer.store.n_train(u)),
        "steps": json.dumps(
            {str(gi): [float(step) for step in optimizer.step_counters(u, gi)] for gi in optimizer.groups_of(u)}
        ),
        "layout": json.dumps(_layout(optimizer, u)),
        "param_groups": hyper,
    }
    atomic_write(unit_file(folder, u), lambda tmp: save_file(tensors, tmp, metadata=metadata))


def _read_headers(folder: str, expected_units: list[int] | None) -> dict[int, dict]:
    from safetensors import safe_open

    headers: dict[int, dict] = {}
    if expected_units is not None:
        first = unit_file(folder, expected_units[0])
    else:  # the first unit with trainable parameters (under PEFT, not unit 0)
        names = sorted(n for n in os.listdir(folder) if n.startswith("unit-") and n.endswith(".safetensors"))
        first = os.path.join(folder, names[0] if names else os.path.basename(unit_file(folder, 0)))
    if not os.path.isfile(first):
        raise CheckpointError(f"sharded optimizer checkpoint {folder} lacks {os.path.basename(first)}")
    with safe_open(first, framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{first} is not a megatrain optimizer shard (format {meta.get('format')!r}, expected {FORMAT!r})"
        )
    units = json.loads(meta["units"])
    if expected_units is not None and units != expected_units:
        raise CheckpointError(
            f"the sharded optimizer checkpoint {folder} holds state for units {units}, this model's HostAdamW "
            f"has units {expected_units}: the checkpoint belongs to another model or another set of "
            "trainable parameters."
        )
    for u in units:
        path = unit_file(folder, u)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"sharded optimizer checkpoint {folder} is incomplete: {os.path.basename(path)} is missing"
            )
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != FORMAT or meta.get("unit") != str(u):
            raise CheckpointError(f"{path} is not the megatrain optimizer shard of unit {u}")
        headers[u] = meta
    return headers


def load_optimizer(optimizer, folder: str) -> None:
    """Load a folder written by :func:`save_optimizer` into ``optimizer`` (a HostAdamW), in place
    (under data parallelism: the units this rank owns, whatever the world size that wrote it)."""
    from safetensors import safe_open

    optimizer.synchronize()
    units = list(optimizer.all_units)
    headers = {u: meta for u, meta in _read_headers(folder, units).items() if u in optimizer.units}
    mode = optimizer.format.mode
    for u, meta in headers.items():  # validate everything before changing anything
        saved_mode = meta.get("optimizer_state", "fp32")
        if saved_mode != mode:
            raise CheckpointError(
                f"{unit_file(folder, u)} holds optimizer_state={saved_mode!r} moments, this HostAdamW keeps "
                f"{mode!r}. Fix: resume with optimizer_state={saved_mode!r} (or convert the checkpoint with "
                "megatrain_hf.optim.state_files.to_torch_state_dict and load that into a fresh optimizer)."
            )
        numel = optimizer.store.n_train(u)
        if int(meta["numel"]) != numel or json.loads(meta["layout"]) != _layout(optimizer, u):
            raise CheckpointError(
                f"{unit_file(folder, u)} (unit {meta.get('unit_name')}) has another parameter layout than "
                f"unit {optimizer.store.names[u]} of this model ({meta['numel']} vs {numel} elements, or other "
                "shapes/groups): the checkpoint belongs to another model or another set of trainable parameters."
            )
    first = json.loads(next(iter(headers.values()))["param_groups"]) if headers else None
    saved_groups = _decode(first) if first is not None else [
        {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the sharded optimizer checkpoint {folder} has {len(saved_groups)} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    for u, meta in headers.items():
        with safe_open(unit_file(folder, u), framework="pt") as f, optimizer.unit_state(u, write=True) as tensors:
            for name, tensor in tensors.items():  # exp_avg / exp_avg_sq, or the compressed codes and scales
                tensor.copy_(f.get_tensor(name))
        for gi, saved in json.loads(meta["steps"]).items():
            counters = optimizer.step_counters(u, int(gi))
            saved = saved if isinstance(saved, list) else [saved] * len(counters)  # one value per group
            for counter, value in zip(counters, saved):
                counter.fill_(value)
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update(saved)  # as torch's load_state_dict: the saved hyper-parameters (lr, betas, ...)


def to_torch_state_dict(folder: str) -> dict:
    """A ``torch.optim.AdamW`` state dict (the layout of ``optimizer.pt``) from a sharded folder.

    Builds a full copy in RAM; meant for export (``torch.save(to_torch_state_dict(d), "optimizer.pt")``
    lets a plain Trainer resume from a megatrain checkpoint).
    """
    from safetensors import safe_open

    headers = _read_headers(folder, None)
    groups = _decode(json.loads(next(iter(headers.values()))["param_groups"]))
    members: list[list[int]] = [[] for _ in groups]
    state: dict[int, dict] = {}
    for u, meta in headers.items():
        steps = json.loads(meta["steps"])
        fmt = format_of(meta.get("optimizer_state", "fp32"))
        names = ["exp_avg", "exp_avg_sq"] if fmt.mode == "fp32" else tensor_names(fmt)
        with safe_open(unit_file(folder, u), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in names}
        layout = json.loads(meta["layout"])
        blocks = _block_offsets(fmt, [p for params in layout.values() for p in params])
        for gi, params in layout.items():
            group_steps = steps[gi] if isinstance(steps[gi], list) else [steps[gi]] * len(params)
            for (index, offset, shape), step in zip(params, group_steps):
                members[int(gi)].append(index)
                state[index] = {"step": torch.tensor(step, dtype=torch.float32)}
                for k, key in enumerate(("exp_avg", "exp_avg_sq")):
                    state[index][key] = _expanded(fmt, k, key, tensors, offset, blocks[offset], shape)
    param_groups = [dict(g, params=sorted(m)) for g, m in zip(groups, members)]
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def _numel(shape: list[int]) -> int:
    return math.prod(shape)


def _block_offsets(fmt, params: list[list]) -> dict[int, int]:
    """offset -> first scale of that tensor: blocks numbered per tensor in offset order (compressed.py)."""
    out, n = {}, 0
    for _, offset, shape in sorted(params, key=lambda p: p[1]):
        if offset not in out:
            out[offset] = n
            n += fmt.blocks(_numel(shape))
    return out


def _expanded(fmt, k: int, key: str, tensors: dict, offset: int, block: int, shape: list[int]) -> torch.Tensor:
    """One tensor's moment ``key`` as a new fp32 tensor of ``shape``."""
    numel = _numel(shape)
    if fmt.mode == "fp32":
        return tensors[key][offset : offset + numel].clone().view(shape)
    if not fmt.quantized:
        return tensors[key][offset : offset + numel].float().view(shape)
    start = offset if fmt.bits == 8 else offset // 2
    codes = tensors[f"{key}.codes"][start : start + fmt.code_bytes(numel)]
    scales = tensors[f"{key}.scales"][block : block + fmt.blocks(numel)]
    return expand(fmt, k, codes, scales, numel).view(shape)

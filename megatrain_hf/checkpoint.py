"""Checkpoints: HostAdamW's state as one safetensors file per unit, written atomically.

Layout inside a Trainer checkpoint folder (``checkpoint-N/``)::

    megatrain_optimizer/unit-00000.safetensors   exp_avg, exp_avg_sq: the unit's fp32 flats
    megatrain_optimizer/unit-00001.safetensors   ...

Each file's safetensors metadata (JSON strings) holds the format tag, the unit's index and name,
the number of units, the flat's length, for each param group the Adam step count and the
parameters' positions (torch's state-dict index, offset in the flat, shape), and the hyper-
parameters of every param group. Files are written straight from the host flats, unit by unit
(no second copy of the whole state in RAM), each to a temporary name that is fsync'ed and then
``os.replace``-d. Loading validates every header first, then copies unit by unit into the flats
in place. Nothing here unpickles: the format is tensors plus JSON.

:func:`to_torch_state_dict` turns such a folder into ``torch.optim.AdamW``'s ``state_dict``
layout (a full copy in RAM), for tools that expect ``optimizer.pt``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

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
        for gi, entries in optimizer._plan[u].items()
    }


# ---------------------------------------------------------------------------------- save / load
def save_optimizer(optimizer, folder: str) -> None:
    """Write ``optimizer``'s (a HostAdamW) state into ``folder``, one safetensors file per unit.

    Under data parallelism each rank writes the files of the units it owns (every file names all
    units), so the folder is complete once every rank wrote, and loads on any number of ranks."""
    from safetensors.torch import save_file

    optimizer.synchronize()
    os.makedirs(folder, exist_ok=True)
    hyper = json.dumps(_encode(_hyper(optimizer)))
    units = list(optimizer.all_units)
    for u in optimizer._plan:
        exp_avg, exp_avg_sq = optimizer._exp_avg[u], optimizer._exp_avg_sq[u]
        metadata = {
            "format": FORMAT,
            "unit": str(u),
            "unit_name": optimizer.store.names[u],
            "units": json.dumps(units),
            "numel": str(exp_avg.numel()),
            "steps": json.dumps(
                {str(gi): [float(step) for step in optimizer._steps[(u, gi)]] for gi in optimizer._plan[u]}
            ),
            "layout": json.dumps(_layout(optimizer, u)),
            "param_groups": hyper,
        }
        tensors = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        atomic_write(unit_file(folder, u), lambda tmp, t=tensors, m=metadata: save_file(t, tmp, metadata=m))
    fsync_path(folder)


def _read_headers(folder: str, expected_units: list[int] | None) -> dict[int, dict]:
    from safetensors import safe_open

    headers: dict[int, dict] = {}
    if expected_units is not None:
        first = unit_file(folder, expected_units[0])
    else:  # the first unit with trainable parameters (under PEFT, not unit 0)
        names = sorted(n for n in os.listdir(folder) if n.startswith("unit-") and n.endswith(".safetensors"))
        first = os.path.join(folder, names[0] if names else os.path.basename(unit_file(folder, 0)))
    if not os.path.isfile(first):
        raise ValueError(f"sharded optimizer checkpoint {folder} lacks {os.path.basename(first)}")
    with safe_open(first, framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{first} is not a megatrain optimizer shard (format {meta.get('format')!r}, expected {FORMAT!r})"
        )
    units = json.loads(meta["units"])
    if expected_units is not None and units != expected_units:
        raise ValueError(
            f"the sharded optimizer checkpoint {folder} holds state for units {units}, this model's HostAdamW "
            f"has units {expected_units}: the checkpoint belongs to another model or another set of "
            "trainable parameters."
        )
    for u in units:
        path = unit_file(folder, u)
        if not os.path.isfile(path):
            raise ValueError(
                f"sharded optimizer checkpoint {folder} is incomplete: {os.path.basename(path)} is missing"
            )
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != FORMAT or meta.get("unit") != str(u):
            raise ValueError(f"{path} is not the megatrain optimizer shard of unit {u}")
        headers[u] = meta
    return headers


def load_optimizer(optimizer, folder: str) -> None:
    """Load a folder written by :func:`save_optimizer` into ``optimizer`` (a HostAdamW), in place
    (under data parallelism: the units this rank owns, whatever the world size that wrote it)."""
    from safetensors import safe_open

    optimizer.synchronize()
    units = list(optimizer.all_units)
    headers = {u: meta for u, meta in _read_headers(folder, units).items() if u in optimizer._plan}
    for u, meta in headers.items():  # validate everything before changing anything
        numel = optimizer._exp_avg[u].numel()
        if int(meta["numel"]) != numel or json.loads(meta["layout"]) != _layout(optimizer, u):
            raise ValueError(
                f"{unit_file(folder, u)} (unit {meta.get('unit_name')}) has another parameter layout than "
                f"unit {optimizer.store.names[u]} of this model ({meta['numel']} vs {numel} elements, or other "
                "shapes/groups): the checkpoint belongs to another model or another set of trainable parameters."
            )
    first = json.loads(next(iter(headers.values()))["param_groups"]) if headers else None
    saved_groups = _decode(first) if first is not None else [
        {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the sharded optimizer checkpoint {folder} has {len(saved_groups)} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    for u, meta in headers.items():
        with safe_open(unit_file(folder, u), framework="pt") as f:
            optimizer._exp_avg[u].copy_(f.get_tensor("exp_avg"))
            optimizer._exp_avg_sq[u].copy_(f.get_tensor("exp_avg_sq"))
        for gi, saved in json.loads(meta["steps"]).items():
            counters = optimizer._steps[(u, int(gi))]
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
        with safe_open(unit_file(folder, u), framework="pt") as f:
            exp_avg, exp_avg_sq = f.get_tensor("exp_avg"), f.get_tensor("exp_avg_sq")
        for gi, params in json.loads(meta["layout"]).items():
            group_steps = steps[gi] if isinstance(steps[gi], list) else [steps[gi]] * len(params)
            for (index, offset, shape), step in zip(params, group_steps):
                numel = 1
                for s in shape:
                    numel *= s
                members[int(gi)].append(index)
                state[index] = {
                    "step": torch.tensor(step, dtype=torch.float32),
                    "exp_avg": exp_avg[offset : offset + numel].clone().view(shape),
                    "exp_avg_sq": exp_avg_sq[offset : offset + numel].clone().view(shape),
                }
    param_groups = [dict(g, params=sorted(m)) for g, m in zip(groups, members)]
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}

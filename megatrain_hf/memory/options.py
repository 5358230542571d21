"""The memory options (part of ``MegaTrainConfig``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from ..errors import MegatrainConfigError

_SIZE_UNITS = {"B": 1, "MB": 10**6, "MiB": 2**20, "GB": 10**9, "GiB": 2**30, "TB": 10**12, "TiB": 2**40}


def parse_size(name: str, value) -> int | None:
    """``value`` (None, a positive byte count, or a size such as ``"24GiB"``) in bytes."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(GiB|GB|MiB|MB|TiB|TB)?\s*", value)
        if match and float(match.group(1)) > 0:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or "B"])
    raise MegatrainConfigError(
        f"MegaTrainConfig.{name}={value!r}; allowed: None, a positive byte count, or a size such as "
        "'24GiB', '20GB', '512MiB'."
    )


def _check_offload_dir(name: str, value) -> None:
    if value is not None:
        from ..core.disk_io import check_offload_dir

        check_offload_dir(value)


def _check_window(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise MegatrainConfigError(
            f"MegaTrainConfig.{name}={value!r}; allowed: an int >= 2 (the unit updating and the one "
            "written back behind it; each slot more reads one unit further ahead). Fix: offload_window=4, "
            "the default.")


def _check_max_seq_len(name: str, value) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise MegatrainConfigError(
            f"MegaTrainConfig.{name}={value!r}; allowed: None or the longest training sequence in tokens, an "
            "int >= 1 (e.g. 131072).")


def _check_resident(name: str, value) -> None:
    if value != "auto" and (type(value) is not int or value < 0):
        raise MegatrainConfigError(
            f"MegaTrainConfig.{name}={value!r}; allowed: 'auto' (the plan decides from the GPU budget), 0 (off: "
            "every unit streams) or an int >= 1 (that many units, in forward order, kept whole on the device).")


@dataclass(kw_only=True)
class MemoryOptions:
    pin_memory: bool | Literal["auto"] = "auto"
    """Page-lock the host flats (`cudaHostRegister`, no power-of-two rounding) so that transfers
    run at full link speed: `"auto"` pins when the compute device is CUDA. If the OS refuses,
    the engine raises with the size asked for (see docs/troubleshooting.md)."""

    host_staging: bool | Literal["auto"] = "auto"
    """Keep a compute-dtype (bf16) copy of the matrix masters in host RAM (2 B/param, refreshed by
    the update) and send that over the link, or send the fp32 masters and round them to bf16 on
    the GPU (same bits; no host copy, twice the bytes up the link, a shorter update). `"auto"`: keep
    the copy unless the host plan does not fit in the RAM available with it but fits without it
    (logged): 16 instead of 18 bytes per trainable parameter. Which is faster depends on the link
    and the accumulation: see docs/benchmarks.md. With `max_seq_len`, `"auto"` is the choice of the
    placement planned for that length (the copy dropped where the RAM is wanted for checkpoints)."""

    max_gpu_memory: Annotated[str | int | None, parse_size] = None
    """GPU memory budget for this process, e.g. `"24GiB"`, `"20GB"` or a byte count; `None`: no
    budget. The engine caps PyTorch's allocator there (`torch.cuda.set_per_process_memory_fraction`),
    switches it to expandable segments (unless `PYTORCH_ALLOC_CONF` or `PYTORCH_CUDA_ALLOC_CONF` say
    otherwise) and sizes the layer-major schedule to it: the first optimizer step runs its
    micro-batches one at a time and measures the GPU peak and the activation-checkpoint bytes of a
    micro-batch; later steps run as many micro-batches per group as fit
    (`megatrain/microbatches_in_flight` with `metrics="all"`). One micro-batch at a time is the
    floor: if that does not fit, reduce the micro-batch or the sequence length, or set
    `offload_checkpoints=True`."""

    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of the host gradient accumulators of the weights streamed in bf16 (the decoder layers'
    matrices): `"fp32"` (4 B/param) or `"bf16"` (2 B/param, and half the gradient bytes down the link).
    `"bf16"` is exact -- every update and every loss bitwise the fp32 accumulators' -- because with
    bf16 compute each such gradient is a bf16 tensor computed once per optimizer step; it therefore
    needs `compute_dtype="bf16"`, `gradient_accumulation_steps=1`, megatrain's HostAdamW, one process
    (no data parallelism), no `device_update`, and torch's `Tensor.grad_dtype` (torch >= 2.10):
    `param.grad` of those weights is a bf16 tensor. Embeddings, norms, biases, LoRA matrices and the
    head keep fp32 accumulators. A second gradient of one weight in a step (a module called twice in
    one forward), or an fp32 one (e.g. experts computed in fp32), raises with the fix: `"fp32"`.
    Clipping is always applied inside the update then (a callback sees the gradients unclipped: a
    clipped bf16 gradient would be rounded)."""

    offload_checkpoints: bool | Literal["auto", "disk"] = "auto"
    """Keep each layer's activation checkpoint (its fp32 input, `tokens x hidden x 4` bytes) in
    pinned host memory between forward and backward instead of on the GPU: copied down while the
    next layer computes, brought back ahead of its backward. GPU memory then stays flat with depth
    and with the micro-batches in flight; host RAM holds `(layers + 2) x micro-batches in flight x
    tokens x hidden x 4` bytes more, and the link carries them twice. Exact (same bytes back).
    `"auto"`: off, unless `max_gpu_memory`'s plan fits fewer micro-batches per group than the
    step has and the host RAM can take the checkpoints of two; then on (logged), and the budget
    measures again. `"disk"` (needs `offload_dir`): each checkpoint goes to a file there instead
    (written behind on a thread from a host staging buffer, read back one unit ahead of its
    backward; host RAM: three checkpoints' staging buffers whatever the depth). With `offload_dir`
    set, a checkpoint the host RAM cannot take (`True`, or `"auto"` once on) spills to that file
    instead of failing. With `max_seq_len`, `"auto"` is the home of the placement planned for that
    length ([long context](long-context.md#setting-max_seq_len))."""

    checkpoint_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype the activation checkpoints are kept in, in any home (GPU, host, disk). `"fp32"`: each
    unit's input as computed (the residual stream of mixed-precision training is fp32): exact.
    `"bf16"` (opt-in): floating inputs rounded to bf16 when kept and widened back for the backward's
    recompute; half the bytes, not exact: the recompute starts from the rounded input (a measured loss
    band is in docs/benchmarks.md). Needs bf16 compute."""

    max_seq_len: Annotated[int | None, _check_max_seq_len] = None
    """The longest training sequence, in tokens (per micro-batch row; planned for micro-batches of one
    sequence). Set, the engine places the optimizer state and the activation checkpoints itself before
    allocating anything: it plans the model's shape on this machine (GPU memory, or `max_gpu_memory`;
    the RAM available; the free space of `offload_dir`) at that length and sets the options left at
    their defaults -- `offload_checkpoints` (`"auto"`), `checkpoint_interval` (`"auto"`), `host_staging`
    (`"auto"`), `offload_state` (`"auto"`, with `offload_dir`) -- to the exact placement of the shortest
    estimated step (logged, and in `megatrain estimate --max-seq-len`'s decisions). Options you set are
    kept. Options that change the numbers (`checkpoint_dtype="bf16"`, `optimizer_state` other than
    fp32, `grad_dtype="bf16"`) are never turned on: when only they would fit, attaching raises
    `LongContextFitError` naming the longest length that fits and what fits more. A longer sequence in
    training is logged once, or refused where the placement no longer fits it
    ([long context](long-context.md#setting-max_seq_len)). On CUDA it also switches PyTorch's caching
    allocator to expandable segments (unless `PYTORCH_ALLOC_CONF` or `PYTORCH_CUDA_ALLOC_CONF` name
    them): at 512K tokens fixed segments reserved up to 24 GiB above the allocated peak. `None`: no
    placement (the defaults as they are)."""

    check_host_memory: bool = True
    """Before allocating, compare the host bytes the plan needs with the RAM available and raise
    with the arithmetic if it does not fit. Turn off only where the OS reports less available
    memory than it will grant (e.g. VMs whose RAM grows on use): offloaded activation checkpoints
    then also take what they need without asking the OS first."""

    offload_dir: Annotated[str | None, _check_offload_dir] = None
    """A directory on a local disk for the disk tier ([disk tier](disk-tier.md)): with it, the AdamW
    moments (8 B per trainable parameter in fp32, less in `optimizer_state`'s compressed formats)
    can live in files there instead of host RAM, read a few
    units ahead of the update and written back behind it (the order is known: exact prefetch).
    megatrain creates its own directory inside it (mode 0700, unique per run, removed at exit).
    Where the moments go is `offload_state`'s choice. `None`: everything in RAM."""

    offload_state: Literal["auto", "moments", "all"] = "auto"
    """With `offload_dir`: `"auto"` keeps the moments in RAM when the plan fits there and puts them on
    disk when it does not (the fewest units' first, then, if RAM is still short, the fp32 masters of
    the matrices of the fewest units; logged); `"moments"` puts every unit's moments on disk whatever
    RAM there is; `"all"` the moments and the fp32 masters of the matrices (4 B/param more; the device
    streams their bf16 staging copy, so only the update reads them), which needs bf16 compute with the
    staging copy and no data parallelism; each unit's masters go to its file while the model attaches,
    so they never all exist in RAM. Refused before allocating, with the arithmetic, when RAM +
    the free space of `offload_dir` are short."""

    offload_window: Annotated[int, _check_window] = 4
    """With `offload_dir`: the disk tier's RAM slots, each the size of the largest unit's state on disk
    (moments, and the masters with `offload_state="all"`): the unit updating, the one written back behind
    it, and `offload_window - 2` read ahead. 2 takes the least RAM; more lets reads run further ahead of
    a disk whose speed varies."""

    disk_io: Literal["threads", "auto", "deepspeed"] = "threads"
    """The disk tier's I/O engine ([disk tier](disk-tier.md)): `"threads"`, a pool of
    `preadv`/`pwritev` threads with `O_DIRECT`, no dependency, every failed request raised with its
    file and bytes; `"deepspeed"`, DeepSpeed's async I/O op (libaio; `pip install
    'megatrain_hf[aio]'` and libaio-dev), faster on the development machine's disk but blind to an
    I/O error the device reports inside a request, refused with the reason where it cannot run;
    `"auto"`: DeepSpeed's where it can run, else the threads (logged)."""

    resident_units: Annotated[int | Literal["auto"], _check_resident] = "auto"
    """Units (in forward order: the embedding, then the decoder layers) kept whole on the compute device:
    their fp32 masters, gradients and AdamW moments live there and HostAdamW updates them there (torch's
    AdamW kernel, the same clip multiply and non-finite skip as the host update), so they are never
    streamed; the rest streams from the host as usual. Exact: every loss and weight equals the streamed
    run's, and checkpoints are the same files (the device state is copied down before a save or
    `state_dict`, and up after a load). Their parameters' `.grad` stays None: the gradients are on the
    device (clipping, the norm and the optimizer read them there; `zero_grad` of the model or the
    optimizer empties them). Costs 16 B per trainable parameter of those units on the device (plus their
    compute-dtype copy and frozen weights). `"auto"`: as many units as fit the GPU budget
    (`max_gpu_memory`, less the streamed step's working set) -- printed by `megatrain estimate
    --gpu-gib`; 0 on the CPU, and 0 placed on CUDA until a GPU run measured the path; an int: that many
    (the CPU is the "device" in tests); `0`: off. Needs megatrain's HostAdamW with fp32 moments in RAM
    and fp32 gradient accumulators; refused with data parallelism, `device_update`, `offload_dir`, tensor
    hooks on those parameters, and on CUDA (written and tested on the CPU through the emulated CUDA
    streams, not yet run on a GPU: tests/gpu/test_resident_gpu.py)."""

    def gpu_memory_bytes(self) -> int | None:
        """``max_gpu_memory`` in bytes (None without a budget)."""
        return parse_size("max_gpu_memory", self.max_gpu_memory)

    def resolve_pin(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.pin_memory == "auto" else bool(self.pin_memory)

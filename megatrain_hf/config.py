"""Every knob of the engine in one validated, documented dataclass.

Policy lives here; the mechanism classes (store, streamer, engine, optimizer) take plain
arguments so that tests can build them directly. A config never touches CUDA or a model.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, fields
from typing import Any

import torch

_DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

ENV_VAR = "MEGATRAIN_CONFIG"
"""Environment variable through which `megatrain launch` hands a config to `megatrain_hf.run`."""


@dataclass(kw_only=True)
class MegaTrainConfig:
    """Configuration of the megatrain engine.

    Example::

        from megatrain_hf import MegaTrainConfig, MegaTrainPlugin
        plugin = MegaTrainPlugin(MegaTrainConfig(compute_dtype="bf16"))
    """

    device: str | None = None
    """Compute device (`"cuda"`, `"cuda:1"`, `"cpu"`). `None`: the Trainer's `args.device`, else
    `cuda` when available, else `cpu`. Host RAM always holds the fp32 masters."""

    compute_dtype: str = "auto"
    """dtype of the weights streamed to the device and of the compute: `"auto"` (bf16 when the
    Trainer runs with `bf16=True`, else fp32), `"bf16"`/`"bfloat16"` or `"fp32"`/`"float32"`.
    Masters, gradients accumulators and optimizer state stay fp32 on the host whatever this is."""

    pin_memory: bool | str = "auto"
    """Page-lock the host buffers (`cudaHostRegister`, no power-of-two rounding) so that transfers
    run at full link speed: `"auto"` pins when the compute device is CUDA. If the OS refuses,
    the engine raises with the size asked for (see docs/troubleshooting.md)."""

    replace_adamw: bool = True
    """When the Trainer builds `torch.optim.AdamW` (any `optim="adamw_torch*"`), replace it by
    `HostAdamW` with the same groups and hyper-parameters: same math, state kept in per-layer
    host flats next to the masters. Other optimizers are always kept as they are."""

    host_threads: int | None = None
    """CPU threads for the engine's host work (AdamW update, gradient accumulation). None: every
    CPU this process may run on. Containers often set OMP_NUM_THREADS=1, which would make the
    update ~10x slower; the engine raises torch's thread count to this value and logs it."""

    exact_clipping: bool = True
    """Gradient clipping multiplies the gradients by the clip coefficient before the update,
    exactly like ``torch.nn.utils.clip_grad_norm_`` (bitwise parity with plain Trainer). False:
    the fused update divides by the inverse coefficient on the fly -- one pass over the
    gradients less, results differ in the last bit when clipping triggers."""

    layer_major: bool | str = "auto"
    """Gradient accumulation order under Trainer with `gradient_accumulation_steps > 1`: `True`
    runs all micro-batches of an optimizer step through each layer before the next (each layer
    uploaded twice per step instead of twice per micro-batch, its gradients summed on the GPU and
    downloaded once); `False` runs them one after another as plain Trainer does. `"auto"`: layer-major
    unless the model has active dropout (its random masks would then be drawn in a different order
    than plain Trainer draws them). Activation checkpoints of all micro-batches of a step are
    alive at once on the GPU (see docs/memory.md)."""

    chunked_loss: bool | str = "auto"
    """Compute the training loss without the full logits: the head and the cross-entropy run
    chunk by chunk over the tokens (forward keeps only the loss; backward recomputes each chunk),
    so tokens x vocab logits never exist at once. Applies to training forwards with `labels`;
    such forwards then return `logits=None`. `"auto"`: on under plain `transformers.Trainer`
    (which reads only the loss), off for Trainer subclasses (they may read the logits; TRL's
    `SFTTrainer` brings its own chunked fused LM head, which the plugin runs in the streamed head
    unit) and for `attach()` in your own loop; `True`: always; `False`: never."""

    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the chunked loss. `None`: about 2^26 logits per chunk (2,097 tokens at
    vocabulary 32000: 256 MB of fp32 logits)."""

    host_adamw_kernel: str = "auto"
    """Kernel of the host AdamW update: `"native"` (megatrain's C++ kernel, built on first use with
    the system compiler: clip, AdamW and the bf16 staging copy in one pass over memory, ~30% fewer
    bytes than three passes; results equal torch's fused kernel up to one rounding on a few
    elements), `"torch"` (torch's fused CPU AdamW, bitwise like `torch.optim.AdamW(fused=True)`),
    `"auto"`: native when computing on CUDA (falls back to torch, with a warning, if it cannot be
    built), torch on the CPU."""

    device_update: bool = False
    """Let the GPU take a share of HostAdamW's update. Each step's units are split, in forward order,
    between the host worker and a device worker, each unit to the one that would finish it first at
    the rates both reached in the last step, so the next forward trails both; the device worker
    sends a unit's masters and moments up the link in pieces of 32 M elements, runs torch's fused
    AdamW there on the gradients the gradient sink kept on the GPU (no round trip for them), and
    brings masters, moments and the bf16 copy back on a second stream while the next piece goes
    up. Same formula; on CUDA the GPU's units differ from the host kernel's in the last bit. Costs
    GPU memory: the kept fp32 gradients of the GPU's units (4 B per parameter of its share, ~4 GB
    at 3.14 B, from their backward to their update, when activations are mostly freed: the peak
    rose from 9.08 to 9.55 GiB there; at most 10 % of the GPU's memory, first units first, the
    rest go up the link again) and up to three pieces in flight (~1.5 GB); under `max_gpu_memory`
    none are kept. Worth it when the update is exposed, i.e. with little gradient
    accumulation: on one H200 (16-core host), 3.14 B at 16K tokens per step ran 10,876 tokens/s
    with it (1.67x DeepSpeed ZeRO-3 offload in the same call) against 10,321 with
    `host_staging=False` alone (`d99d99b`, `977dd3e`; docs/benchmarks.md)."""

    host_staging: bool | str = "auto"
    """Keep a compute-dtype (bf16) copy of the matrix masters in host RAM (2 B/param, refreshed by
    the update) and send that over the link, or send the fp32 masters and round them to bf16 on
    the GPU (same bits; no host copy, twice the bytes up the link). `"auto"`: keep the copy unless
    the host plan does not fit in the RAM available with it but fits without it (logged): 16
    instead of 18 bytes per trainable parameter, e.g. a 7B full fine-tune in 128 GB. `False` also
    shortens the update (no bf16 copy written): with a fast link and little accumulation it is
    the faster choice without `device_update` (3.14 B at 16K tokens per step on one H200: 10,321
    tokens/s, 1.59x DeepSpeed ZeRO-3 offload), not with it (11,009 with the copy, 10,687 without;
    the link then carries the GPU's share of the optimizer state too; docs/benchmarks.md)."""

    max_gpu_memory: str | int | None = None
    """GPU memory budget for this process, e.g. `"24GiB"`, `"20GB"` or a byte count; `None`: no
    budget. The engine caps PyTorch's allocator there (`torch.cuda.set_per_process_memory_fraction`),
    switches it to expandable segments (unless `PYTORCH_ALLOC_CONF` or `PYTORCH_CUDA_ALLOC_CONF` say otherwise: at the cap,
    fixed segments fragment and every failed allocation empties the cache, a device-wide
    synchronisation; `megatrain/alloc_retries` in the logs counts those) and sizes the layer-major schedule to it: the first optimizer step runs its micro-batches one
    at a time and measures the GPU peak and the activation-checkpoint bytes of a micro-batch; later
    steps run as many micro-batches per group as fit (`megatrain/microbatches_in_flight` in the
    logs). One micro-batch at a time is the floor: if that does not fit, reduce the micro-batch or
    the sequence length, or set `offload_checkpoints=True`."""

    offload_checkpoints: bool | str = "auto"
    """Keep each layer's activation checkpoint (its fp32 input, `tokens x hidden x 4` bytes) in
    pinned host memory between forward and backward instead of on the GPU: copied down while the
    next layer computes, brought back ahead of its backward. GPU memory then stays flat with depth
    and with the micro-batches in flight; host RAM holds `(layers + 2) x micro-batches in flight x
    tokens x hidden x 4` bytes more, and the link carries them twice. Exact (same bytes back).
    `"auto"`: off, unless `max_gpu_memory`'s plan fits fewer micro-batches per group than the
    step has and the host RAM can take the checkpoints of two; then on (logged), and the budget
    measures again."""

    check_host_memory: bool = True
    """Before allocating, compare the host bytes the plan needs with the RAM available and raise
    with the arithmetic if it does not fit. Turn off only where the OS reports less available
    memory than it will grant (e.g. VMs whose RAM grows on use): offloaded activation checkpoints
    then also take what they need without asking the OS first."""

    def __post_init__(self) -> None:
        if self.device is not None:
            try:
                torch.device(self.device)
            except RuntimeError as exc:
                raise ValueError(
                    f"MegaTrainConfig.device={self.device!r} is not a torch device; use e.g. 'cuda', "
                    "'cuda:0' or 'cpu', or leave it None to follow the Trainer."
                ) from exc
        if not isinstance(self.compute_dtype, str) or self.compute_dtype not in _DTYPES:
            raise ValueError(
                f"MegaTrainConfig.compute_dtype={self.compute_dtype!r} is not supported; allowed: "
                f"{sorted(_DTYPES)}. fp16 is not supported (use bf16 on GPUs that have it)."
            )
        if self.host_threads is not None and (not isinstance(self.host_threads, int) or self.host_threads < 1):
            raise ValueError(
                f"MegaTrainConfig.host_threads={self.host_threads!r}; allowed: None (all CPUs) or an int >= 1."
            )
        if self.host_staging not in (True, False, "auto"):
            raise ValueError(f"MegaTrainConfig.host_staging={self.host_staging!r}; allowed: True, False or 'auto'.")
        if self.chunked_loss not in (True, False, "auto"):
            raise ValueError(f"MegaTrainConfig.chunked_loss={self.chunked_loss!r}; allowed: True, False or 'auto'.")
        if self.loss_chunk_tokens is not None and (
            not isinstance(self.loss_chunk_tokens, int) or isinstance(self.loss_chunk_tokens, bool)
            or self.loss_chunk_tokens < 1
        ):
            raise ValueError(
                f"MegaTrainConfig.loss_chunk_tokens={self.loss_chunk_tokens!r}; allowed: None (automatic) or an int >= 1."
            )
        if self.host_adamw_kernel not in ("auto", "native", "torch"):
            raise ValueError(
                f"MegaTrainConfig.host_adamw_kernel={self.host_adamw_kernel!r}; allowed: 'auto', 'native' or 'torch'."
            )
        if self.layer_major not in (True, False, "auto"):
            raise ValueError(
                f"MegaTrainConfig.layer_major={self.layer_major!r}; allowed: True, False or 'auto'."
            )
        if not (isinstance(self.offload_checkpoints, bool) or self.offload_checkpoints == "auto"):
            raise ValueError(
                f"MegaTrainConfig.offload_checkpoints={self.offload_checkpoints!r}; allowed: True, False or 'auto'."
            )
        if not isinstance(self.device_update, bool):
            raise ValueError(f"MegaTrainConfig.device_update={self.device_update!r}; allowed: True or False.")
        if self.pin_memory not in (True, False, "auto"):
            raise ValueError(
                f"MegaTrainConfig.pin_memory={self.pin_memory!r}; allowed: True, False or 'auto'."
            )

        if self.max_gpu_memory is not None:
            self.gpu_memory_bytes()  # validates

    # ------------------------------------------------------------------ helpers
    def gpu_memory_bytes(self) -> int | None:
        """``max_gpu_memory`` in bytes (None without a budget)."""
        value = self.max_gpu_memory
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        if isinstance(value, str):
            match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(GiB|GB|MiB|MB|TiB|TB)?\s*", value)
            if match:
                number = float(match.group(1))
                unit = match.group(2) or "B"
                scale = {"B": 1, "MB": 10**6, "MiB": 2**20, "GB": 10**9, "GiB": 2**30, "TB": 10**12, "TiB": 2**40}[unit]
                if number > 0:
                    return int(number * scale)
        raise ValueError(
            f"MegaTrainConfig.max_gpu_memory={value!r}; allowed: None, a positive byte count, or a size such as "
            "'24GiB', '20GB', '512MiB'."
        )

    def resolve_dtype(self, trainer_bf16: bool = False) -> torch.dtype:
        """The compute dtype, given whether the Trainer asked for bf16 mixed precision."""
        dtype = _DTYPES[self.compute_dtype]
        if dtype is None:
            return torch.bfloat16 if trainer_bf16 else torch.float32
        return dtype

    def resolve_device(self, trainer_device: torch.device | None = None) -> torch.device:
        """The compute device, given the Trainer's device if there is one (CUDA with its index)."""
        if self.device is not None:
            device = torch.device(self.device)
        elif trainer_device is not None:
            device = torch.device(trainer_device)
        else:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def resolve_host_adamw_kernel(self, device: torch.device) -> str:
        if self.host_adamw_kernel == "auto":
            return "native" if device.type == "cuda" else "torch"
        return self.host_adamw_kernel

    def resolve_pin(self, device: torch.device) -> bool:
        if self.pin_memory == "auto":
            return device.type == "cuda"
        return bool(self.pin_memory)

    def resolve_host_threads(self) -> int:
        if self.host_threads is not None:
            return self.host_threads
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            return os.cpu_count() or 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "MegaTrainConfig":
        """Build from a mapping (a YAML `megatrain:` section); unknown keys are rejected."""
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown megatrain option(s) {unknown}; allowed: {sorted(known)}. "
                "See docs/configuration.md."
            )
        return cls(**values)

    @classmethod
    def from_env(cls) -> "MegaTrainConfig":
        """Config handed over by `megatrain launch` through the MEGATRAIN_CONFIG variable (JSON)."""
        import json

        raw = os.environ.get(ENV_VAR)
        if not raw:
            return cls()
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV_VAR} is not valid JSON ({exc}); value: {raw[:200]!r}") from exc
        if not isinstance(values, dict):
            raise ValueError(f"{ENV_VAR} must hold a JSON object, got {type(values).__name__}")
        return cls.from_dict(values)


def config_fields() -> list[dataclasses.Field]:
    """The documented fields, in order (used by the docs and their test)."""
    return [f for f in fields(MegaTrainConfig)]


__all__ = ["MegaTrainConfig", "ENV_VAR", "config_fields"]

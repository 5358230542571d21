"""``MegaTrainConfig``: every knob of the engine, one flat, validated, documented dataclass.

Each component owns its knobs -- ``optim/options.py``, ``memory/options.py``,
``runtime/options.py``, ``models/options.py`` -- and ``MegaTrainConfig`` is their union, so a user
sets any of them in one place (``MegaTrainPlugin(compute_dtype="bf16", max_gpu_memory="24GiB")``,
a YAML ``megatrain:`` section). One validator reads the fields' types: ``bool``, ``Literal``
values, ``None`` and ``int``, plus a check function in ``Annotated`` metadata where a value needs
parsing. Policy lives here; the mechanism classes take plain arguments so tests can build them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal, Union

import torch

from .errors import MegatrainConfigError
from .models.options import LossOptions, QuantOptions
from .memory.options import MemoryOptions
from .optim.options import OptimizerOptions
from .runtime.options import RuntimeOptions

_DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16}

ENV_VAR = "MEGATRAIN_CONFIG"
"""Environment variable through which `megatrain launch` hands a config to `megatrain_hf.run`."""


def _check_device(name: str, value) -> None:
    if value is None:
        return
    try:
        torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise MegatrainConfigError(
            f"MegaTrainConfig.{name}={value!r} is not a torch device; use e.g. 'cuda', 'cuda:0' or 'cpu', or "
            "leave it None to follow the Trainer."
        ) from exc


def _check_threads(name: str, value) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise MegatrainConfigError(f"MegaTrainConfig.{name}={value!r}; allowed: None (all CPUs) or an int >= 1.")


def _check_timeout(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise MegatrainConfigError(f"MegaTrainConfig.{name}={value!r}; allowed: a number of seconds > 0, e.g. 300.")


@dataclass(kw_only=True)
class EngineOptions:
    device: Annotated[str | None, _check_device] = None
    """Compute device (`"cuda"`, `"cuda:1"`, `"cpu"`). `None`: the Trainer's `args.device`, else
    `cuda` when available, else `cpu`. Host RAM always holds the fp32 masters."""

    compute_dtype: Literal["auto", "bf16", "bfloat16", "fp32", "float32"] = "auto"
    """dtype of the weights streamed to the device and of the compute: `"auto"` (bf16 when the
    Trainer runs with `bf16=True`, else fp32), `"bf16"`/`"bfloat16"` or `"fp32"`/`"float32"`.
    Masters, gradient accumulators and optimizer state stay fp32 on the host whatever this is.
    fp16 is not supported (use bf16 on GPUs that have it)."""

    experts_dtype: Literal["auto", "compute"] = "auto"
    """dtype in which a mixture-of-experts model's routed experts (the fused `experts.gate_up_proj` /
    `experts.down_proj` of Mixtral, Qwen2/3-MoE, OLMoE) travel and compute under bf16 compute.
    `"auto"`: what plain `bf16=True` training computes them with -- fp32 unless their kernel computes
    with bf16 weights exactly as autocast does with fp32 ones. transformers' default kernel,
    `grouped_mm`, ignores autocast and casts its input to the weights' dtype, so plain training
    multiplies by the fp32 weights; `batched_mm` gathers the experts' rows before autocast rounds
    them (its backward would sum their gradients in bf16); a kernel registered by the user is not
    known. Only `experts_implementation="eager"` (one `F.linear` per expert) gets the compute dtype.
    fp32 experts are exact against plain training and cost twice their upload bytes (97 % of an MoE
    layer's; with the fp32 gradients that come down either way, 1.5x a step's link bytes) and fp32
    weight slots on the GPU; the host holds no bf16 copy of them, and `offload_state="all"` leaves
    their masters in RAM (the device reads them). `"compute"`: the experts in
    the compute dtype like every other matrix -- half the link bytes, but not plain training's
    arithmetic (tiny Mixtral, 6 steps on the CPU: losses 5.9e-4 apart). No effect in fp32 compute or on
    dense models."""

    host_threads: Annotated[int | None, _check_threads] = None
    """CPU threads for the engine's host work (AdamW update, gradient accumulation). None: every
    CPU this process may run on. Containers often set OMP_NUM_THREADS=1, which would make the
    update several times slower; the engine raises torch's thread count to this value and logs it."""

    data_parallel: bool | Literal["auto"] = "auto"
    """Data parallelism over `torch.distributed` ranks (`torchrun`, `accelerate launch
    --num_processes N`): each unit's masters, gradient and AdamW state live on one owner rank (unit
    index modulo the world size), the weights are broadcast from it for each fetch and the gradients
    summed into it ([distributed](distributed.md)). `"auto"`: on when torch.distributed runs with
    more than one rank; `True` refuses to run without; `False`: every rank trains alone."""

    collective_timeout_s: Annotated[int | float, _check_timeout] = 300
    """Seconds a rank waits in one of megatrain's collectives (a weight broadcast, a gradient reduce)
    before it raises naming the unit: a peer that died or hangs stops every rank within this."""

    metrics: Literal["basic", "all", "none"] = "basic"
    """`megatrain/*` metrics added to Trainer's training logs (console, TensorBoard, W&B; not to the
    `trainer_state.json` of checkpoints): `"basic"` -- tokens/s, TFLOPS, the exposed waits, host
    RSS, GPU peaks; `"all"` -- also link bytes and rates, fetch and update statistics; `"none"`."""


@dataclass(kw_only=True)
class MegaTrainConfig(OptimizerOptions, MemoryOptions, QuantOptions, LossOptions, RuntimeOptions, EngineOptions):
    """Configuration of the megatrain engine.

    Example::

        from megatrain_hf import MegaTrainConfig, MegaTrainPlugin
        plugin = MegaTrainPlugin(MegaTrainConfig(compute_dtype="bf16"))
    """

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self), include_extras=True)
        for f in fields(self):
            _validate(f.name, getattr(self, f.name), hints[f.name])

    # ------------------------------------------------------------------ resolution
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

    def resolve_host_threads(self) -> int:
        if self.host_threads is not None:
            return self.host_threads
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            return os.cpu_count() or 1

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "MegaTrainConfig":
        """Build from a mapping (a YAML `megatrain:` section); unknown keys are rejected."""
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise MegatrainConfigError(
                f"unknown megatrain option(s) {unknown}; allowed: {sorted(known)}. See docs/configuration.md."
            )
        return cls(**values)

    @classmethod
    def from_env(cls) -> "MegaTrainConfig":
        """Config handed over by `megatrain launch` through the MEGATRAIN_CONFIG variable (JSON)."""
        raw = os.environ.get(ENV_VAR)
        if not raw:
            return cls()
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise MegatrainConfigError(f"{ENV_VAR} is not valid JSON ({exc}); value: {raw[:200]!r}") from exc
        if not isinstance(values, dict):
            raise MegatrainConfigError(f"{ENV_VAR} must hold a JSON object, got {type(values).__name__}")
        return cls.from_dict(values)


# ---------------------------------------------------------------------------------- validation
def _members(hint) -> list:
    """The alternatives of a type hint (``Annotated`` stripped, unions flattened)."""
    if typing.get_origin(hint) is Annotated:
        return _members(typing.get_args(hint)[0])
    if typing.get_origin(hint) in (Union, types.UnionType):
        return [m for arg in typing.get_args(hint) for m in _members(arg)]
    if typing.get_origin(hint) is Literal:
        return [("value", v) for v in typing.get_args(hint)]
    return [("type", hint)]


def _matches(value, member) -> bool:
    kind, what = member
    if kind == "value":
        return type(value) is type(what) and value == what
    if what is type(None):
        return value is None
    return type(value) is what or (what is str and isinstance(value, str))


def _describe(members: list) -> str:
    names = []
    for kind, what in members:
        if kind == "value":
            names.append(repr(what))
        elif what is bool:
            names += ["True", "False"]
        elif what is type(None):
            names.append("None")
        else:
            names.append(f"a {what.__name__}")
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


_HINTS = {
    "compute_dtype": " fp16 is not supported (use bf16 on GPUs that have it).",
    "experts_dtype": " 'compute' sends the experts in the compute dtype (bf16 with bf16=True), 'auto' in fp32 where "
                     "plain bf16 training computes them in fp32 (docs/configuration.md).",
}
"""What a refused value of a field is followed by in the message."""


def _validate(name: str, value, hint) -> None:
    for check in typing.get_args(hint)[1:] if typing.get_origin(hint) is Annotated else ():
        check(name, value)  # raises with the field's own message
    members = _members(hint)
    if not any(_matches(value, m) for m in members):
        extra = _HINTS.get(name, "")
        raise MegatrainConfigError(f"MegaTrainConfig.{name}={value!r}; allowed: {_describe(members)}.{extra}")


def config_fields() -> list[dataclasses.Field]:
    """The documented fields, in order (used by the docs and their test)."""
    return list(fields(MegaTrainConfig))


def option_classes() -> list[type]:
    """The classes whose fields make up ``MegaTrainConfig``, in field order (for the docs' test)."""
    return [c for c in reversed(MegaTrainConfig.__mro__) if dataclasses.is_dataclass(c) and c is not MegaTrainConfig]


__all__ = ["MegaTrainConfig", "ENV_VAR", "config_fields", "option_classes"]

"""Models built without their weights, whose weights go straight from the checkpoint into the host store.

:func:`from_pretrained` builds the model of a ``save_pretrained`` folder without reading a weight.
A parameter registration hook moves every parameter to the meta device as its module registers
it, so the constructors and HF's initialization run on meta tensors for free, while buffers are
built for real on the CPU: the rotary ``inv_freq`` tables and other non-persistent buffers are
computed by the model as in any construction (persistent buffers are then read from the
checkpoint). Each parameter is then swapped (``torch.utils.swap_tensors``: the object is kept, so
tied weights stay one parameter) for a *placeholder*: an fp32 CPU tensor of the parameter's shape
that expands one NaN element. What inspects a model before training -- PEFT, which creates its
adapters on the device and in the dtype of the weight they wrap, parameter counts,
``model.device`` -- sees what it sees on a loaded fp32 model; writes into a placeholder raise,
reads give NaN, and the model's forward, ``save_pretrained`` and casts/moves are refused until
the weights are loaded (``state_dict()`` works: PEFT reads its keys to load an adapter).

When megatrain attaches (``attach``, the Trainer plugin, ``megatrain_hf.Trainer``, the
accelerator), the host store asks :meth:`DeferredWeights.source` for each tensor it lays out. A
tensor still holding its placeholder is read from the checkpoint straight into its slice of the
unit's flat, cast per tensor to fp32 (masters) or to the wire dtype (frozen weights)
(``shards.py``); any other tensor (PEFT's adapters) is copied as usual. No second copy of the
weights exists at any time: loading costs the host plan, plus one bounce buffer.

Checkpoint keys are the model's parameter names, as ``save_pretrained`` writes them: a tied weight
is found under any of its names, and a checkpoint of the bare base model (keys without the
``base_model_prefix``, or with it where the model has none) is matched as transformers matches it.
Renamed or fused keys (transformers' weight conversions) are not translated: such a checkpoint is
refused with the keys it lacks.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from ..errors import CheckpointError, MegatrainConfigError, UnreadableCheckpointError, UnsupportedModelError, UsageError
from ..core.patcher import Patcher
from .model_patches import wrapper_chain
from .prequantized import Prequantized, find
from .base_quantization import checkpoint_ranges
from .shards import ShardReader, Stored, index_folder

logger = logging.getLogger(__name__)

ATTRIBUTE = "_megatrain_deferred"
_REFUSED_KWARGS = ("device_map", "quantization_config", "load_in_8bit", "load_in_4bit", "tp_plan")


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None):
    if param is None or param.device.type == "meta":
        return None
    return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with every parameter created on the meta device and every buffer on the CPU."""
    handle = register_module_parameter_registration_hook(_to_meta)
    try:
        return build()
    finally:
        handle.remove()


def _candidates(name: str, prefix: str) -> list[str]:
    out = [name]
    if prefix and name.startswith(prefix + "."):
        out.append(name[len(prefix) + 1 :])
    elif prefix:
        out.append(f"{prefix}.{name}")
    return out


class DeferredWeights:
    """The checkpoint reads a model built by :func:`from_pretrained` still owes.

    Placeholders are told apart by their one-element storage (kept alive here, so no other tensor
    can take its address): a parameter whose data was replaced since (by PEFT, ``load_state_dict``
    or the store) is no longer read from the checkpoint.
    """

    def __init__(self, path: str, tensors: dict[str, Stored]) -> None:
        self.path = path
        self.tensors = tensors
        self.pending: dict[int, tuple[str, Stored, torch.Tensor]] = {}  # storage address -> (key, where, base)
        self.reader = ShardReader()
        self.guards = Patcher()
        self.prequantized: dict[str, Prequantized] = {}  # key -> a weight bitsandbytes stored quantized

    def placeholder(self, key: str, stored: Stored, requires_grad: bool) -> nn.Parameter:
        base = torch.full((), float("nan"))
        self.pending[base.untyped_storage().data_ptr()] = (key, stored, base)
        return nn.Parameter(base.expand(stored.shape), requires_grad=requires_grad)

    def key_of(self, tensor: torch.Tensor) -> tuple[str, Stored] | None:
        """(checkpoint key, where it is stored) if ``tensor`` still holds its placeholder, else None."""
        if tensor.device.type != "cpu":
            return None
        hit = self.pending.get(tensor.untyped_storage().data_ptr())
        if hit is None or tuple(tensor.shape) != hit[1].shape:
            return None
        return hit[0], hit[1]

    def prequantized_of(self, tensor: torch.Tensor) -> Prequantized | None:
        """The bitsandbytes-quantized checkpoint weight ``tensor`` still owes, if it is one."""
        hit = self.key_of(tensor)
        return self.prequantized.get(hit[0]) if hit is not None else None

    def stored_schemes(self, model: nn.Module) -> dict[int, str]:
        """``id(param) -> scheme`` of the parameters the checkpoint holds quantized by bitsandbytes."""
        found = ((p, self.prequantized_of(p)) for p in model.parameters())
        return {id(p): q.scheme for p, q in found if q is not None}

    def quantized_source(self, tensor: torch.Tensor):
        """What copies ``tensor``'s stored bitsandbytes pieces into its quantized byte range, or None."""
        stored = self.prequantized_of(tensor)
        return None if stored is None else (lambda fmt, raw: stored.fill(fmt, raw, self.reader))

    def stored_of(self, tensor: torch.Tensor) -> Stored | None:
        """Where ``tensor`` is stored in the checkpoint, if it still holds its placeholder."""
        hit = self.key_of(tensor)
        return hit[1] if hit is not None else None

    def ranges(self, tensor: torch.Tensor) -> Callable[[int, int, torch.Tensor], None] | None:
        """What reads ranges of ``tensor``'s elements from the checkpoint (a base weight the store
        quantizes chunk by chunk), or None."""
        return checkpoint_ranges(self.reader, self.stored_of)(tensor)

    def source(self, tensor: torch.Tensor) -> Callable[[torch.Tensor], None] | None:
        """What fills ``tensor``'s slice of a host flat: a read of the checkpoint, or None (copy it)."""
        hit = self.key_of(tensor)
        if hit is None:
            return None
        if hit[0] in self.prequantized:
            raise UnsupportedModelError(
                f"megatrain: {hit[0]} is stored quantized by bitsandbytes ({self.prequantized[hit[0]].scheme}) in "
                f"{self.path}, and this weight is not stored quantized here. Fix: wrap its Linear with PEFT LoRA and "
                f"set MegaTrainConfig(base_quantization='{self.prequantized[hit[0]].scheme}'), or load the "
                "unquantized checkpoint."
            )
        stored = hit[1]
        return lambda dest: self.reader.read_into(stored, dest)

    def close(self) -> None:
        """Close the checkpoint's files (reads reopen them)."""
        self.reader.close()

    def finish(self, model: nn.Module) -> None:
        """Every placeholder was read: lift the guards and forget the checkpoint."""
        left = [n for n, p in model.named_parameters() if self.key_of(p) is not None]
        if left:
            raise UnreadableCheckpointError(
                f"megatrain: {len(left)} parameter(s) of the model were not read from {self.path}: "
                f"{left[:5]}. Their values would be NaN placeholders.")
        self.close()
        self.guards.undo()
        self.pending.clear()
        for target in wrapper_chain(model):
            target.__dict__.pop(ATTRIBUTE, None)
        logger.info("megatrain: read %.3f GiB of weights from %s into the host store",
                    self.reader.bytes_read / 2**30, self.path)

    # ------------------------------------------------------------------ guards
    def install_guards(self, model: nn.Module) -> None:
        name = type(model).__name__

        def refuse(what: str) -> UsageError:
            return UsageError(
                f"megatrain: {what} of this {name} is refused: its weights are still in {self.path} (built by "
                "megatrain_hf.from_pretrained, which reads them into megatrain's host store when megatrain attaches: "
                "Trainer with MegaTrainPlugin, megatrain_hf.Trainer, megatrain_hf.attach). Attach first, or load "
                "the model with AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)."
            )

        def _apply(fn, recurse: bool = True):
            probe = fn(torch.empty(0))
            if probe.device.type == "cpu" and probe.dtype == torch.float32:
                return model  # already there
            raise refuse(f"moving or casting (to {probe.device}, {probe.dtype})")

        def forward_guard(module, args, kwargs):
            raise refuse("the forward")

        def save_pretrained(*args, **kwargs):
            raise refuse("save_pretrained()")

        self.guards.set_attr(model, "_apply", _apply)
        self.guards.set_attr(model, "save_pretrained", save_pretrained)
        self.guards.hook(model, model.register_forward_pre_hook(forward_guard, with_kwargs=True))


def deferred_weights(model: nn.Module) -> DeferredWeights | None:
    """The checkpoint reads ``model`` (or the model under its PEFT wrappers) still owes, if any."""
    for target in wrapper_chain(model):
        found = target.__dict__.get(ATTRIBUTE)
        if found is not None:
            return found
    return None


def _bind(model: nn.Module, deferred: DeferredWeights) -> None:
    """Swap every meta parameter for its placeholder; read the persistent buffers now."""
    tensors, prefix = deferred.tensors, getattr(model, "base_model_prefix", "") or ""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    used, missing, mismatched = set(), [], []
    for pid, p in params.items():
        key = next((c for n in names[pid] for c in _candidates(n, prefix) if c in tensors), None)
        quantized = find(tensors, key, deferred.reader) if key is not None else None
        if quantized is not None and quantized.shape == tuple(p.shape):  # read as stored when attached
            deferred.prequantized[key] = quantized
            used.update(quantized.keys)
            stored = Stored(deferred.path, torch.uint8, quantized.shape, 0, 0)
            torch.utils.swap_tensors(p, deferred.placeholder(key, stored, p.requires_grad))
        elif key is None:
            missing.append(names[pid][0])
        elif tensors[key].shape != tuple(p.shape):
            mismatched.append(f"{key}: checkpoint {tensors[key].shape}, model {tuple(p.shape)}")
        else:  # a tied weight stored under each of its names is read once
            used.update(c for n in names[pid] for c in _candidates(n, prefix) if c in tensors)
            torch.utils.swap_tensors(p, deferred.placeholder(key, tensors[key], p.requires_grad))
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for b_name, buf in module._buffers.items():
            full = f"{mod_name}.{b_name}" if mod_name else b_name
            if buf is None or b_name in module._non_persistent_buffers_set:
                continue
            key = next((c for c in _candidates(full, prefix) if c in tensors), None)
            if key is None:
                logger.info("megatrain: buffer %s is not in the checkpoint; it keeps the value the model built", full)
                continue
            used.add(key)
            value = torch.empty(tensors[key].shape, dtype=tensors[key].dtype)
            deferred.reader.read_into(tensors[key], value)
            with torch.no_grad():
                buf.copy_(value.view(buf.shape))
    deferred.close()
    if missing or mismatched:
        raise CheckpointError(
            f"the checkpoint in {deferred.path} does not fit {type(model).__name__}: "
            + (f"missing {len(missing)} weight(s) {missing[:5]}; " if missing else "")
            + (f"other shapes: {mismatched[:5]}; " if mismatched else "")
            + "megatrain_hf.from_pretrained reads a save_pretrained folder of this model class, key for key. Load it "
            "with AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) (which initializes missing "
            "weights and converts renamed ones), or save that model with save_pretrained and load the new folder."
        )
    unused = sorted(set(tensors) - used)
    if unused:
        logger.warning("megatrain: %d tensor(s) of %s are not used by %s: %s", len(unused), deferred.path,
                       type(model).__name__, unused[:10])


def from_pretrained(path: str | os.PathLike, *, config: Any = None, model_class: Any = None, **kwargs: Any) -> nn.Module:
    """The model of a ``save_pretrained`` folder, built without reading its weights.

    Replaces ``AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)`` for megatrain: the
    weights (any dtype in the files) are read when megatrain attaches, straight into the host store
    (fp32 masters for trainable weights, the wire dtype for frozen ones, e.g. bf16 PEFT base weights),
    so loading costs the host plan and no more. Until then the model can be inspected and wrapped
    (``peft.get_peft_model``, ``PeftModel.from_pretrained``) but not run, saved, moved or cast. ``config``: a transformers config
    (default: the folder's); ``model_class``: default ``AutoModelForCausalLM``; other keyword
    arguments (``attn_implementation``, ``trust_remote_code``, ...) go to its ``from_config``. The
    model is returned in eval mode, as transformers returns it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise MegatrainConfigError(
            f"megatrain_hf.from_pretrained({path!r}): not a local folder. Pass the folder model.save_pretrained() "
            "wrote; for a Hub model download it first (huggingface_hub.snapshot_download(repo_id))."
        )
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", torch.float32))
    if dtype not in (torch.float32, "float32", "auto"):
        raise MegatrainConfigError(
            f"megatrain_hf.from_pretrained(dtype={dtype!r}): the parameters are megatrain's fp32 masters (frozen ones "
            "are kept in the compute dtype). Leave dtype unset; bf16 compute is TrainingArguments(bf16=True)."
        )
    refused = [k for k in _REFUSED_KWARGS if k in kwargs]
    if refused:
        raise MegatrainConfigError(
            f"megatrain_hf.from_pretrained does not take {refused}: the weights live in host RAM, "
            "read into megatrain's host store.")
    tensors = index_folder(path)
    if config is None:
        config = AutoConfig.from_pretrained(path, trust_remote_code=kwargs.get("trust_remote_code", False))
    cls = model_class or AutoModelForCausalLM
    make = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    model = build_on_meta(lambda: make(config, dtype=torch.float32, **kwargs))
    deferred = DeferredWeights(path, tensors)
    _bind(model, deferred)
    deferred.install_guards(model)
    model.__dict__[ATTRIBUTE] = deferred
    if os.path.isfile(os.path.join(path, "generation_config.json")) and model.can_generate():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()
    return model

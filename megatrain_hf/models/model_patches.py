"""What attaching changes on a transformers model, each change through the engine's Patcher.

* **Placement.** The parameters live in host RAM and stay there: ``model.device`` is the CPU (true:
  that is where the parameters are). ``model.to(...)`` / ``.cuda()`` / ``.float()`` to where it
  already is or to the compute device (Trainer and Accelerate place the model that way) do nothing;
  anything else (another dtype, another device) is refused with the fix. On a CUDA engine, tensors
  given to the model's forward on another device (the CPU: ``generate()`` keeps its bookkeeping
  where ``model.device`` is) are moved to the compute device and the outputs moved back to the
  device they came from, as Accelerate's big-model hooks do (``io_same_device``).
* **Buffers** outside the units (rotary ``inv_freq``) live on the compute device.
* **Checkpointing.** HF's own activation checkpointing is turned off: the engine recomputes every
  unit from its own checkpoint already (HF's would recompute twice), and enabling it later is a
  logged no-op.
* **State** reads and writes (``state_dict``, ``load_state_dict``, ``zero_grad`` in place) wait
  for the background update; a load re-stages the compute-dtype copies. Under data parallelism
  ``state_dict()`` (and so ``save_pretrained()`` without a ``state_dict``) raises on a rank that
  holds only its own units, naming ``gather_state_dict`` / ``trainer.save_model``.
* **Sequence length**: a training forward longer than ``max_position_embeddings`` is refused.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch
from torch import nn

from ..errors import AttachedModelError
from ..core.patcher import Patcher
from ..core.readiness import zero_grad_after
from .checks import SequenceLengthCheck, limit_reason, position_limit
from .families import unwrap

logger = logging.getLogger(__name__)


def wrapper_chain(model: nn.Module) -> list[nn.Module]:
    """``model`` and what it wraps down to the transformers model (PEFT: PeftModel, LoraModel, model)."""
    chain, seen = [], set()
    while model is not None and id(model) not in seen:
        chain.append(model)
        seen.add(id(model))
        inner = getattr(model, "base_model", None) if hasattr(model, "get_base_model") else None
        model = inner if isinstance(inner, nn.Module) and inner is not model else None
    base = unwrap(chain[0])
    if base not in chain:
        chain.append(base)
    return chain


def _placement_guard(module: nn.Module, device: torch.device) -> Callable:
    name = type(module).__name__

    def _apply(fn, recurse: bool = True):
        probe = fn(torch.empty(0))
        if probe.dtype != torch.float32:
            raise AttachedModelError(
                f"megatrain: cannot cast the attached {name} to {probe.dtype}: its parameters are the fp32 "
                "masters in host RAM (the compute dtype is MegaTrainConfig.compute_dtype / bf16=True). "
                "To cast the weights, call megatrain_hf.engine_of(model).detach() first."
            )
        if probe.device.type != "cpu" and probe.device != device:
            raise AttachedModelError(
                f"megatrain: cannot move the attached {name} to {probe.device}: its parameters live in host RAM "
                f"and it computes on {device}. Set MegaTrainConfig(device=...) before attaching, or detach first."
            )
        return module  # the host or the compute device: where it is already, as far as placement goes

    return _apply


class _Alignment:
    """Moves a forward's tensors to the compute device and its outputs back where they came from."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sources = threading.local()  # per thread: layer-major runs forwards on coroutine threads

    def _stack(self) -> list:
        stack = getattr(self._sources, "stack", None)
        if stack is None:
            stack = self._sources.stack = []
        return stack

    def pre(self, module: nn.Module, args: tuple, kwargs: dict):
        source = []

        def move(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.device != self.device:
                source.append(value.device)
                return value.to(self.device)
            return value

        args = tuple(move(a) for a in args)
        kwargs = {k: move(v) for k, v in kwargs.items()}
        self._stack().append(source[0] if source else None)
        return args, kwargs

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        stack = self._stack()
        source = stack.pop() if stack else None
        if source is None:
            return None

        def back(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value.to(source)
            if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
                return tuple(v.to(source) for v in value)
            return value

        if isinstance(output, dict):  # ModelOutput: every tensor field but the cache
            for key in list(output.keys()):
                if key != "past_key_values":
                    output[key] = back(output[key])
            return output
        return back(output)


def install_model(patcher: Patcher, model: nn.Module, units: list[nn.Module], device: torch.device,
                  synchronize: Callable[[], None], mark_dirty: Callable[[], None],
                  check_readable: Callable[[], None] | None = None, absent: frozenset[int] = frozenset()) -> None:
    """Every change of the module docstring but the units' own forwards. ``check_readable``: raises when
    this process's parameters are not the model's (data parallelism: the units other ranks own), whose
    parameters (``absent``: their ids) a ``load_state_dict`` leaves alone (their owner loads them)."""
    base = unwrap(model)
    chain = wrapper_chain(model)
    _disable_hf_checkpointing(patcher, base, chain)
    for target in (*chain, *units):
        patcher.set_attr(target, "_apply", _placement_guard(target, device))
    if device.type != "cpu":
        alignment = _Alignment(device)
        patcher.hook(base, base.register_forward_pre_hook(alignment.pre, with_kwargs=True))
        patcher.hook(base, base.register_forward_hook(alignment.post, with_kwargs=True))
    in_units = {id(b) for m in units for b in m.buffers()}
    for mod in model.modules():
        for key, buf in list(mod._buffers.items()):
            if buf is not None and id(buf) not in in_units and buf.device != device:
                patcher.set_item(mod, "_buffers", key, buf.to(device))
    patcher.hook(base, base.register_state_dict_pre_hook(lambda *args, **kwargs: synchronize()))
    if check_readable is not None:
        patcher.hook(base, base.register_state_dict_pre_hook(lambda *args, **kwargs: check_readable()))
    # load_state_dict (resume, load_best_model_at_end) must not race a background update, and
    # changes the masters (re-stage them)
    patcher.hook(base, base.register_load_state_dict_pre_hook(lambda *args, **kwargs: synchronize()))
    patcher.hook(base, base.register_load_state_dict_post_hook(lambda *args, **kwargs: mark_dirty()))
    if absent:
        _skip_absent_on_load(patcher, base, absent)
    for target in chain:
        original = target.zero_grad
        patcher.set_attr(target, "zero_grad", lambda set_to_none=True, original=original: zero_grad_after(
            synchronize, original, set_to_none))
    config = getattr(base, "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)()
    limit = position_limit(text_config)
    if limit is not None:
        decoder = base.get_decoder() if hasattr(base, "get_decoder") else base
        check = SequenceLengthCheck(limit, getattr(text_config, "model_type", "?"), limit_reason(text_config))
        patcher.hook(decoder, decoder.register_forward_pre_hook(check, with_kwargs=True))


def _skip_absent_on_load(patcher: Patcher, base: nn.Module, absent: frozenset[int]) -> None:
    """``load_state_dict`` (resume, ``load_best_model_at_end``) on a rank that does not hold some units:
    their entries are not copied (their owner loads them; here they are placeholders), nor reported missing."""
    names = [name for name, p in base.named_parameters(remove_duplicate=False) if id(p) in absent]
    skipped: set[str] = set()

    def pre(module, state_dict, prefix, *args):
        for name in names:
            if state_dict.pop(prefix + name, None) is not None:
                skipped.add(prefix + name)

    def post(module, incompatible_keys):
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in skipped]
        skipped.clear()

    patcher.hook(base, base._register_load_state_dict_pre_hook(pre, with_module=True))
    patcher.hook(base, base.register_load_state_dict_post_hook(post))


def _disable_hf_checkpointing(patcher: Patcher, base: nn.Module, chain: list[nn.Module]) -> None:
    flag = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") else (
        "is_gradient_checkpointing"
    )
    if getattr(base, flag, False):
        logger.warning(
            "HF activation checkpointing was enabled on the model; megatrain turns it off because it "
            "already recomputes every layer from its own checkpoint (HF's would recompute twice)."
        )
        # the name of this transformers (5.23 renamed it; the old name warns that it is deprecated)
        (getattr(base, "activation_checkpointing_disable", None) or base.gradient_checkpointing_disable)()

    def _noop(*args, **kwargs):
        logger.info(
            "activation checkpointing requested: megatrain already checkpoints every layer and "
            "recomputes it in backward, so HF's is not enabled."
        )

    for target in chain:
        for name in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
            if hasattr(target, name):
                patcher.set_attr(target, name, _noop)

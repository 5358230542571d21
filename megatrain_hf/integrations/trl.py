"""TRL's fused LM head, served by the engine's streamed head unit.

TRL's ``SFTTrainer`` (trl >= 1) replaces the model's ``forward`` with a *fused LM head*
(``trl.trainer.utils.add_fused_lm_head``): a call with ``fused_lm_head=True`` runs the backbone,
then projects the hidden states through ``lm_head.weight`` in tiles and returns per-token
log-probabilities (and metrics such as the entropy) instead of logits. It reads
``lm_head.weight`` itself, which under megatrain is the fp32 master in host RAM: the head would
run on the host, reading masters that the background AdamW update may be writing (a race), and
its hidden states would be copied to the host.

:func:`adopt_fused_lm_head` replaces TRL's forward with one that keeps TRL's arithmetic (its own
``_ChunkedLogProbFunction``, the options it was patched with) but runs it inside the head unit's
streamed call, on the weights the engine fetched for that unit (after its update), with the
weight gradient going to the host accumulators like any unit's. Calls without
``fused_lm_head=True`` go to TRL's forward as before (which calls the model's own forward).
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import DependencyError, IncompatibleOptionsError, UnsupportedTrlError

logger = logging.getLogger(__name__)

# What TRL's ``_fused_forward`` closes over (trl 1.15 and 1.16); another set means another implementation,
# whose options this module would not apply.
_CLOSURE = frozenset({"temperature", "cast_lm_head_to_fp32", "outputs", "final_logit_softcapping", "logit_scale",
                      "backbone_attr", "original_forward", "text_config"})
_MODULE_NAMES = ("_ChunkedLogProbFunction", "_CHUNKED_LOGPROB_CHUNK_SIZE", "FusedCausalLMOutput")


@dataclass
class FusedLogProbs:
    """Kernel of the head unit's call: TRL's chunked log-probabilities on the fetched weights.

    ``forward`` returns the per-token log-probabilities (the unit call's output) and keeps the
    other per-token fields TRL computed in ``extras``; the entropy, which a loss may use (GRPO's
    entropy term), reaches autograd through :class:`_EntropyBridge`, which hands its gradient to
    ``grad_entropy`` before the unit's backward runs. ``backward`` recomputes through TRL's
    function for the gradients of the hidden states and of the trainable weights.
    """

    function: Any  # TRL's _ChunkedLogProbFunction
    labels: torch.Tensor
    temperature: float
    chunk_size: int
    softcap: float | None
    logit_scale: float
    outputs: tuple
    extras: tuple = field(default=())
    grad_entropy: torch.Tensor | None = None

    def _apply(self, hidden: torch.Tensor, weights: dict[str, torch.Tensor]) -> tuple:
        return self.function.apply(hidden, weights["weight"], weights.get("bias"), self.labels,
                                   self.temperature, self.chunk_size, self.softcap, self.logit_scale, self.outputs)

    def forward(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        # TRL rounds each tile of the weight to the compute dtype: the streamed weight gives its bits
        log_probs, *extras = self._apply(x, tensors)
        self.extras = tuple(None if t is None else t.detach() for t in extras)
        return log_probs

    def backward(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], leaves: list[str],
                 grad_out: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        h = x.detach().requires_grad_(x.requires_grad)
        # TRL returns a weight's gradient in the weight's dtype: fp32 under plain SFTTrainer (the
        # master). An fp32 copy of a trainable streamed weight (exact) keeps it unrounded.
        weights = {k: v.detach().float().requires_grad_() if k in leaves else v for k, v in tensors.items()}
        with torch.enable_grad():
            log_probs, entropy = self._apply(h, weights)[:2]
            inputs = ([h] if h.requires_grad else []) + [weights[name] for name in leaves]
            outputs, seeds = [log_probs], [grad_out]
            if self.grad_entropy is not None:
                outputs.append(entropy)
                seeds.append(self.grad_entropy)
            grads = list(torch.autograd.grad(outputs, inputs, seeds, allow_unused=True))
        self.grad_entropy = None
        grad_h = grads.pop(0) if h.requires_grad else None
        return grad_h, {name: g for name, g in zip(leaves, grads) if g is not None}


class _EntropyBridge(torch.autograd.Function):
    """(log-probs, entropy) for TRL's output: the entropy's gradient goes to the kernel, and the
    log-probs' on to the head unit's call, whose backward runs after this node's."""

    @staticmethod
    def forward(ctx, log_probs: torch.Tensor, entropy: torch.Tensor, kernel: FusedLogProbs):
        ctx.set_materialize_grads(False)  # as TRL's function: an unused entropy costs nothing
        ctx.kernel = kernel
        return log_probs.clone(), entropy.clone()

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        ctx.kernel.grad_entropy = grad_entropy
        if grad_log_probs is None and grad_entropy is not None:
            grad_log_probs = torch.zeros_like(grad_entropy)  # the unit's backward must still run
        return grad_log_probs, None, None


def _trl_fused_forward(model: torch.nn.Module):
    """TRL's fused forward on ``model`` (its function and module), or None. It may sit under
    wrappers made with ``functools.wraps`` (megatrain's own chunked-loss forward when megatrain
    attached after TRL patched), which keep it as ``__wrapped__``. A forward of another form that
    takes ``fused_lm_head`` is refused: it would read the head's weight from host RAM."""
    forward = model.__dict__.get("forward")
    while forward is not None:
        if getattr(forward, "_megatrain_fused_lm_head", False):
            return None  # adopted already
        func = getattr(forward, "__func__", forward)
        code = getattr(func, "__code__", None)
        # functools.wraps gave it the model class's name and module: its code and globals tell
        module_name = getattr(func, "__globals__", {}).get("__name__", "")
        if code is not None and "fused_lm_head" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
            if code.co_name == "_fused_forward" and module_name.startswith("trl."):
                return func, sys.modules.get(module_name)
            raise DependencyError(
                f"megatrain: the model's forward ({module_name}.{code.co_name}) takes fused_lm_head but is not "
                "TRL's fused LM head as this megatrain version knows it (trl 1.15-1.16); it would read lm_head.weight "
                "from host RAM. Fix: use a trl version with that form, or open an issue with your trl version."
            )
        forward = getattr(forward, "__wrapped__", None)
    return None


SUPPORTED_TRL = ((1, 15), (1, 17))
"""The trl versions megatrain trains exactly: >= 1.15, < 1.17 (pyproject.toml declares the same). Measured with
tests/integration/trl on each minor version from 1.14 (axolotl 0.21's pin) up: 1.14's SFTTrainer patches
``model.forward`` with a chunked loss that reads ``lm_head.weight`` (the host master) directly."""


def check_trl_version() -> None:
    """Refuse a trl outside the tested range, and trl 1.15 without Triton (its fused head calls its Triton
    kernel unconditionally, so it fails on a machine without Triton, with or without megatrain)."""
    import importlib.util

    import trl

    parts = tuple(int(p) for p in trl.__version__.split(".")[:2] if p.isdigit())
    low, high = SUPPORTED_TRL
    if not low <= parts < high:
        raise UnsupportedTrlError(
            f"megatrain: trl {trl.__version__} is outside the range megatrain trains exactly (>= "
            f"{'.'.join(map(str, low))}, < {'.'.join(map(str, high))}; trl 1.14 patches the model's forward with a "
            "chunked loss that reads lm_head.weight from host RAM, and older ones are not tested). Fix: pip install "
            "'trl>=1.15,<1.17', or open an issue with your trl version."
        )
    if parts < (1, 16) and importlib.util.find_spec("triton") is None:
        raise DependencyError(
            f"megatrain: trl {trl.__version__}'s fused LM head always runs its Triton kernel, and Triton is not "
            "installed here. Fix: pip install triton, or use trl 1.16 (which falls back to torch)."
        )


def check_trl_trainer(trainer: Any) -> None:
    """At attach of any TRL trainer (a Trainer subclass defined in ``trl``): its trl version is in the range."""
    if any(cls.__module__.split(".")[0] == "trl" for cls in type(trainer).__mro__):
        check_trl_version()


def check_model_forward(engine: Any, model: torch.nn.Module) -> None:
    """Refuse a per-instance ``forward`` of ``model`` that holds one of the engine's streamed modules or
    parameters (trl 1.14's chunked loss closes over ``lm_head``): it would compute with the host masters
    outside the streamed units. A forward that holds only the model itself (accelerate's autocast wrapper,
    TRL's fused head, megatrain's own) reaches the units through their streamed forwards: left alone."""
    from ..core.unit_callables import UnitRefs, find_reference

    forward = model.__dict__.get("forward")
    if forward is None:
        return
    modules = {id(m): m for unit in engine.units for m in unit.module.modules()}
    refs = UnitRefs(modules, frozenset(id(p) for unit in engine.units for p in unit.module.parameters()),
                    "the model", holders=False)
    path = find_reference(forward, refs)
    if path is None:
        return
    function = getattr(forward, "__func__", forward)
    where = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', '?')}"
    version = ""
    if where.startswith("trl."):
        import trl

        version = f" (trl {trl.__version__}; megatrain trains trl >= 1.15, < 1.17 exactly)"
    raise UnsupportedTrlError(
        f"megatrain: the forward of {type(model).__name__} was replaced by {where}{version}, which holds {path}: "
        "it would compute with the host masters outside megatrain's streamed units (wrong gradients, a race with "
        "the background update). Fix: with trl 1.14's SFTTrainer, SFTConfig(loss_type='nll') (the same loss; "
        "megatrain chunks it itself) or trl>=1.15,<1.17; otherwise leave the model's forward as transformers "
        "defines it."
    )


def adopt_fused_lm_head(engine: Any, model: torch.nn.Module) -> bool:
    """If TRL patched ``model`` with its fused LM head, serve it through ``engine``; returns whether it did."""
    found = _trl_fused_forward(model)
    if found is None:
        return False
    func, module = found
    check_trl_version()
    closure = dict(zip(func.__code__.co_freevars, (c.cell_contents for c in func.__closure__ or ())))
    differ = sorted(set(closure) ^ _CLOSURE) + [n for n in _MODULE_NAMES if not hasattr(module, n)]
    if differ:
        raise DependencyError(
            f"megatrain: TRL's fused LM head ({module.__name__}._fused_forward) is not the form this megatrain "
            f"version knows (differs in {differ}); it would read lm_head.weight from host RAM. Fix: use a trl "
            "version with the form of trl 1.15-1.16, or open an issue with your trl version."
        )
    if closure["cast_lm_head_to_fp32"]:
        raise IncompatibleOptionsError(
            "megatrain: TRL's fused LM head runs in fp32 here (cast_lm_head_to_fp32=True, e.g. "
            "GRPOConfig(cast_lm_head_to_fp32=True)); megatrain computes the head with the weights in the compute "
            "dtype. Fix: set cast_lm_head_to_fp32=False."
        )
    if type(engine.units[-1].module) is not torch.nn.Linear:
        raise IncompatibleOptionsError(
            f"megatrain: TRL's fused LM head with a wrapped lm_head ({type(engine.units[-1].module).__name__}, e.g. "
            "PEFT's modules_to_save=['lm_head']) is not supported: TRL reads the wrapper's weight directly. Fix: "
            "leave lm_head out of modules_to_save / target_modules, or train it with full fine-tuning."
        )
    previous = model.__dict__["forward"]  # TRL's forward, or a wrapper around it
    backbone = closure["backbone_attr"]
    # as TRL decides: trl 1.16 scores only the labelled positions where Triton runs, 1.15 always
    use_triton = getattr(module, "_use_triton", None)

    def forward(*args, fused_lm_head: bool = False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        if not fused_lm_head:
            return previous(*args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                            **kwargs)
        if kwargs.get("output_router_logits"):
            raise IncompatibleOptionsError(
                "megatrain: TRL's fused LM head with router logits (mixture of experts) is not supported")
        kwargs["use_cache"] = False
        outputs = getattr(model, backbone)(*args, **kwargs)
        if shift_labels is None:
            hidden, labels = outputs.last_hidden_state[:, :-1], labels[:, 1:]
        else:
            hidden, labels = outputs.last_hidden_state, shift_labels
        labels = labels.to(hidden.device)
        mask = labels != -100
        compact = use_triton(hidden.device) if use_triton is not None else True
        kernel = FusedLogProbs(
            function=module._ChunkedLogProbFunction,
            labels=labels[mask] if compact else labels.clamp(min=0).reshape(-1),
            temperature=closure["temperature"],
            chunk_size=module._CHUNKED_LOGPROB_CHUNK_SIZE,
            softcap=closure["final_logit_softcapping"],
            logit_scale=closure["logit_scale"],
            outputs=closure["outputs"],
        )
        flat = hidden[mask] if compact else hidden.reshape(-1, hidden.size(-1))
        log_probs = engine.head_loss(flat, kernel)
        entropy, *rest = kernel.extras
        if entropy is not None:
            log_probs, entropy = _EntropyBridge.apply(log_probs, entropy, kernel)
        per_token = [log_probs, entropy, *rest]
        if compact:
            per_token = [None if t is None else t.new_zeros(mask.shape).masked_scatter(mask, t) for t in per_token]
        else:
            per_token = [None if t is None else t.view(mask.shape).masked_fill(~mask, 0) for t in per_token]
        log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = per_token
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return module.FusedCausalLMOutput(
            loss=-log_probs.sum() / denominator, log_probs=log_probs, entropy=entropy,
            log_sum_sq_probs=log_sum_sq_probs, mean_logits=mean_logits, is_top1=is_top1, label_mask=mask,
            aux_loss=None,
        )

    # generate() reads the forward's signature (logits_to_keep, what to prepare); not functools.wraps:
    # its __wrapped__ would let the next train() find TRL's forward under this one and adopt it again
    forward.__signature__ = inspect.signature(previous)
    forward._megatrain_fused_lm_head = True
    engine.patcher.set_attr(model, "forward", forward)
    logger.info("megatrain: TRL's fused LM head runs in the streamed head unit (%s)", engine.units[-1].name)
    return True

"""Chunked head + cross-entropy: the loss of a causal LM without its full logits.

HF's causal-LM forward computes ``logits = lm_head(hidden)`` for every token, then the loss from
them (``logits.float()``, cross-entropy): tokens x vocab x (2 + 4 + 4) bytes alive until backward
(2.1 GB per 16K tokens at vocab 32000, and layer-major keeps every micro-batch's). With the
chunked loss, the model's forward runs its decoder as usual but the head and the loss run as one
streamed call of the head unit whose kernel (:class:`ChunkedLMLoss`) goes over the tokens in
chunks: forward keeps only the loss, backward recomputes each chunk's logits and produces the
gradients of the hidden states and of the head weight chunk by chunk.

The arithmetic is HF's, per token: the head matmul under the same autocast state, the family's
final logit soft-capping in the logits' dtype, ``cross_entropy`` on the fp32 logits, the sum
divided by ``num_items_in_batch`` (or the mean over labelled tokens), labels shifted by one with
``ignore_index`` padding (or ``shift_labels`` as given). With one chunk the operations are HF's
exactly; with several, the sums run chunk by chunk, so results equal HF's up to summation order
(fp32 rounding), and in bf16 the head's weight gradient is rounded per chunk instead of once.

The forward returned by :func:`chunked_forward` gives ``logits=None``: it is used only for
training forwards with labels (Trainer reads only the loss); evaluation and generation run the
model's own forward. It also gives way, at every forward, to the model's own forward (the full
logits through the streamed head unit, exactly HF's) while anything a user attached to the head or
the loss would not run in the kernel (:func:`customised`): a hook on the head module (forward,
pre-forward, backward; its own or torch's global module hooks), or a loss other than HF's causal-LM
cross-entropy (``model.loss_function = ...``, ``model.loss_type``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from torch.nn.modules import module as _torch_module

from ..core.layout import loss_chunk_tokens

logger = logging.getLogger(__name__)


@dataclass
class ChunkedLMLoss:
    """Kernel of the head unit's call: ``forward`` returns the loss, ``backward`` the gradients."""

    labels: torch.Tensor  # (tokens,) shifted targets, ignore_index where unlabelled
    denominator: torch.Tensor | float | None  # num_items_in_batch, or None: mean over labelled tokens
    ignore_index: int
    softcap: float | None
    chunk_tokens: int
    weight: str = "weight"
    bias: str = "bias"

    def _flat(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.reshape(-1, x.shape[-1]), self.labels.to(x.device)

    def _logits(self, h: torch.Tensor, tensors: dict[str, torch.Tensor], linear: list | None = None) -> torch.Tensor:
        logits = F.linear(h, tensors[self.weight], tensors.get(self.bias))
        if linear is not None:  # the head matmul's output, for its gradient
            linear.append(logits)
        if self.softcap is not None:  # as Gemma 2/3's forward does, in the logits' dtype
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def _chunk_loss(self, h: torch.Tensor, labels: torch.Tensor, tensors: dict[str, torch.Tensor],
                    linear: list | None = None) -> torch.Tensor:
        # every token of the chunk, ignored ones included (they add 0), as HF's cross_entropy sums
        return F.cross_entropy(self._logits(h, tensors, linear), labels, ignore_index=self.ignore_index,
                               reduction="sum")

    def _scale(self, total: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.denominator is None:  # cross_entropy's "mean": nan without labelled tokens, as in HF
            return total / (labels != self.ignore_index).sum()
        denominator = self.denominator
        if torch.is_tensor(denominator):
            denominator = denominator.to(total.device)
        return total / denominator

    def forward(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden, labels = self._flat(x)
        total = None
        for start in range(0, hidden.shape[0], self.chunk_tokens):
            stop = start + self.chunk_tokens
            loss = self._chunk_loss(hidden[start:stop], labels[start:stop], tensors)
            total = loss if total is None else total + loss
        return self._scale(total, labels)

    lands_in_place = True  # backward takes ``into`` (runtime/grads_in_place.py)

    def backward(
        self, x: torch.Tensor, tensors: dict[str, torch.Tensor], leaves: list[str], grad_out: torch.Tensor,
        into: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Gradients of ``loss * grad_out`` w.r.t. the hidden states and the ``leaves`` tensors.

        ``into``: fp32 tensors (the host accumulators, shaped like the leaves) that the sums of the
        leaves they name are computed in, and returned as: the first chunk's gradient copied, the next
        added, the same fp32 arithmetic as a sum of its own. With fp32 compute the weight's first chunk
        gradient is written there by the product itself: autograd's ``grad.t().mm(h)`` of the head
        matmul, taken from the logits' gradient (no temporary of the weight's size)."""
        into = into or {}
        hidden, labels = self._flat(x)
        # d(loss)/d(a chunk's summed cross-entropy) x grad_out, as autograd computes it through the division
        seed = self._scale(grad_out.to(torch.float32).reshape(()), labels)
        grad_hidden = torch.empty_like(hidden) if x.requires_grad else None
        sums: dict[str, torch.Tensor] = {}
        weight = tensors.get(self.weight)
        direct = (self.weight in into and self.weight in leaves and weight.dtype == hidden.dtype == torch.float32
                  and weight.is_contiguous() and not torch.is_autocast_enabled(hidden.device.type))
        if direct:  # the weight enters the graph detached; its gradient is computed below
            tensors = {**tensors, self.weight: weight.detach()}
            leaves = [name for name in leaves if name != self.weight]
        params = [tensors[name] for name in leaves]
        for start in range(0, hidden.shape[0], self.chunk_tokens):
            stop = start + self.chunk_tokens
            h = hidden[start:stop].detach().requires_grad_(grad_hidden is not None or direct)
            with torch.enable_grad():
                linear: list[torch.Tensor] = []
                loss = self._chunk_loss(h, labels[start:stop], tensors, linear)
                inputs = ([h] if grad_hidden is not None else []) + params + (linear if direct else [])
                grads = torch.autograd.grad(loss, inputs, seed, allow_unused=True)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grads[0]
                grads = grads[1:]
            if direct:
                *grads, grad_logits = grads
                product = (grad_logits.t(), h.detach())
                if self.weight in sums:
                    sums[self.weight].add_(torch.mm(*product))
                else:
                    sums[self.weight] = torch.mm(*product, out=into[self.weight])
                del product, grad_logits
            for name, g in zip(leaves, grads):
                if g is None:
                    continue
                if name in sums:
                    sums[name].add_(g)  # fp32 += (bf16 or fp32): exact conversion, one rounding
                elif name in into:  # the accumulator is the sum: no fp32 copy of a bf16 gradient besides it
                    sums[name] = into[name].copy_(g)
                else:  # autograd's own fresh tensor: kept as the sum (fp32) instead of copied once more
                    sums[name] = g if g.dtype == torch.float32 else g.to(torch.float32)
            g = None
            del h, loss, inputs, grads, linear  # this chunk's graph and gradients go before the next chunk's
        return (grad_hidden.view_as(x) if grad_hidden is not None else None), sums


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                      "_global_backward_hooks")


def customised(base: torch.nn.Module, head: torch.nn.Module) -> str | None:
    """What a user attached to the head or the loss that the chunked kernel would not run, or None.

    Read at every forward (hooks and the loss can be set at any time): hooks on the head module, torch's
    global module hooks (they fire on the head too), and a ``loss_function`` other than HF's causal-LM
    cross-entropy (transformers' setter, or ``loss_type`` naming another loss)."""
    hooks = [name for name in _HOOK_DICTS if getattr(head, name, None)]
    if hooks:
        return f"the lm_head has hooks ({', '.join(hooks)})"
    hooks = [name for name in _GLOBAL_HOOK_DICTS if getattr(_torch_module, name, None)]
    if hooks:
        return f"global module hooks are registered ({', '.join(hooks)})"
    from transformers.loss.loss_utils import LOSS_MAPPING

    loss_function = getattr(base, "loss_function", None)
    if loss_function is not None and loss_function is not LOSS_MAPPING.get("ForCausalLM"):
        name = getattr(loss_function, "__qualname__", None) or type(loss_function).__name__
        return f"the model's loss_function is {name}, not transformers' causal-LM cross-entropy"
    return None


def chunked_forward(base: torch.nn.Module, original: Callable, chunk: int | None,
                    head_loss: Callable[[torch.Tensor, ChunkedLMLoss], torch.Tensor],
                    active: Callable[[], bool]) -> Callable:
    """A replacement for ``base.forward`` that computes the training loss chunk by chunk.

    ``head_loss(hidden, kernel)`` runs the kernel as the head unit's streamed call; ``active()``
    says whether the chunked loss applies now (the integration decides). Used when the module is
    training, gradients are enabled and ``labels`` are given as a keyword (positional arguments and
    ``return_dict=False`` route to the original forward). ``logits_to_keep`` is ignored there: no
    logits are returned. Hooks on the head (``get_output_embeddings()``) and the model's loss function
    make the forward give way to the original one (:func:`customised`), logged at INFO once per reason.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    config = base.config
    softcap = getattr(config, "final_logit_softcapping", None)
    vocab = config.vocab_size
    reported: set[str] = set()

    @functools.wraps(original)
    def forward(*args, **kwargs):
        labels = kwargs.get("labels")
        if (
            not active()
            or args
            or labels is None
            or not base.training
            or not torch.is_grad_enabled()
            or kwargs.get("return_dict") is False
        ):
            return original(*args, **kwargs)
        reason = customised(base, base.get_output_embeddings())
        if reason is not None:
            if reason not in reported:
                reported.add(reason)
                logger.info("megatrain: %s; the loss is computed from the full logits (HF's forward through the "
                            "streamed head) instead of the chunked loss, so that it runs.", reason)
            return original(*args, **kwargs)
        kwargs = dict(kwargs)
        labels = kwargs.pop("labels")
        kwargs.pop("logits_to_keep", None)
        shift_labels = kwargs.pop("shift_labels", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        num_items = kwargs.get("num_items_in_batch")  # also passed on, as HF passes its kwargs
        outputs = base.get_decoder()(**kwargs)
        hidden = outputs[0]
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        kernel = ChunkedLMLoss(
            labels=shift_labels.reshape(-1),
            denominator=num_items,
            ignore_index=ignore_index,
            softcap=softcap,
            chunk_tokens=loss_chunk_tokens(chunk, vocab),
        )
        loss = head_loss(hidden, kernel)
        return CausalLMOutputWithPast(
            loss=loss, logits=None, hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
        )

    return forward

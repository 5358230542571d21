"""Model FLOPs of one training token for a model shape, by the project's named conventions (``stats.py``).

Conventions (Chowdhery et al. 2022, "PaLM", Appendix B; the MFU estimate of nanoGPT)::

    "palm":         FLOPs per token = 6 * N + 12 * L * H * Q * S   (result key "tflops")
    "palm_causal":  FLOPs per token = 6 * N +  6 * L * H * Q * S   (result key "tflops_causal")

- ``N``: the model's parameters, excluding the input-embedding lookup table (a lookup does no
  multiply-adds). The LM head is a matmul and counts; a table tied to the LM head is one tensor
  and counts once, as the head. Of a mixture-of-experts layer's routed experts only the
  ``experts_per_token`` each token is computed with count (the activated parameters).
- ``6 * N``: forward (2 per parameter per token) plus backward (4).
- ``12 * L * H * Q * S``: the attention score and value matmuls (``QK^T`` and ``AV``), forward and
  backward, with ``L`` layers, ``H`` query heads, ``Q`` the head dimension and ``S`` the sequence
  length. ``"palm"`` counts causal attention in full (as PaLM does); ``"palm_causal"`` halves the
  term: a causal kernel computes the lower triangle of the scores only. At long sequences the two
  differ by up to 2x (at 512K tokens of a 7 B model attention is 91% of the "palm_causal" FLOPs).
- Activation recompute is NOT counted: this is the model's work, the same for every system, so a
  system that recomputes more does not look faster for it. Nor are the optimizer, norms,
  activations or the loss.

``TFLOPS = model_flops_per_token(shape, S) * tokens per optimizer step / step time / 1e12``.
"""

from __future__ import annotations

from ..errors import MegatrainConfigError
from ..memory import ModelShape
from ..stats import FLOPS_CONVENTIONS
from ..stats import model_flops_per_token as _per_token

FLOPS_CONVENTION = (
    "TFLOPS = model FLOPs per token x tokens per optimizer step / mean step time / 1e12, PaLM's convention "
    "(Chowdhery et al. 2022, App. B): FLOPs per token = 6*N + 12*L*H*Q*S, N the parameters without the "
    "input-embedding table (a tied table counts once, as the LM head), L layers, H query heads, Q head dim, "
    "S sequence length; causal attention counted in full; activation recompute not counted. tflops_causal: "
    "the same with the attention term halved for causal attention (6*N + 6*L*H*Q*S, convention 'palm_causal')"
)
CONVENTIONS = FLOPS_CONVENTIONS
"""Named conventions: ``palm`` (``tflops``) and ``palm_causal`` (``tflops_causal``)."""


def non_embedding_params(shape: ModelShape) -> int:
    """``N``: every parameter except the input-embedding lookup table (kept when it is the tied head);
    of the routed experts, the ``experts_per_token`` a token is computed with."""
    n = shape.params() - (0 if shape.tied else shape.vocab * shape.hidden) - shape.positions * shape.hidden
    for layer in range(shape.layers):
        routed = sum(v for k, v in shape.expert_tensors(layer).items() if k.startswith("experts."))
        n -= routed - routed // shape.experts * shape.experts_per_token if routed else 0
    return n


def model_flops_per_token(shape: ModelShape, seq_len: int, trainable: int | None = None,
                          convention: str = "palm") -> int:
    """``6 * N + 12 * L * H * Q * S`` for one token of a sequence of ``seq_len`` (exact integer);
    ``6 * L * H * Q * S`` of attention with ``convention="palm_causal"``.

    ``trainable``: the parameters that train when not all of them do (LoRA: the adapters, whose
    matmuls count too); the frozen ones cost no weight-gradient matmul: ``4 * N + 2 * trainable``
    plus ``6 * trainable`` for the adapters' own work, as ``stats.py`` counts it."""
    if seq_len < 1:
        raise MegatrainConfigError(f"seq_len={seq_len}: must be >= 1")
    n = non_embedding_params(shape)  # full fine-tuning: every one of them trains
    if trainable is not None:
        return int(_per_token(n + trainable, trainable, shape.layers, shape.heads, shape.dim_head, seq_len,
                              convention))
    return int(_per_token(n, n, shape.layers, shape.heads, shape.dim_head, seq_len, convention))


def model_flops_per_step(shape: ModelShape, seq_len: int, tokens_per_step: int, trainable: int | None = None,
                         convention: str = "palm") -> int:
    """Model FLOPs of one optimizer step of ``tokens_per_step`` tokens in sequences of ``seq_len``."""
    return model_flops_per_token(shape, seq_len, trainable, convention) * tokens_per_step

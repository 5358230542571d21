"""The chunked loss's options (part of ``MegaTrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal


def _positive_or_none(name: str, value) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"MegaTrainConfig.{name}={value!r}; allowed: None (automatic) or an int >= 1.")


@dataclass(kw_only=True)
class LossOptions:
    chunked_loss: bool | Literal["auto"] = "auto"
    """Compute the training loss without the full logits: the head and the cross-entropy run
    chunk by chunk over the tokens (forward keeps only the loss; backward recomputes each chunk),
    so tokens x vocab logits never exist at once. Applies to training forwards with `labels`;
    such forwards then return `logits=None`. `"auto"`: on under plain `transformers.Trainer`
    (which reads only the loss), off for Trainer subclasses (they may read the logits; TRL's
    `SFTTrainer` brings its own chunked fused LM head, which the plugin runs in the streamed head
    unit) and for `attach()` in your own loop; `True`: always; `False`: never."""

    loss_chunk_tokens: Annotated[int | None, _positive_or_none] = None
    """Tokens per chunk of the chunked loss. `None`: about 2^26 logits per chunk (256 MB of fp32
    logits)."""

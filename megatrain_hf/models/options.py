"""The chunked loss's and the quantized base's options (part of ``MegaTrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from ..errors import MegatrainConfigError


def _positive_or_none(name: str, value) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise MegatrainConfigError(f"MegaTrainConfig.{name}={value!r}; allowed: None (automatic) or an int >= 1.")


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


def _check_scheme(name: str, value) -> None:
    if value not in ("none", "int8", "nf4"):
        raise MegatrainConfigError(
            f"MegaTrainConfig.{name}={value!r}; allowed: 'none', 'int8' (LLM.int8 row-wise absmax) or 'nf4' "
            "(bitsandbytes NF4, blocks of 64, double-quantized absmax). fp4 and other schemes are not supported: "
            "use 'nf4' for 4-bit."
        )


@dataclass(kw_only=True)
class QuantOptions:
    base_quantization: Annotated[Literal["none", "int8", "nf4"], _check_scheme] = "none"
    """Store the frozen base weights of PEFT-wrapped Linear layers (LoRA) quantized in host RAM:
    `"nf4"` (bitsandbytes' NF4: 0.52 B/param) or `"int8"` (LLM.int8 row-wise absmax: 1 B/param),
    quantized once as they are loaded, streamed quantized (a quarter or half of the bf16 link
    bytes) and dequantized on the device right before the unit computes, bit for bit as
    bitsandbytes dequantizes. Adapters and `modules_to_save` keep fp32 masters and exact AdamW.
    `"none"`: the base stays in the compute dtype. See docs/qlora.md."""

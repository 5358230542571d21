"""What no integration can combine with megatrain, refused with the same words everywhere."""

from __future__ import annotations

from ..errors import IncompatibleOptionsError


def check_precision_and_sharding(*, fp16: bool, deepspeed=None, fsdp=None) -> None:
    if fp16:
        raise IncompatibleOptionsError(
            "fp16 mixed precision (TrainingArguments(fp16=True) / mixed_precision='fp16') is not supported by "
            "megatrain: it needs loss scaling of host-resident gradients. Use bf16 (TrainingArguments(bf16=True), "
            "mixed_precision='bf16') on GPUs that have it, or fp32."
        )
    if deepspeed:
        raise IncompatibleOptionsError(
            "megatrain and DeepSpeed both want to own the parameters and the optimizer step; use one. "
            "Remove `deepspeed=` from TrainingArguments / the DeepSpeed section of the accelerate config "
            "(or drop the MegaTrainPlugin)."
        )
    if fsdp:
        raise IncompatibleOptionsError(
            f"megatrain and FSDP (fsdp={fsdp!r}) both want to own the parameters; use one. Remove `fsdp=` "
            "from TrainingArguments / the FSDP section of the accelerate config (or drop the MegaTrainPlugin)."
        )

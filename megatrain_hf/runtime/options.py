"""The runtime's options (part of ``MegaTrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from ..errors import MegatrainConfigError


def _compile_backend(name: str, value) -> None:
    if not isinstance(value, str) or not value:
        raise MegatrainConfigError(f"MegaTrainConfig.{name}={value!r}; allowed: a torch.compile backend name, "
                                   "e.g. 'inductor' or 'aot_eager'.")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or (isinstance(value, int) and value < 1):
        raise MegatrainConfigError(f"MegaTrainConfig.{name}={value!r}; allowed: an int >= 1"
                                   + (", 'auto' or None." if name == "sequence_tile_tokens" else "."))


@dataclass(kw_only=True)
class RuntimeOptions:
    layer_major: bool | Literal["auto"] = "auto"
    """Gradient accumulation order under Trainer with `gradient_accumulation_steps > 1`: `True`
    runs all micro-batches of an optimizer step through each layer before the next (each layer
    uploaded twice per step instead of twice per micro-batch, its gradients summed on the GPU and
    downloaded once); `False` runs them one after another as plain Trainer does. `"auto"`: layer-major
    unless the model has dropout (its random masks would then be drawn in a different order than
    plain Trainer draws them), a module inside a layer (or torch's global module hooks) has forward,
    pre-forward or backward hooks (they may draw random numbers; transformers' output capture and
    megatrain's own hooks do not count), a parameter has tensor hooks (they run once per micro-batch), or the
    Trainer subclass overrides `training_step` (its per-call state would see another order).
    Activation checkpoints of all micro-batches of a step are alive at once on the GPU (see
    docs/memory.md)."""

    sequence_tile_tokens: Annotated[int | Literal["auto"] | None, _positive_int] = "auto"
    """Tokens per tile of a decoder layer's MLP inside its streamed compute and recompute: the MLP
    runs over that many tokens at a time (its backward recomputes and back-propagates tile by tile),
    so its `tokens x intermediate` activations exist for one tile only. Exact: the MLP is per-token
    math (the weights' gradients are summed over the tiles in fp32), but it costs one more MLP
    forward per layer in the backward. `"auto"`: no tiling while the whole MLP's working set
    (`6 x tokens x intermediate x 2` bytes in bf16) is at most 4 GiB (10% of `max_gpu_memory` when
    set) or a micro-batch has no more tokens than one tile; else tiles of `max(hidden, 4096)`
    tokens, fewer when `max_gpu_memory` is set and a tile's MLP working set would take more than 2%
    of it (see docs/long-context.md); an int: that tile; `None`: never tiled. Applies to MLPs built of
    `nn.Linear` layers without dropout or hooks (mixture-of-experts blocks run whole)."""

    checkpoint_interval: Annotated[int | Literal["auto"], _positive_int] = "auto"
    """Keep the activation checkpoint (the input) of every k-th decoder layer only; the backward
    recomputes the inputs of the layers in between from the last kept one (one more forward of
    those layers, their weights fetched once more) and holds them for the block's backward. `1`:
    every unit keeps its checkpoint. Cuts the checkpoint bytes (on the GPU, or on the host with
    `offload_checkpoints`) by about k at the cost of ~(k-1)/k of a forward per step. `"auto"` (the
    default): 1, or with `max_seq_len` the interval of the placement planned for that length
    ([long context](long-context.md))."""

    def resolve_checkpoint_interval(self) -> int:
        """``checkpoint_interval`` as a number (``"auto"`` without ``max_seq_len``'s placement: 1)."""
        return 1 if self.checkpoint_interval == "auto" else self.checkpoint_interval

    compile: bool = False
    """Regional compilation: `torch.compile` of the decoder layers' shared template, compiled once
    per shape for the forward and once for the backward's recompute and reused by every layer
    (`TrainingArguments(torch_compile=True)` turns it on under Trainer, with its backend and mode;
    the whole model is then not compiled). Calls whose compiled form could differ run eagerly: the
    embedding, final norm and head, sequence-tiled MLPs, units with active hooks. Graphs, graph
    breaks and recompiles are reported as `megatrain/compile_*` metrics. Refused with dropout in
    training (the compiled forward and its recompute would draw other random numbers than eager)."""

    compile_backend: Annotated[str, _compile_backend] = "inductor"
    """The `torch.compile` backend of `compile=True` (`TrainingArguments.torch_compile_backend`)."""

    compile_mode: Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"] | None = None
    """The `torch.compile` mode of `compile=True` (`TrainingArguments.torch_compile_mode`); the modes
    that capture CUDA graphs (`"reduce-overhead"`, `"max-autotune"`) are refused."""

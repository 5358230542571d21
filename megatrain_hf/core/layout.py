"""Where each tensor of a unit lives: its kind, its wire dtype and its place in the unit's flats.

One layout rule serves the host store (which allocates the flats) and the memory planner (which
counts their bytes before anything exists), so the two cannot disagree.

Per unit, the trainable parameters share one fp32 flat (the *master*; the gradient accumulator and
the AdamW moments have the same layout): first the tensors that cross the link in the compute
dtype (their *staging* copy covers ``master[:n_staged]``), then the fp32-wire ones, each starting
on a 64-byte boundary. Frozen parameters (PEFT base weights) live in one flat per wire dtype; a
quantized one (``quant.py``) is a byte range of the ``uint8`` frozen flat.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .frozen_formats import QuantFormat

ALIGN_ELEMS = 16
"""Every tensor starts on a 64-byte boundary inside its flat (16 fp32 elements)."""

LOSS_CHUNK_ELEMENTS = 1 << 26
"""Logits per chunk of the chunked loss when ``loss_chunk_tokens`` is not set (256 MB in fp32); the
memory planner sizes the GPU's logits from it."""


def aligned(n: int) -> int:
    """``n`` elements rounded up to the alignment."""
    return (n + ALIGN_ELEMS - 1) // ALIGN_ELEMS * ALIGN_ELEMS


def loss_chunk_tokens(configured: int | None, vocab: int) -> int:
    """Tokens per chunk of the chunked loss: ``configured``, else about ``LOSS_CHUNK_ELEMENTS`` logits."""
    if configured is not None:
        return configured
    return max(1, LOSS_CHUNK_ELEMENTS // max(1, vocab))


class Kind(enum.Enum):
    """What the store keeps for a tensor."""

    TRAINABLE = "trainable"  # fp32 master, gradient accumulator, optimizer state
    FROZEN = "frozen"  # one copy in its wire dtype (no gradient, no state)
    BUFFER = "buffer"  # a module buffer: uploaded once, kept on the device


def is_lora_name(name: str) -> bool:
    """PEFT's LoRA matrices (``...lora_A.default.weight``)."""
    return ".lora_" in f".{name}"


def is_norm_name(name: str) -> bool:
    """A parameter of a normalisation module (``q_norm.weight``, ``input_layernorm.weight``): its
    module's name says so, as every transformers family names them."""
    return any("norm" in part.lower() for part in name.split(".")[:-1])


EXPERTS_KERNELS_FOLLOWING_AUTOCAST = frozenset({"eager"})
"""Experts kernels (transformers' ``config._experts_implementation``) whose arithmetic on compute-dtype
weights is autocast's on fp32 ones: ``eager`` runs ``F.linear`` on one expert's slice at a time
(autocast rounds the slice; the slice's backward adds nothing). Not ``grouped_mm`` (transformers'
default: not autocast-enabled, it casts its input to the weights' dtype, so plain bf16 training
computes the experts in fp32, pytorch/pytorch#174763) nor ``batched_mm`` (it gathers the experts'
rows per token before ``bmm`` casts them: on bf16 weights the gather's backward would sum their
gradients in bf16), nor a kernel not known here. Measured on the CPU, tiny Mixtral, 6 bf16 Trainer
steps with bf16 experts against plain: eager 0.0, batched_mm 2.1e-4 and grouped_mm 5.9e-4 in the loss."""


def experts_in_fp32(kernel: str | None, experts_dtype: str) -> bool:
    """Whether routed experts computed by ``kernel`` cross the link (and compute) in fp32 under bf16
    compute: ``experts_dtype="auto"`` (``MegaTrainConfig.experts_dtype``) and a kernel that does not
    follow autocast, so that plain bf16 training computes them with the fp32 masters. ``kernel``
    None: no routed experts."""
    return kernel is not None and experts_dtype == "auto" and kernel not in EXPERTS_KERNELS_FOLLOWING_AUTOCAST


def wire_dtype(
    dtype: torch.dtype, ndim: int, compute_dtype: torch.dtype, *, embedding: bool, name: str = "",
    fp32: bool = False,
) -> torch.dtype:
    """The dtype a tensor crosses the link in, and is computed with.

    Matrices travel in the compute dtype; vectors (norms, biases), norm weights of any shape
    (Cohere's per-head q/k norms are ``heads x head_dim``), embedding tables and PEFT LoRA matrices
    (PEFT casts the adapter's input to their dtype, so a bf16 copy would move LoRA dropout and its
    backward to bf16) in fp32. This is what autocast does to an fp32 model -- matmul weights
    rounded to bf16, embeddings, norms and the residual stream in fp32 -- which is why bf16 runs
    match plain HF bf16 training instead of drifting with a bf16 residual stream. ``fp32``: a
    tensor the model computes with as it is under autocast (routed experts whose kernel ignores
    autocast, :func:`experts_in_fp32`): fp32 whatever its shape.
    """
    if not dtype.is_floating_point:
        return dtype
    if ndim >= 2 and not embedding and not fp32 and not is_lora_name(name) and not is_norm_name(name):
        return compute_dtype
    return torch.float32


@dataclass(eq=False)
class Entry:
    """One tensor a unit needs at compute time."""

    name: str  # dotted name inside the unit's module ("self_attn.q_proj.weight")
    tensor: torch.Tensor  # the registered Parameter (or buffer) of the real module
    kind: Kind
    owner: int  # the unit whose flat holds it (a tied weight lives in one place)
    wire: torch.dtype
    offset: int = 0  # element offset inside the owner's master (trainable) or frozen flat
    shape: torch.Size = field(default_factory=torch.Size)
    quant: QuantFormat | None = None  # a quantized frozen weight: ``numel`` bytes of the uint8 frozen flat

    @property
    def numel(self) -> int:
        """Elements of its flat it occupies (bytes for a quantized weight)."""
        return self.quant.nbytes if self.quant is not None else self.tensor.numel()

    @property
    def source(self) -> tuple[Kind, torch.dtype]:
        """Which host flat of the owner it is sent from (see ``HostStore.source``)."""
        return (Kind.FROZEN if self.kind is Kind.FROZEN else Kind.TRAINABLE, self.wire)


@dataclass
class TensorSpec:
    """What the layout needs to know of a tensor (a real parameter, or one the planner imagines)."""

    numel: int
    trainable: bool
    wire: torch.dtype
    offset: int = 0  # set by :func:`lay_out`


@dataclass
class UnitSizes:
    """Element counts of one unit's flats."""

    n_train: int = 0  # master (= gradient = each moment) elements, alignment included
    n_staged: int = 0  # master[:n_staged] crosses the link in the compute dtype (its staging copy)
    frozen: dict[torch.dtype, int] = field(default_factory=dict)  # wire dtype -> frozen flat elements
    train_numels: list[int] = field(default_factory=list)  # each trainable tensor's elements (its own blocks)


def lay_out(specs: list[TensorSpec]) -> UnitSizes:
    """Assign every spec its offset in the unit's flats; return the flats' sizes."""
    sizes = UnitSizes()
    staged = [s for s in specs if s.trainable and s.wire != torch.float32]
    fp32 = [s for s in specs if s.trainable and s.wire == torch.float32]
    for s in staged:
        s.offset = sizes.n_train
        sizes.n_train += aligned(s.numel)
    sizes.n_staged = sizes.n_train
    for s in fp32:
        s.offset = sizes.n_train
        sizes.n_train += aligned(s.numel)
    sizes.train_numels = [s.numel for s in staged + fp32]
    for s in specs:
        if not s.trainable:
            s.offset = sizes.frozen.get(s.wire, 0)
            sizes.frozen[s.wire] = s.offset + aligned(s.numel)
    return sizes


MOMENT_FORMATS = {"fp32": (32, 0), "bf16": (16, 0), "8bit": (8, 256), "4bit": (4, 128)}
"""``optimizer_state`` -> (bits per element, elements per fp32 block scale; 0: none) of HostAdamW's
moments (the formats themselves: ``optim/moment_formats.py``)."""

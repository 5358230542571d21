"""The memory plan: host bytes per tier (exact), GPU bytes (estimate), what fits.

Planned from a model's shape alone, with the host store's own layout rule (``core/layout.py``),
so the plan and the store cannot disagree. The check before allocating is ``host.py``'s.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from ..errors import IncompatibleOptionsError, MegatrainConfigError
from ..core.grads import MAX_PENDING_SENDS
from ..core.layout import MOMENT_FORMATS, aligned
from ..core.layout import loss_chunk_tokens as loss_chunk
from ..core.frozen_formats import DEQUANT_CHUNK_ELEMENTS, DEQUANT_TEMP_BYTES
from . import activations
from .host import DEFAULT_HEADROOM_BYTES, TIER_LABELS, GiB, _check_int, check_host_memory, gib
from .model_layout import LORA_TARGETS, _host_tiers, _layout, _UnitLayout, _wire_bytes  # noqa: F401 (re-exported)
from .shapes import ModelShape

logger = logging.getLogger(__name__)

GPU_RUNTIME_ALLOWANCE_BYTES = 1 * GiB
"""Fixed GPU allowance for the CUDA context, cuBLAS/cuDNN workspaces and allocator slack."""

_COMPUTE_BYTES = {"bf16": 2, "bfloat16": 2, "fp32": 4, "float32": 4}
_DTYPE_BY_NAME = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


# ---------------------------------------------------------------------------------------- plan
@dataclass(kw_only=True)
class MemoryPlan:
    """Bytes per memory tier of one training configuration. Build with :func:`plan_memory`.

    Host numbers are exact for the store's layout. GPU numbers are an estimate, summed over
    items that do not all peak at the same moment (so on the safe side), assuming SDPA/flash
    attention (no ``seq x seq`` score matrix; ``attn_implementation="eager"`` needs
    ``micro_batch * heads * seq^2 * ~6 B`` more) and a Llama-style layer. Only
    ``gpu_checkpoints`` grows with the number of layers.
    """

    shape: ModelShape
    """The model planned for."""
    seq_len: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per micro-batch (per forward/backward)."""
    grad_accum: int
    """Micro-batches per optimizer step."""
    micro_batches_in_flight: int
    """Micro-batches whose activation checkpoints live on the GPU at once: 1 for the per-micro-batch
    schedule, ``grad_accum`` for the layer-major schedule."""
    compute_dtype: str
    """``"bf16"`` or ``"fp32"``: dtype of the streamed matrices and of the compute."""
    lora_rank: int | None
    """LoRA rank when only adapters train (base weights frozen); ``None`` for full fine-tuning."""
    total_params: int
    """Every parameter of the model (tied counted once), adapters included."""
    trainable_params: int
    """Parameters with master, gradient and AdamW state."""
    frozen_params: int
    """Parameters held once in their wire dtype (LoRA base weights)."""

    host_master: int
    """fp32 master weights: 4 B per trainable parameter."""
    host_grad: int
    """Gradient accumulators: 4 B per trainable parameter (2 B for the layers' matrices with
    ``grad_dtype="bf16"``)."""
    host_exp_avg: int
    """AdamW first moment: 4 B per trainable parameter in fp32 (bf16 2, 8bit ~1.02, 4bit ~0.53)."""
    host_exp_avg_sq: int
    """AdamW second moment: as ``host_exp_avg``."""
    host_staging: int
    """Compute-dtype copy of trainable matrices of layers and lm_head (2 B each in bf16, none in fp32)."""
    host_frozen: int
    """Frozen weights in their wire dtype (2 B for bf16 matrices, 4 B for vectors/embedding/fp32), or
    quantized (``base_quantization``: 0.52 B per NF4, 1 B per int8 parameter)."""
    host_checkpoints: int
    """With ``offload_checkpoints``: every activation checkpoint of the micro-batches in flight, in
    pinned host buffers (what ``gpu_checkpoints`` would hold otherwise); 0 without."""

    gpu_weight_slots: int
    """Two slots of the largest unit's weights in wire dtype: the unit computing + the one prefetched."""
    sequence_tile_tokens: int | None = None
    """Tokens per MLP tile (``sequence_tile_tokens`` resolved for this batch); None: untiled."""
    checkpoint_interval: int = 1
    """Every k-th unit keeps its checkpoint (``checkpoint_interval``)."""
    gpu_recomputed_inputs: int = 0
    """With ``checkpoint_interval=k``: the k-1 recomputed inputs of the block being back-propagated."""
    gpu_checkpoints: int
    """Activation checkpoints: one fp32 ``tokens x hidden`` tensor per decoder layer (plus the final
    norm's and lm_head's inputs) per micro-batch in flight. The only item that grows with depth."""
    gpu_layer_working_set: int
    """Recomputing one decoder layer with grad: q/k/v, attention output, MLP gate/up/activation
    intermediates in the compute dtype, the fp32 residual-stream/norm tensors and the fp32
    gradients flowing in and out, for ``micro_batch * seq_len`` tokens."""
    gpu_weight_grads: int
    """Gradients of the largest unit's trainable weights in fp32 (an upper bound: autograd returns
    them in the wire dtype), ``MAX_PENDING_SENDS + 2`` times: the units queued on the grad stream
    keep theirs until their copies end, plus the unit computing and, for a later contribution of
    the step, the accumulator they are added to on the device."""
    gpu_logits: int
    """Loss: logits in the compute dtype (kept in the model output) + fp32 log-probabilities + two
    fp32 gradients, ``tokens x vocab`` each."""
    gpu_runtime: int
    """Fixed allowance: CUDA context, cuBLAS workspaces, allocator slack."""
    base_quantization: str = "none"
    """How the LoRA-adapted base weights are stored and streamed (``"none"``, ``"int8"``, ``"nf4"``)."""
    gpu_dequant: int = 0
    """With ``base_quantization``: the largest unit's quantized weights dequantized to the compute
    dtype (the resident unit's flat), plus the fp32 values and int32 codes of one dequantization chunk."""
    optimizer_state: str = "fp32"
    """Format of the AdamW moments planned (``MegaTrainConfig.optimizer_state``)."""
    grad_dtype: str = "fp32"
    """The gradient accumulators' dtype planned (``MegaTrainConfig.grad_dtype``)."""
    experts_dtype: str = "auto"
    """The routed experts' dtype planned (``MegaTrainConfig.experts_dtype``): fp32 on the wire and in the
    GPU's weight slots where ``"auto"`` and the shape's experts kernel ignores autocast; no staging copy of them."""

    # -------------------------------------------------------------- totals
    @property
    def host_total(self) -> int:
        """All host bytes of the store and the optimizer."""
        return sum(self.host_breakdown().values())

    @property
    def gpu_total(self) -> int:
        """Estimated peak GPU bytes (sum of the items)."""
        return sum(self.gpu_breakdown().values())

    @property
    def bytes_per_trainable_param(self) -> float:
        """Host bytes of the trainable tiers (master, grad, moments, staging) per trainable parameter:
        16 in fp32, ~18 in bf16 (16 + 2 for the staging copy of the matrices). Offloaded
        checkpoints (they follow the batch) are not a per-parameter cost."""
        trainable = self.host_total - self.host_frozen - self.host_checkpoints
        return trainable / self.trainable_params if self.trainable_params else 0.0

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch

    def host_breakdown(self) -> dict[str, int]:
        """``{tier: bytes}`` for :func:`check_host_memory`."""
        return {
            "master": self.host_master,
            "grad": self.host_grad,
            "exp_avg": self.host_exp_avg,
            "exp_avg_sq": self.host_exp_avg_sq,
            "staging": self.host_staging,
            "frozen": self.host_frozen,
            "checkpoints": self.host_checkpoints,
        }

    def gpu_breakdown(self) -> dict[str, int]:
        return {
            "weight_slots": self.gpu_weight_slots,
            "checkpoints": self.gpu_checkpoints,
            "recomputed_inputs": self.gpu_recomputed_inputs,
            "layer_working_set": self.gpu_layer_working_set,
            "weight_grads": self.gpu_weight_grads,
            "logits": self.gpu_logits,
            "runtime": self.gpu_runtime,
            **({"dequant": self.gpu_dequant} if self.base_quantization != "none" else {}),
        }

    def check_host(self, available: int | None = None, headroom_bytes: int = DEFAULT_HEADROOM_BYTES) -> int:
        """:func:`check_host_memory` for this plan; returns the bytes to spare."""
        return check_host_memory(self.host_total, self.host_breakdown(), available, headroom_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = self.shape.to_dict()
        d["host_total"] = self.host_total
        d["gpu_total"] = self.gpu_total
        d["bytes_per_trainable_param"] = self.bytes_per_trainable_param
        return d

    def table(self) -> str:
        """A readable, aligned text table (GiB, and bytes per parameter for the host tiers)."""
        s = self.shape
        tokens = self.tokens_per_micro_batch
        lora = f", LoRA r={self.lora_rank}" if self.lora_rank is not None else ""
        if self.base_quantization != "none":
            lora += f" on a {self.base_quantization} base"
        lines = [
            f"memory plan: {s.name or 'model'}  ({self.total_params / 1e9:.2f} B params, "
            f"{self.trainable_params / 1e9:.2f} B trainable{lora}), compute {self.compute_dtype}",
            f"  shape: hidden {s.hidden}, intermediate {s.intermediate}, {s.layers} layers, heads {s.heads}/"
            f"{s.kv_heads} kv, vocab {s.vocab}{', tied' if s.tied else ''}",
            f"  batch: seq {self.seq_len} x micro-batch {self.micro_batch} = {tokens} tokens, grad-accum "
            f"{self.grad_accum} ({self.micro_batches_in_flight} micro-batch(es) in flight)",
            "",
        ]
        w = 44
        per = self.total_params or 1
        lines.append(f"{'HOST RAM (pinned, exact)':<{w}}{'GiB':>9}{'B/param':>9}")
        labels = dict(TIER_LABELS)
        labels["staging"] = f"{self.compute_dtype} staging copies (matrices)"
        for key in ("exp_avg", "exp_avg_sq"):
            labels[key] = f"AdamW {key} ({self.optimizer_state})"
        labels["grad"] = "gradient accumulators" + (" (bf16 matrices)" if self.grad_dtype == "bf16" else " (fp32)")
        for key, value in self.host_breakdown().items():
            lines.append(f"  {labels[key]:<{w - 2}}{gib(value):>9}{value / per:>9.2f}")
        lines.append(f"  {'total':<{w - 2}}{gib(self.host_total):>9}{self.host_total / per:>9.2f}")
        lines.append("")
        lines.append(f"{'GPU (estimate)':<{w}}{'GiB':>9}")
        n_ckpt = activations.kept_checkpoints(s.layers, self.checkpoint_interval)
        gpu_labels = {
            "weight_slots": "weight slots (2 x largest unit, wire dtype)",
            "checkpoints": (f"checkpoints in transit (2 x {self.micro_batches_in_flight} micro-batch)"
                            if self.host_checkpoints else
                            f"checkpoints ({n_ckpt} units x {self.micro_batches_in_flight} micro-batch)"),
            "recomputed_inputs": f"inputs of a block (checkpoint_interval={self.checkpoint_interval})",
            "layer_working_set": "one layer's recompute working set" + (
                f" (MLP tiles of {self.sequence_tile_tokens})" if self.sequence_tile_tokens else ""),
            "weight_grads": f"weight grads, fp32 ({MAX_PENDING_SENDS + 2} x largest unit)",
            "logits": "logits + loss (tokens or one chunk x vocab)",
            "dequant": f"dequantized base ({self.base_quantization}: largest unit)",
            "runtime": "CUDA context + workspaces (allowance)",
        }
        for key, value in self.gpu_breakdown().items():
            lines.append(f"  {gpu_labels[key]:<{w - 2}}{gib(value):>9}")
        lines.append(f"  {'total':<{w - 2}}{gib(self.gpu_total):>9}")
        return "\n".join(lines)


def plan_memory(
    shape: ModelShape,
    *,
    seq_len: int,
    micro_batch: int,
    grad_accum: int = 1,
    compute_dtype: str = "bf16",
    layer_major: bool = True,
    chunked_loss: bool = True,
    loss_chunk_tokens: int | None = None,
    host_staging: bool = True,
    lora_rank: int | None = None,
    lora_targets: Iterable[str] = LORA_TARGETS,
    offload_checkpoints: bool = False,
    base_quantization: str = "none",
    optimizer_state: str = "fp32",
    sequence_tile_tokens: int | str | None = "auto",
    checkpoint_interval: int = 1,
    grad_dtype: str = "fp32",
    experts_dtype: str = "auto",
) -> MemoryPlan:
    """Plan the host tiers (exact) and the GPU items (estimate) of training ``shape``.

    ``compute_dtype``: ``"bf16"`` or ``"fp32"`` (aliases ``bfloat16``/``float32``).
    ``layer_major``: all ``grad_accum`` micro-batches of a step go through each layer together,
    so their activation checkpoints are all on the GPU (otherwise one micro-batch at a time).
    ``lora_rank``: plan a LoRA run (adapters of rank ``lora_rank`` on ``lora_targets`` of every
    layer are trainable, every base weight frozen) instead of full fine-tuning.
    ``offload_checkpoints``: the checkpoints live in host RAM; the GPU holds two per micro-batch
    in flight (the one going down, the one coming back up).
    ``base_quantization``: ``"int8"`` / ``"nf4"`` store and stream the LoRA-adapted base weights
    quantized (needs ``lora_rank``), as ``MegaTrainConfig(base_quantization=...)``.
    ``optimizer_state``: the AdamW moments' format, ``"fp32"``, ``"bf16"``, ``"8bit"`` or ``"4bit"``.
    in flight (the one going down, the one coming back up). ``sequence_tile_tokens`` and
    ``checkpoint_interval``: the options of the same names (``activations.py``). ``grad_dtype``:
    ``"fp32"`` or ``"bf16"`` (``MegaTrainConfig.grad_dtype``: the layers' matrices' accumulators in bf16;
    which options it needs is the training plan's rule, ``megatrain_hf/plan.py``). ``experts_dtype``:
    ``"auto"`` or ``"compute"`` (``MegaTrainConfig.experts_dtype``: fp32 routed experts where plain bf16
    training computes them in fp32).
    """
    _check_int("seq_len", seq_len)
    _check_int("micro_batch", micro_batch)
    _check_int("grad_accum", grad_accum)
    if compute_dtype not in _COMPUTE_BYTES:
        raise MegatrainConfigError(
            f"compute_dtype={compute_dtype!r} is not supported; allowed: {sorted(_COMPUTE_BYTES)}. "
            "fp16 is not supported by megatrain (use bf16)."
        )
    lora_targets = tuple(lora_targets)
    if lora_rank is not None:
        _check_int("lora_rank", lora_rank)
        unknown = sorted(set(lora_targets) - set(LORA_TARGETS))
        if unknown or not lora_targets:
            raise MegatrainConfigError(
                f"lora_targets={list(lora_targets)!r}: unknown or empty ({unknown}); allowed: a non-empty "
                f"subset of {list(LORA_TARGETS)}."
            )
    if base_quantization not in ("none", "int8", "nf4"):
        raise MegatrainConfigError(f"base_quantization={base_quantization!r}; allowed: 'none', 'int8' or 'nf4'.")
    if base_quantization != "none" and lora_rank is None:
        raise IncompatibleOptionsError(
            f"base_quantization={base_quantization!r} quantizes frozen LoRA base weights; a full "
            "fine-tune trains every weight in fp32. Fix: also give lora_rank (--lora-rank R).")
    cbytes = _COMPUTE_BYTES[compute_dtype]
    dtype_name = "bf16" if cbytes == 2 else "fp32"
    dtype = _DTYPE_BY_NAME[compute_dtype]
    if experts_dtype not in ("auto", "compute"):
        raise MegatrainConfigError(f"experts_dtype={experts_dtype!r} is not known; allowed: 'auto', 'compute'.")
    units = _layout(shape, lora_rank, lora_targets, base_quantization, experts_dtype)
    if optimizer_state not in MOMENT_FORMATS:
        raise MegatrainConfigError(
            f"optimizer_state={optimizer_state!r} is not known; allowed: {list(MOMENT_FORMATS)}.")
    if grad_dtype not in ("fp32", "bf16"):
        raise MegatrainConfigError(f"grad_dtype={grad_dtype!r} is not known; allowed: 'fp32', 'bf16'.")
    tiers = _host_tiers(units, dtype, host_staging, optimizer_state,
                        torch.bfloat16 if grad_dtype == "bf16" else torch.float32)

    trainable = sum(t.numel for u in units for t in u.tensors if t.trainable)
    frozen = sum(t.numel for u in units for t in u.tensors if not t.trainable)

    # GPU ------------------------------------------------------------------------------------
    embed_wire = _wire_bytes(units[0], dtype)

    def wire(unit: _UnitLayout) -> int:
        return _wire_bytes(unit, dtype) + (embed_wire if unit.reads_embedding else 0)

    def grads(unit: _UnitLayout) -> int:
        n = sum(aligned(t.numel) for t in unit.tensors if t.trainable)
        if unit.reads_embedding and units[0].tensors[0].trainable:
            n += aligned(units[0].tensors[0].numel)
        return 4 * n

    distinct = list({id(u): u for u in units}.values())  # embedding, each layer layout, norm, head
    tokens = seq_len * micro_batch
    in_flight = grad_accum if layer_major else 1
    h, i = shape.hidden, shape.intermediate
    if shape.experts:  # a token's routed experts and the shared one (dense layers: the dense MLP)
        routed = shape.experts_per_token * shape.expert_intermediate + shape.shared_expert_intermediate
        i = max(routed, shape.intermediate if shape.dense_layers else 0)
    _check_int("checkpoint_interval", checkpoint_interval)
    tile = activations.resolve_tile(sequence_tile_tokens, tokens, h, i, cbytes) if not shape.experts else None
    checkpoints = activations.checkpoint_bytes(in_flight * tokens, h, shape.layers, checkpoint_interval)
    plan = MemoryPlan(
        shape=shape,
        seq_len=seq_len,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        micro_batches_in_flight=in_flight,
        compute_dtype=dtype_name,
        lora_rank=lora_rank,
        total_params=trainable + frozen,
        trainable_params=trainable,
        frozen_params=frozen,
        host_master=tiers["master"],
        host_grad=tiers["grad"],
        host_exp_avg=tiers["exp_avg"],
        host_exp_avg_sq=tiers["exp_avg_sq"],
        host_staging=tiers["staging"],
        host_frozen=tiers["frozen"],
        host_checkpoints=checkpoints if offload_checkpoints else 0,
        gpu_weight_slots=2 * max(wire(u) for u in distinct),
        gpu_checkpoints=2 * in_flight * tokens * h * 4 if offload_checkpoints else checkpoints,
        sequence_tile_tokens=tile,
        checkpoint_interval=checkpoint_interval,
        gpu_recomputed_inputs=activations.recomputed_inputs_bytes(tokens, h, checkpoint_interval),
        gpu_layer_working_set=activations.layer_working_set(tokens, h, shape.q_dim, shape.kv_dim, i, cbytes, tile),
        gpu_weight_grads=(MAX_PENDING_SENDS + 2) * max(grads(u) for u in distinct),
        # chunked loss: one chunk's logits at a time; else every in-flight micro-batch's logits and
        # log-probs wait for the backward (layer-major: the step's one backward)
        gpu_logits=(min(tokens, loss_chunk(loss_chunk_tokens, shape.vocab)) if chunked_loss else in_flight * tokens)
        * shape.vocab * (cbytes + 12),
        gpu_runtime=GPU_RUNTIME_ALLOWANCE_BYTES,
        base_quantization=base_quantization,
        gpu_dequant=max(sum(t.numel for t in u.tensors if t.quant) for u in distinct) * cbytes
        + (DEQUANT_TEMP_BYTES * DEQUANT_CHUNK_ELEMENTS if base_quantization != "none" else 0),
        optimizer_state=optimizer_state,
        grad_dtype=grad_dtype,
        experts_dtype=experts_dtype,
    )
    logger.debug("memory plan for %s: host %.2f GiB, GPU %.2f GiB", shape.name, plan.host_total / GiB,
                 plan.gpu_total / GiB)
    return plan

"""The memory plan: host bytes per tier (exact), GPU bytes (estimate), the check before allocating, what fits."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Iterable

import psutil
import torch

from ..grads import MAX_PENDING_SENDS

from ..loss import chunk_tokens as loss_chunk
from ..store import wire_dtype
from .shapes import PRESETS, ModelShape

logger = logging.getLogger(__name__)

GiB = 2**30

_ALIGN_ELEMS = 16  # must match megatrain_hf.store._ALIGN_ELEMS (tests/test_memory.py checks it)

DEFAULT_HEADROOM_BYTES = 2 * GiB
"""Host RAM left free on top of the plan: the Python process, torch, the tokenizer, the data
loader and the OS page cache need some."""

GPU_RUNTIME_ALLOWANCE_BYTES = 1 * GiB
"""Fixed GPU allowance for the CUDA context, cuBLAS/cuDNN workspaces and allocator slack."""

_COMPUTE_BYTES = {"bf16": 2, "bfloat16": 2, "fp32": 4, "float32": 4}
_DTYPE_BY_NAME = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Linear layers of a Llama-style decoder layer that LoRA can adapt (PEFT's module names)."""

_TIER_LABELS = {
    "master": "fp32 master weights",
    "grad": "fp32 gradient accumulators",
    "exp_avg": "AdamW exp_avg (fp32)",
    "exp_avg_sq": "AdamW exp_avg_sq (fp32)",
    "staging": "compute-dtype staging copies",
    "frozen": "frozen weights (wire dtype)",
    "checkpoints": "offloaded activation checkpoints",
}


def _aligned(n: int) -> int:
    return (n + _ALIGN_ELEMS - 1) // _ALIGN_ELEMS * _ALIGN_ELEMS


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


# ---------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class _Tensor:
    numel: int
    matrix: bool  # ndim >= 2
    trainable: bool


@dataclass(frozen=True)
class _UnitLayout:
    kind: str  # "embedding" | "layer" | "norm" | "head"
    tensors: tuple[_Tensor, ...]
    reads_embedding: bool = False  # a tied head computes with the embedding's fp32 flat


def _layout(shape: ModelShape, lora_rank: int | None, lora_targets: Iterable[str]) -> list[_UnitLayout]:
    """The units as the store sees them (one layer layout; every layer is identical)."""
    lora = lora_rank is not None
    full = not lora
    table = shape.vocab * shape.hidden
    layer: list[_Tensor] = []
    for lname, (fi, fo, bias) in shape.linears().items():
        layer.append(_Tensor(fi * fo, True, full))
        if bias:
            layer.append(_Tensor(fo, False, full))
        if lora and lname in lora_targets:
            # LoRA matrices travel in fp32 like vectors (store.wire_dtype): matrix=False here
            layer.append(_Tensor(lora_rank * fi, False, True))  # lora_A: (r, in)
            layer.append(_Tensor(fo * lora_rank, False, True))  # lora_B: (out, r)
    if shape.qk_norm:
        layer += [_Tensor(shape.dim_head, False, full)] * 2
    layer += [_Tensor(shape.hidden, False, full)] * shape.norms_per_layer
    units = [_UnitLayout("embedding", (_Tensor(table, True, full),))]
    units += [_UnitLayout("layer", tuple(layer))] * shape.layers
    units.append(_UnitLayout("norm", (_Tensor(shape.hidden, False, full),)))
    if shape.tied:
        units.append(_UnitLayout("head", (), reads_embedding=True))
    else:
        units.append(_UnitLayout("head", (_Tensor(table, True, full),)))
    return units


def _wire_bytes(t: _Tensor, kind: str, compute_bytes: int) -> int:
    """Bytes per element on the link: matrices outside the embedding in the compute dtype, else fp32."""
    return compute_bytes if t.matrix and kind != "embedding" else 4


def _host_tiers(units: list[_UnitLayout], compute_bytes: int, host_staging: bool = True) -> dict[str, int]:
    """Host bytes per tier; without ``host_staging`` the fp32 masters are sent and rounded on the device."""
    trainable = staging = frozen = 0
    for unit in units:
        unit_trainable = 0
        for t in unit.tensors:
            n = _aligned(t.numel)
            wire = _wire_bytes(t, unit.kind, compute_bytes)
            if t.trainable:
                unit_trainable += n
                if wire != 4:
                    staging += n * wire
            else:
                frozen += n * wire
        trainable += unit_trainable
    return {
        "master": 4 * trainable,
        "grad": 4 * trainable,
        "exp_avg": 4 * trainable,
        "exp_avg_sq": 4 * trainable,
        "staging": staging if host_staging else 0,
        "frozen": frozen,
    }


def _offloaded_checkpoint_bytes(shape: ModelShape, tokens: int) -> int:
    """Activation checkpoints of ``tokens`` (all micro-batches in flight): every decoder layer's,
    the final norm's and the head's input, fp32 (the residual stream of mixed-precision training)."""
    return (shape.layers + 2) * tokens * shape.hidden * 4


def host_breakdown_for_units(
    units: list[tuple[str, torch.nn.Module]] | list[torch.nn.Module],
    *,
    compute_dtype: torch.dtype | str,
    staging: bool = True,
    embedding_units: frozenset[int] = frozenset({0}),
    optimizer_state: bool = True,
) -> dict[str, int]:
    """Exact host bytes per tier for real modules, walked the way ``HostStore`` walks them.

    For the engine: call it with the same ``units`` / ``embedding_units`` it hands the store, then
    :func:`check_host_memory` with ``sum(breakdown.values())`` before allocating. ``staging``:
    whether the store keeps a compute-dtype copy (``HostStore`` does unless compute is fp32 on
    the CPU); ``optimizer_state``: count ``HostAdamW``'s two fp32 moments per trainable element.
    Tied parameters (same tensor in two units) are counted once, frozen ones
    (``requires_grad=False``) in their wire dtype only.
    """
    dtype = _DTYPE_BY_NAME.get(compute_dtype) if isinstance(compute_dtype, str) else compute_dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"compute_dtype={compute_dtype!r} is not supported; allowed: torch.bfloat16, torch.float32 "
            f"or one of {sorted(_DTYPE_BY_NAME)}."
        )
    seen: set[int] = set()
    trainable = low_precision = frozen = 0
    for u, item in enumerate(units):
        module = item[1] if isinstance(item, tuple) else item
        unit_trainable = 0
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in seen:  # tied: lives in the first unit that has it
                continue
            seen.add(id(p))
            n = _aligned(p.numel())
            wire = wire_dtype(p, dtype, u in embedding_units, name)  # the store's own rule
            if p.requires_grad:
                unit_trainable += n
                low_precision += n if wire != torch.float32 else 0
            else:
                frozen += n * torch.empty((), dtype=wire).element_size()
        trainable += unit_trainable
    moments = 4 * trainable if optimizer_state else 0
    return {
        "master": 4 * trainable,
        "grad": 4 * trainable,
        "exp_avg": moments,
        "exp_avg_sq": moments,
        "staging": low_precision * torch.empty((), dtype=dtype).element_size() if staging else 0,
        "frozen": frozen,
    }



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
    """fp32 gradient accumulators: 4 B per trainable parameter."""
    host_exp_avg: int
    """AdamW first moment, fp32: 4 B per trainable parameter."""
    host_exp_avg_sq: int
    """AdamW second moment, fp32: 4 B per trainable parameter."""
    host_staging: int
    """Compute-dtype copy of trainable matrices of layers and lm_head (2 B each in bf16, none in fp32)."""
    host_frozen: int
    """Frozen weights in their wire dtype (2 B for bf16 matrices, 4 B for vectors/embedding/fp32)."""
    host_checkpoints: int
    """With ``offload_checkpoints``: every activation checkpoint of the micro-batches in flight, in
    pinned host buffers (what ``gpu_checkpoints`` would hold otherwise); 0 without."""

    gpu_weight_slots: int
    """Two slots of the largest unit's weights in wire dtype: the unit computing + the one prefetched."""
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
            "layer_working_set": self.gpu_layer_working_set,
            "weight_grads": self.gpu_weight_grads,
            "logits": self.gpu_logits,
            "runtime": self.gpu_runtime,
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
        labels = dict(_TIER_LABELS)
        labels["staging"] = f"{self.compute_dtype} staging copies (matrices)"
        for key, value in self.host_breakdown().items():
            lines.append(f"  {labels[key]:<{w - 2}}{_gib(value):>9}{value / per:>9.2f}")
        lines.append(f"  {'total':<{w - 2}}{_gib(self.host_total):>9}{self.host_total / per:>9.2f}")
        lines.append("")
        lines.append(f"{'GPU (estimate)':<{w}}{'GiB':>9}")
        n_ckpt = s.layers + 2
        gpu_labels = {
            "weight_slots": "weight slots (2 x largest unit, wire dtype)",
            "checkpoints": (f"checkpoints in transit (2 x {self.micro_batches_in_flight} micro-batch)"
                            if self.host_checkpoints else
                            f"checkpoints ({n_ckpt} units x {self.micro_batches_in_flight} micro-batch)"),
            "layer_working_set": "one layer's recompute working set",
            "weight_grads": f"weight grads, fp32 ({MAX_PENDING_SENDS + 2} x largest unit)",
            "logits": "logits + loss (tokens or one chunk x vocab)",
            "runtime": "CUDA context + workspaces (allowance)",
        }
        for key, value in self.gpu_breakdown().items():
            lines.append(f"  {gpu_labels[key]:<{w - 2}}{_gib(value):>9}")
        lines.append(f"  {'total':<{w - 2}}{_gib(self.gpu_total):>9}")
        return "\n".join(lines)


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}")
    return value


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
) -> MemoryPlan:
    """Plan the host tiers (exact) and the GPU items (estimate) of training ``shape``.

    ``compute_dtype``: ``"bf16"`` or ``"fp32"`` (aliases ``bfloat16``/``float32``).
    ``layer_major``: all ``grad_accum`` micro-batches of a step go through each layer together,
    so their activation checkpoints are all on the GPU (otherwise one micro-batch at a time).
    ``lora_rank``: plan a LoRA run (adapters of rank ``lora_rank`` on ``lora_targets`` of every
    layer are trainable, every base weight frozen) instead of full fine-tuning.
    ``offload_checkpoints``: the checkpoints live in host RAM; the GPU holds two per micro-batch
    in flight (the one going down, the one coming back up).
    """
    _check_int("seq_len", seq_len)
    _check_int("micro_batch", micro_batch)
    _check_int("grad_accum", grad_accum)
    if compute_dtype not in _COMPUTE_BYTES:
        raise ValueError(
            f"compute_dtype={compute_dtype!r} is not supported; allowed: {sorted(_COMPUTE_BYTES)}. "
            "fp16 is not supported by megatrain (use bf16)."
        )
    lora_targets = tuple(lora_targets)
    if lora_rank is not None:
        _check_int("lora_rank", lora_rank)
        unknown = sorted(set(lora_targets) - set(LORA_TARGETS))
        if unknown or not lora_targets:
            raise ValueError(
                f"lora_targets={list(lora_targets)!r}: unknown or empty ({unknown}); allowed: a non-empty "
                f"subset of {list(LORA_TARGETS)}."
            )
    cbytes = _COMPUTE_BYTES[compute_dtype]
    dtype_name = "bf16" if cbytes == 2 else "fp32"
    units = _layout(shape, lora_rank, lora_targets)
    tiers = _host_tiers(units, cbytes, host_staging)

    trainable = sum(t.numel for u in units for t in u.tensors if t.trainable)
    frozen = sum(t.numel for u in units for t in u.tensors if not t.trainable)

    # GPU ------------------------------------------------------------------------------------
    embed_wire = sum(_aligned(t.numel) * 4 for t in units[0].tensors)

    def wire(unit: _UnitLayout) -> int:
        own = sum(_aligned(t.numel) * _wire_bytes(t, unit.kind, cbytes) for t in unit.tensors)
        return own + (embed_wire if unit.reads_embedding else 0)

    def grads(unit: _UnitLayout) -> int:
        n = sum(_aligned(t.numel) for t in unit.tensors if t.trainable)
        if unit.reads_embedding and units[0].tensors[0].trainable:
            n += _aligned(units[0].tensors[0].numel)
        return 4 * n

    distinct = units[:2] + units[-2:]  # embedding, one layer, norm, head
    tokens = seq_len * micro_batch
    in_flight = grad_accum if layer_major else 1
    h, i = shape.hidden, shape.intermediate
    per_token = cbytes * (2 * h + 2 * shape.q_dim + 2 * shape.kv_dim + 4 * i) + 4 * (6 * h)
    checkpoints = _offloaded_checkpoint_bytes(shape, in_flight * tokens)
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
        gpu_layer_working_set=tokens * per_token,
        gpu_weight_grads=(MAX_PENDING_SENDS + 2) * max(grads(u) for u in distinct),
        # chunked loss: one chunk's logits at a time; else every in-flight micro-batch's logits and
        # log-probs wait for the backward (layer-major: the step's one backward)
        gpu_logits=(min(tokens, loss_chunk(loss_chunk_tokens, shape.vocab)) if chunked_loss else in_flight * tokens)
        * shape.vocab * (cbytes + 12),
        gpu_runtime=GPU_RUNTIME_ALLOWANCE_BYTES,
    )
    logger.debug("memory plan for %s: host %.2f GiB, GPU %.2f GiB", shape.name, plan.host_total / GiB,
                 plan.gpu_total / GiB)
    return plan


# ---------------------------------------------------------------------------------------- checks
def available_host_bytes() -> int:
    """Host RAM available to a new allocation now (``psutil.virtual_memory().available``)."""
    return int(psutil.virtual_memory().available)


def check_host_memory(
    needed_bytes: int,
    breakdown: dict[str, int],
    available: int | None = None,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
) -> int:
    """Raise ``MemoryError`` (with the arithmetic and the fix) unless ``needed_bytes`` plus
    ``headroom_bytes`` fit in ``available`` (default: :func:`available_host_bytes`).

    ``breakdown`` maps tier names (``master``, ``grad``, ``exp_avg``, ``exp_avg_sq``, ``staging``,
    ``frozen`` or any label) to bytes; it is shown in the message. Returns the bytes to spare.
    """
    _check_int("needed_bytes", needed_bytes, 0)
    _check_int("headroom_bytes", headroom_bytes, 0)
    if available is None:
        available = available_host_bytes()
    spare = available - needed_bytes - headroom_bytes
    if spare >= 0:
        logger.info(
            "host memory: %.2f GiB needed + %.2f GiB headroom <= %.2f GiB available (%.2f GiB to spare)",
            needed_bytes / GiB, headroom_bytes / GiB, available / GiB, spare / GiB,
        )
        return spare
    width = max([len(_TIER_LABELS.get(k, k)) for k in breakdown] + [28])
    rows = [f"  {_TIER_LABELS.get(k, k):<{width}} {_gib(v):>9} GiB" for k, v in breakdown.items()]
    listed = sum(breakdown.values())
    if listed != needed_bytes:
        rows.append(f"  {'other':<{width}} {_gib(needed_bytes - listed):>9} GiB")
    rows += [
        f"  {'= needed':<{width}} {_gib(needed_bytes):>9} GiB",
        f"  {'+ headroom (process, data, OS)':<{width}} {_gib(headroom_bytes):>9} GiB",
        f"  {'= required':<{width}} {_gib(needed_bytes + headroom_bytes):>9} GiB",
        f"  {'available now':<{width}} {_gib(available):>9} GiB",
        f"  {'short by':<{width}} {_gib(-spare):>9} GiB",
    ]
    message = (
        f"megatrain needs {_gib(needed_bytes)} GiB of host RAM (+ {_gib(headroom_bytes)} GiB headroom) but only "
        f"{_gib(available)} GiB is available:\n" + "\n".join(rows) + "\n"
        "Fix: train a smaller model (fewer layers or a smaller preset; `megatrain estimate` prints the "
        "largest that fits), use LoRA/PEFT (frozen base weights cost 2 B/param in bf16 instead of ~18 B), "
        "free RAM held by other processes, or use a machine with more RAM. If this machine grants more "
        "than it reports available (some VMs grow their RAM as it is used), "
        "MegaTrainConfig(check_host_memory=False) skips the check."
    )
    raise MemoryError(message)


# ---------------------------------------------------------------------------------------- what fits
@dataclass(kw_only=True)
class ModelFit:
    """The largest models whose host plan fits a RAM budget. Build with :func:`largest_model`."""

    available_bytes: int
    """The RAM budget planned against."""
    headroom_bytes: int
    """Kept free on top of the plan."""
    base: ModelShape
    """The shape that was scaled."""
    deepest: ModelShape | None
    """``base`` with the most layers that fit (width unchanged), ``None`` if not even one layer fits."""
    widest: ModelShape | None
    """``base``'s depth at the largest width that fits (head width and GQA ratio kept), or ``None``."""
    deepest_host_bytes: int = 0
    """Host plan of ``deepest``."""
    widest_host_bytes: int = 0
    """Host plan of ``widest``."""

    def describe(self) -> str:
        budget = f"{_gib(self.available_bytes)} GiB (- {_gib(self.headroom_bytes)} GiB headroom)"
        parts = [f"in {budget}, at the width of {self.base.name or 'the base'}:"]
        if self.deepest is None:
            parts.append("  not even one layer fits")
        else:
            parts.append(
                f"  deepest: {self.deepest.layers} layers = {self.deepest.params() / 1e9:.2f} B params "
                f"({_gib(self.deepest_host_bytes)} GiB host)"
            )
        if self.widest is not None:
            w = self.widest
            parts.append(
                f"  widest at {w.layers} layers: hidden {w.hidden}, intermediate {w.intermediate}, heads "
                f"{w.heads}/{w.kv_heads} = {w.params() / 1e9:.2f} B params ({_gib(self.widest_host_bytes)} GiB host)"
            )
        return "\n".join(parts)


def _host_total(shape: ModelShape, compute_dtype: str, lora_rank: int | None, host_staging: bool = True,
                offload_tokens: int = 0) -> int:
    tiers = _host_tiers(_layout(shape, lora_rank, LORA_TARGETS), _COMPUTE_BYTES[compute_dtype], host_staging)
    return sum(tiers.values()) + _offloaded_checkpoint_bytes(shape, offload_tokens)


def largest_model(
    available_bytes: int,
    *,
    base: ModelShape = PRESETS["llama-7b"],
    compute_dtype: str = "bf16",
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    lora_rank: int | None = None,
    host_staging: bool = True,
    offload_tokens: int = 0,
) -> ModelFit:
    """The largest depth and the largest width of ``base`` whose host plan fits ``available_bytes``.

    Host RAM is the binding limit (the GPU side does not grow with depth, except for the
    activation checkpoints). Depth: host bytes are ``fixed + layers * per_layer`` (embedding,
    final norm and lm_head are the fixed part), so the deepest model is
    ``(budget - fixed) // per_layer`` layers. Width: at ``base.layers``, the hidden size grows in
    steps of ``head_dim * (heads // kv_heads)`` (whole GQA groups of the same head width), the
    intermediate size in proportion (rounded to 256); host bytes grow monotonically with it, so
    a bisection finds the widest.

    ``host_staging`` and ``offload_tokens`` (tokens whose activation checkpoints live in host RAM:
    sequence x micro-batch x micro-batches in flight, with ``offload_checkpoints``) plan what
    :func:`plan_memory` plans with the same options.
    """
    _check_int("available_bytes", available_bytes, 0)
    if compute_dtype not in _COMPUTE_BYTES:
        raise ValueError(f"compute_dtype={compute_dtype!r}; allowed: {sorted(_COMPUTE_BYTES)}")
    budget = available_bytes - headroom_bytes

    def total(shape: ModelShape) -> int:
        return _host_total(shape, compute_dtype, lora_rank, host_staging, offload_tokens)

    one, two = (total(base.with_layers(n)) for n in (1, 2))
    per_layer = two - one
    fixed = one - per_layer
    layers = (budget - fixed) // per_layer if budget > fixed else 0
    deepest = base.with_layers(int(layers)) if layers >= 1 else None

    group = base.heads // base.kv_heads
    step = base.dim_head * group

    def widened(k: int) -> ModelShape:
        hidden = k * step
        inter = max(256, round(base.intermediate * hidden / base.hidden / 256) * 256)
        heads = hidden // base.dim_head
        return dataclasses.replace(
            base,
            hidden=hidden,
            intermediate=inter,
            heads=heads,
            kv_heads=heads // group,
            head_dim=base.head_dim,
            name=f"{base.name or 'model'}@hidden{hidden}",
        )

    def fits(k: int) -> bool:
        return total(widened(k)) <= budget

    widest = None
    if fits(1):
        lo, hi = 1, 2
        while fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        widest = widened(lo)
    return ModelFit(
        available_bytes=available_bytes,
        headroom_bytes=headroom_bytes,
        base=base,
        deepest=deepest,
        widest=widest,
        deepest_host_bytes=total(deepest) if deepest else 0,
        widest_host_bytes=total(widest) if widest else 0,
    )


def largest_preset(
    available_bytes: int,
    *,
    compute_dtype: str = "bf16",
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    lora_rank: int | None = None,
    host_staging: bool = True,
    offload_tokens: int = 0,
) -> str | None:
    """Name of the real-size preset with the most parameters whose host plan fits, or ``None``
    (the test preset ``tiny`` is not considered); options as in :func:`largest_model`."""
    fitting = [
        (shape.params(), name)
        for name, shape in PRESETS.items()
        if name != "tiny"
        and _host_total(shape, compute_dtype, lora_rank, host_staging, offload_tokens) + headroom_bytes
        <= available_bytes
    ]
    return max(fitting)[1] if fitting else None

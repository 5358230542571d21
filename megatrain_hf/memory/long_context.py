"""One plan over the optimizer state and the activation checkpoints, for one sequence length.

At long lengths the host RAM is shared by two things that both want it: the optimizer state
(16-18 B per parameter in fp32) and the activation checkpoints (``tokens x hidden`` per unit: 8 GiB
per unit at 512K tokens of a hidden-4096 model in fp32). :func:`plan_long_context` weighs them
against each other: it tries every combination of

* a *state* choice (:data:`STATES`): the AdamW moments' format (fp32, or 8-bit), the host staging
  copy, bf16 gradient accumulators, and which of it lives on the disk tier (the moments; the moments
  and the fp32 masters), and
* a *checkpoint* choice: the home (on the GPU; pinned host, the units the RAM cannot take spilling to
  the disk tier), ``checkpoint_interval`` (1, 2, 4, 8) and ``checkpoint_dtype`` (fp32, bf16),

keeps those whose GPU, host and disk bytes fit, and picks the exact one (fp32 moments, fp32
checkpoints) of the shortest estimated step; a lossy one (8-bit moments, bf16 checkpoints) only when
no exact one fits, and says so. The step time is the compute at :data:`SUSTAINED_FLOPS` (the model's
``6 N`` per token plus causal attention's ``6 S^2 h L``, and the forward recomputed in the backward)
plus what each tier moves (link: :data:`LINK_BYTES_PER_S`; disk: :data:`DISK_READ_BYTES_PER_S`,
:data:`DISK_WRITE_BYTES_PER_S`) and the extra forwards of ``checkpoint_interval``; transfers are
counted as if none overlapped the compute (an upper bound). At 512K the attention is ~90% of the
FLOPs and a step takes minutes, so the disk tier's seconds for the optimizer state are a few percent
of it: the plan prints that share.

The GPU side is the memory plan's (``plan.py``: weight slots, weight gradients, the loss chunk, the
runtime) plus one activation model, :func:`activations.long_context_working_set` (every per-token op
tiled), plus the checkpoints the home leaves on the GPU.
"""

from __future__ import annotations


from dataclasses import dataclass, field

from ..core.grads import MAX_PENDING_SENDS
from ..errors import LongContextFitError
from . import activations
from .disk import DISK_HEADROOM_BYTES, ram_with_tier, shape_tier
from .host import DEFAULT_HEADROOM_BYTES, gib
from .plan import MemoryPlan, plan_memory
from .shapes import ModelShape

SUSTAINED_FLOPS = 400e12
"""FLOP/s the step's compute is planned at: the MegaTrain paper's 407 TFLOPS at 512K on a GH200 (an
assumption for the time shares, not a measurement of this code; ``megatrain estimate --tflops``)."""

LINK_BYTES_PER_S = 55e9
"""Host-device copies, both ways: 55 GB/s, measured on the H200 machine (2026-11, docs/anchors)."""

DISK_READ_BYTES_PER_S = 1.85e9
DISK_WRITE_BYTES_PER_S = 2.19e9
"""The disk tier's raw sequential rates measured on the H200 machine at d4f1b61 (docs/benchmarks.md)."""

INTERVALS = (1, 2, 4, 8)
LOSS_RANK = {"fp32": 0, "8bit": 1, "4bit": 2}
"""How far from exact a moment format is: the plan takes the nearest that fits, then exact checkpoints,
then the shortest step."""
LAYER_WS = "one layer's backward (every per-token op tiled)"
DISK_STAGING_SLOTS = 3  # core/checkpoint_disk.STAGING_SLOTS (kept here: memory/ imports no runtime module)
CHECKPOINT_FILE_HEADROOM = DISK_HEADROOM_BYTES


@dataclass(frozen=True)
class StateChoice:
    """Where and how the optimizer state lives (MegaTrainConfig options)."""

    optimizer_state: str = "fp32"
    host_staging: bool = True
    grad_dtype: str = "fp32"
    on_disk: str = "none"  # "none", "moments", "all" (moments and the fp32 masters of the matrices)

    @property
    def exact(self) -> bool:
        return self.optimizer_state == "fp32"

    def options(self) -> dict:
        o = {"optimizer_state": self.optimizer_state, "host_staging": self.host_staging, "grad_dtype": self.grad_dtype}
        return o | ({"offload_dir": "DIR", "offload_state": self.on_disk} if self.on_disk != "none" else {})

    def describe(self) -> str:
        where = {"none": "in RAM", "moments": "moments on disk", "all": "moments and fp32 masters on disk"}
        return (f"{self.optimizer_state} moments, {where[self.on_disk]}, "
                f"{'staging copy' if self.host_staging else 'no staging copy'}, {self.grad_dtype} gradients")


STATES: tuple[StateChoice, ...] = (
    StateChoice(),
    StateChoice(host_staging=False),
    StateChoice(host_staging=False, grad_dtype="bf16"),
    StateChoice(host_staging=False, grad_dtype="bf16", on_disk="moments"),
    StateChoice(grad_dtype="bf16", on_disk="all"),
    StateChoice("8bit", host_staging=False, grad_dtype="bf16"),
    StateChoice("8bit", host_staging=False, grad_dtype="bf16", on_disk="moments"),
    StateChoice("8bit", grad_dtype="bf16", on_disk="all"),
    StateChoice("4bit", host_staging=False, grad_dtype="bf16"),
)
"""The state choices tried, exact ones first (bf16 gradient accumulators are exact at accumulation 1
with bf16 compute: docs/memory.md)."""


@dataclass(frozen=True)
class CheckpointChoice:
    home: str  # "gpu", "host" (the units the RAM cannot take go to the disk tier) or "disk" (every one there)
    interval: int
    dtype: str  # "fp32" or "bf16"

    def options(self) -> dict:
        home = {"gpu": False, "host": True, "disk": "disk"}[self.home]
        return {"offload_checkpoints": home, "checkpoint_interval": self.interval, "checkpoint_dtype": self.dtype}


@dataclass
class JointPlan:
    """A state choice and a checkpoint choice for one length, with their bytes and seconds."""

    shape: ModelShape
    seq_len: int
    state: StateChoice
    ckpt: CheckpointChoice
    kept: int  # checkpoints kept per micro-batch in flight
    host_units: int  # ... in pinned host RAM
    disk_units: int  # ... on the disk tier
    gpu: dict[str, int]  # GPU bytes per item
    host: dict[str, int]  # host bytes per item
    disk: dict[str, int]  # disk bytes per item
    seconds: dict[str, float]  # per step: compute, and what each tier adds
    memory: MemoryPlan = field(repr=False)

    @property
    def exact(self) -> bool:
        return self.state.exact and self.ckpt.dtype == "fp32"

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    def fits(self, gpu: int, host: int, disk: int | None) -> bool:
        return (sum(self.gpu.values()) <= gpu and sum(self.host.values()) <= host
                and sum(self.disk.values()) <= (disk or 0))

    def options(self) -> dict:
        """The MegaTrainConfig options that run this plan (``offload_dir``: any directory on that disk)."""
        o = self.state.options() | self.ckpt.options()
        if self.disk_units:
            o["offload_dir"] = "DIR"
        return o

    def placement(self) -> str:
        c = self.ckpt
        if c.home == "gpu":
            where = f"{self.kept} on the GPU"
        else:
            where = " + ".join(s for s in (f"{self.kept - self.host_units - self.disk_units} on the GPU (the head's)",
                                            f"{self.host_units} in pinned host RAM" if self.host_units else "",
                                            f"{self.disk_units} on the disk tier" if self.disk_units else "") if s)
        return f"checkpoints: {where} ({c.dtype}, checkpoint_interval={c.interval}); state: {self.state.describe()}"

    def lines(self) -> list[str]:
        w = 60
        per = self.seq_len * self.shape.hidden * (4 if self.ckpt.dtype == "fp32" else 2)
        out = [f"JOINT PLAN at {self.seq_len} tokens ({'exact' if self.exact else 'NOT exact: ' + self._lossy()})",
               f"  {self.placement()}",
               f"  one checkpoint: {gib(per)} GiB; options: " + ", ".join(f"{k}={v!r}" for k, v in self.options().items())]
        for title, items in (("GPU", self.gpu), ("host RAM", self.host), ("disk", self.disk)):
            if not items:
                continue
            out.append(f"  {title + ' (GiB)':<{w}}{gib(sum(items.values())):>9}")
            out += [f"    {k:<{w - 2}}{gib(v):>9}" for k, v in items.items() if v]
        total = self.step_seconds
        out.append(f"  {'time per step, estimated (s)':<{w}}{total:>9.1f}")
        out += [f"    {k:<{w - 2}}{v:>9.1f}  ({100 * v / total:.1f}%)" for k, v in self.seconds.items() if v > 0]
        out.append("  " + self.verdict())
        return out

    def to_dict(self) -> dict:
        return {"seq_len": self.seq_len, "exact": self.exact, "placement": self.placement(), "options": self.options(),
                "checkpoints_kept": self.kept, "checkpoints_host": self.host_units, "checkpoints_disk": self.disk_units,
                "gpu_bytes": self.gpu, "host_bytes": self.host, "disk_bytes": self.disk, "seconds": self.seconds,
                "gpu_total": sum(self.gpu.values()), "host_total": sum(self.host.values()),
                "disk_total": sum(self.disk.values()), "step_seconds": self.step_seconds, "verdict": self.verdict()}

    def verdict(self) -> str:
        s = self.seconds
        disk = sum(v for k, v in s.items() if k.startswith("disk"))
        compute = s["compute (attention " + self._attention_share() + ")"]
        if disk:
            return (f"the disk tier adds {disk:.1f} s per step, {100 * disk / compute:.1f}% of the {compute:.1f} s of "
                    f"compute")
        return (f"no disk tier: the step is {compute:.1f} s of compute plus {self.step_seconds - compute:.1f} s of "
                "recompute and transfers")

    def _attention_share(self) -> str:
        return f"{100 * attention_share(self.shape, self.seq_len):.0f}% of the FLOPs"

    def _lossy(self) -> str:
        parts = ([f"{self.state.optimizer_state} moments"] if not self.state.exact else [])
        return " and ".join(parts + (["bf16 checkpoints"] if self.ckpt.dtype == "bf16" else []))


def attention_share(shape: ModelShape, seq_len: int) -> float:
    attention = 6 * seq_len * seq_len * shape.hidden * shape.layers
    return attention / (attention + 6 * shape.params() * seq_len)


def _phases(shape: ModelShape, base: MemoryPlan, tokens: int, tile: int) -> tuple[dict, dict]:
    """GPU items besides the checkpoints in the two phases that peak: a decoder layer's backward (its
    weights, the gradients queued behind it, the layer's working set) and the head's (the largest unit's
    weights and gradients, the loss chunk, the head's input and the gradient it returns, fp32)."""
    layer = shape.layer_params(shape.layers - 1)
    ws = activations.long_context_working_set(tokens, shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate,
                                              2, tile, heads=shape.heads)
    layer_phase = {"weight slots (2 x a layer, bf16)": 2 * 2 * layer,
                   f"weight gradients ({MAX_PENDING_SENDS + 2} x a layer, fp32)": (MAX_PENDING_SENDS + 2) * 4 * layer,
                   "runtime": base.gpu_runtime, LAYER_WS: ws}
    head_phase = {"weight slots (2 x the largest unit)": base.gpu_weight_slots,
                  "weight gradients (largest unit)": base.gpu_weight_grads, "loss chunk": base.gpu_logits,
                  "runtime": base.gpu_runtime, "the head's input and its gradient (fp32)": 2 * 4 * tokens * shape.hidden}
    return layer_phase, head_phase


def _candidates(shape: ModelShape, seq_len: int, host: int, disk: int | None, micro_batch: int,
                in_flight: int, flops: float, states, base: MemoryPlan, state_host: dict, tile: int,
                intervals: tuple[int, ...] = INTERVALS, homes: tuple[str, ...] = ("gpu", "host")):
    h, layers = shape.hidden, shape.layers
    tokens = seq_len * micro_batch
    layer_phase, head_phase = _phases(shape, base, tokens, tile)
    model = 6 * shape.params() * tokens + 6 * seq_len * tokens * h * layers  # causal attention fwd + bwd
    forward = (2 * shape.params() * tokens + 2 * seq_len * tokens * h * layers)
    compute = (model + forward) / flops  # every unit's forward recomputed in its backward
    label = f"compute (attention {100 * attention_share(shape, seq_len):.0f}% of the FLOPs)"
    for state in states:
        s_host, s_disk, s_read, s_written = state_host[state]
        for dtype in ("fp32", "bf16"):
            per = tokens * h * (4 if dtype == "fp32" else 2)
            for interval in intervals:
                kept = activations.kept_checkpoints(layers, interval) * in_flight
                held = activations.recomputed_inputs_bytes(tokens, h, interval)
                extra = (interval - 1) / interval * forward * layers / (layers + 2) / flops
                for home in homes:
                    hst = {"optimizer state": s_host, "headroom": DEFAULT_HEADROOM_BYTES}
                    dsk = {"optimizer state": s_disk, "headroom": DISK_HEADROOM_BYTES} if s_disk else {}
                    sec = {label: compute}
                    if extra:
                        sec[f"recompute (checkpoint_interval={interval})"] = extra
                    host_units = disk_units = 0
                    if home == "gpu":
                        ckpts = {"checkpoints": kept * per}
                    else:  # the head's stays on the GPU; one comes back ahead per micro-batch
                        ckpts = {"checkpoints: the head's": in_flight * per, "checkpoints: one read ahead": in_flight * per}
                        off = kept - in_flight
                        room = max(0, host - s_host - DEFAULT_HEADROOM_BYTES)
                        host_units = min(off, room // per) if home == "host" else 0
                        if off > host_units:
                            if disk is None:
                                continue
                            staging = (DISK_STAGING_SLOTS + in_flight - 1) * per
                            host_units = min(off, max(0, room - staging) // per) if home == "host" else 0
                            disk_units = off - host_units
                            hst["checkpoint staging (disk tier)"] = staging
                            dsk["checkpoints"] = disk_units * per
                            dsk["checkpoint file headroom"] = CHECKPOINT_FILE_HEADROOM
                            sec["disk: checkpoints"] = disk_units * per * (1 / DISK_WRITE_BYTES_PER_S
                                                                          + 1 / DISK_READ_BYTES_PER_S)
                        hst["checkpoints"] = host_units * per
                        sec["link: checkpoints"] = 2 * off * per / LINK_BYTES_PER_S
                    if held:
                        ckpts[f"inputs of a block held (checkpoint_interval={interval}, fp32)"] = held
                    phases = [layer_phase | ckpts, head_phase | ckpts]
                    g = max(phases, key=lambda items: sum(items.values()))
                    if s_disk:
                        sec["disk: optimizer state"] = s_read / DISK_READ_BYTES_PER_S + s_written / DISK_WRITE_BYTES_PER_S
                    yield JointPlan(shape, seq_len, state, CheckpointChoice(home, interval, dtype), kept, host_units,
                                    disk_units, g, hst, dsk, sec, base)


def _state_bytes(shape: ModelShape, base: MemoryPlan, state: StateChoice, options: dict) -> tuple[int, int, int, int]:
    """(host bytes, disk bytes, disk read per step, disk written per step) of a state choice."""
    plan = plan_memory(shape, seq_len=base.seq_len, micro_batch=base.micro_batch, optimizer_state=state.optimizer_state,
                       host_staging=state.host_staging, grad_dtype=state.grad_dtype, **options)
    if state.on_disk == "none":
        return plan.host_total, 0, 0, 0
    tier = shape_tier(shape, plan.compute_dtype, plan.lora_rank, optimizer_state=state.optimizer_state,
                      masters=state.on_disk == "all")
    return ram_with_tier(plan, tier), tier.disk_bytes, tier.read_per_step, tier.written_per_step


def candidates(shape: ModelShape, seq_len: int, gpu: int, host: int, disk: int | None = None, *, micro_batch: int = 1,
               grad_accum: int = 1, layer_major: bool = True, flops: float = SUSTAINED_FLOPS,
               states: tuple[StateChoice, ...] = STATES, intervals: tuple[int, ...] = INTERVALS,
               homes: tuple[str, ...] = ("gpu", "host"), dtypes: tuple[str, ...] = ("fp32", "bf16"),
               **options) -> list[JointPlan]:
    """Every combination of :data:`STATES` (those the disk allows) and checkpoint choice at ``seq_len``
    (``intervals``, ``homes``, ``dtypes``: the checkpoint choices tried; ``memory/seq_placement.py`` narrows
    them to the options a user fixed)."""
    states = tuple(s for s in states if disk is not None or s.on_disk == "none")
    if grad_accum > 1:
        states = tuple(s for s in states if s.grad_dtype == "fp32")  # bf16 accumulators need accumulation 1
    options = {k: v for k, v in options.items() if k not in ("optimizer_state", "host_staging", "grad_dtype",
                                                             "offload_checkpoints", "checkpoint_interval")}
    base = plan_memory(shape, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, **options)
    tile = max(shape.hidden, activations.AUTO_TILE_MIN)
    state_host = {s: _state_bytes(shape, base, s, options) for s in states}
    plans = _candidates(shape, seq_len, host, disk, micro_batch, grad_accum if layer_major else 1, flops,
                        states, base, state_host, tile, intervals, tuple(h for h in homes if h != "disk" or disk is not None))
    return [p for p in plans if p.ckpt.dtype in dtypes]


def _best(plans: list[JointPlan], gpu: int, host: int, disk: int | None) -> JointPlan | None:
    fitting = [p for p in plans if p.fits(gpu, host, disk)]
    return min(fitting, key=lambda p: (LOSS_RANK[p.state.optimizer_state], p.ckpt.dtype != "fp32", p.step_seconds),
               default=None)


def best_plan(shape: ModelShape, seq_len: int, gpu: int, host: int, disk: int | None = None, **kw) -> JointPlan | None:
    """The plan :func:`plan_long_context` picks at ``seq_len``, or None when nothing fits."""
    return _best(candidates(shape, seq_len, gpu, host, disk, **kw), gpu, host, disk)


def longest(shape: ModelShape, gpu: int, host: int, disk: int | None = None, step: int = 1024, limit: int = 1 << 23,
            **kw) -> tuple[int, JointPlan | None]:
    """(the longest multiple of ``step`` up to ``limit`` that some plan fits, its plan), or (0, None)."""
    lo, hi, best = 0, limit // step, None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        plan = best_plan(shape, mid * step, gpu, host, disk, **kw)
        lo, hi, best = (mid, hi, plan) if plan is not None else (lo, mid - 1, best)
    return lo * step, best


def plan_long_context(shape: ModelShape, seq_len: int, gpu: int, host: int, disk: int | None = None,
                      **kw) -> JointPlan:
    """The joint plan at ``seq_len`` (module docstring); raises :class:`LongContextFitError` naming the longest
    length that fits and what would fit this one when nothing does."""
    plans = candidates(shape, seq_len, gpu, host, disk, **kw)
    best = _best(plans, gpu, host, disk)
    if best is not None:
        return best
    raise LongContextFitError(refusal(shape, seq_len, gpu, host, disk, plans, **kw))


def refusal(shape: ModelShape, seq_len: int, gpu: int, host: int, disk: int | None, plans: list[JointPlan],
            **kw) -> str:
    """What, why and the fix of a length that nothing fits."""
    machine = f"a {gib(gpu)} GiB GPU, {gib(host)} GiB of host RAM" + (
        f" and {gib(disk)} GiB of disk" if disk is not None else " and no disk tier")
    seq, plan = longest(shape, gpu, host, disk, **kw)
    fixes = []
    need_gpu = min((sum(p.gpu.values()) for p in plans if p.fits(1 << 62, host, disk)), default=None)
    if need_gpu is not None:
        fixes.append(f"a GPU with {gib(need_gpu)} GiB (--gpu-gib)")
    need_disk = min((sum(p.disk.values()) for p in plans if p.fits(gpu, host, 1 << 62)), default=None)
    if disk is None:
        with_disk = [p for p in candidates(shape, seq_len, gpu, host, 1 << 62, **kw) if p.fits(gpu, host, 1 << 62)]
        need_disk = min((sum(p.disk.values()) for p in with_disk), default=None)
    if need_disk is not None:
        fixes.append(f"the disk tier with {gib(need_disk)} GiB free (offload_dir; --disk-gib)")
    need_host = min((sum(p.host.values()) for p in plans if p.fits(gpu, 1 << 62, disk)), default=None)
    if need_host is not None:
        fixes.append(f"{gib(need_host)} GiB of host RAM (--host-gib)")
    smallest_ws = min(p.gpu.get(LAYER_WS, 0) for p in plans) if plans else 0
    if smallest_ws > gpu:
        fixes.append(f"fewer tokens per micro-batch: one layer's backward alone takes {gib(smallest_ws)} GiB")
    longest_txt = (f"the longest that fits is {seq} tokens ({plan.placement()})" if plan is not None
                   else "not even 1024 tokens fit")
    return (f"megatrain: {shape.name or 'the model'} at {seq_len} tokens per sequence does not fit {machine}: no "
            f"placement of the optimizer state and the activation checkpoints fits all three; {longest_txt}. Fix: "
            + ("; or ".join(fixes + [f"--seq-len {seq}"]) if seq else "; or ".join(fixes or ["a smaller model"])) + ".")





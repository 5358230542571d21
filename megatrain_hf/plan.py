"""The training plan: every decision the engine makes from the options and the machine, once.

:func:`resolve` turns a ``MegaTrainConfig``, the :class:`Machine` (device, ranks, RAM, free disk) and
what the entry point knows of the :class:`Run` (bf16, accumulation, the optimizer) into a frozen
:class:`TrainingPlan`: compute and gradient dtypes, the moment format, the staging copy, which units'
moments and masters live on disk, ownership, transport, activation checkpoints, tiles, the loss,
threads, pinning. The engine builds its components from the plan's sections; ``megatrain
estimate`` prints the same plan resolved from a shape (``sizes``: the units' flats as the store lays
them out, from a real model or from ``memory/model_layout.shape_sizes``; ``cli/decisions.py``).

Every rule about which options combine is one row of :data:`RULES` (refused, with what, why and the
fix) or of :data:`ADJUSTMENTS` (the plan changes what was asked, and records it). :func:`check`
evaluates the rules whose inputs are known, so an entry point refuses as early as it can: the Trainer
plugin with its ``TrainingArguments``, the engine with the machine, the optimizer override with the
optimizer. ``docs/configuration.md``'s "what combines" table is :func:`combination_table`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Literal

import torch

from .config import MegaTrainConfig
from .core.grad_accumulators import BF16_FIX
from .core.grads import MAX_PENDING_SENDS
from .core.layout import UnitSizes, experts_in_fp32
from .errors import AttentionKernelError, IncompatibleOptionsError
from .memory import disk as disk_memory
from .memory import host as host_memory
from .memory.disk import DiskTier
from .memory.long_context import JointPlan
from .memory.shapes import ModelShape
from .optim.moment_formats import Format as MomentFormat
from .optim.moment_formats import format_of
from .placement import ResidencyPlan, check_length, place_long_context, residency

logger = logging.getLogger(__name__)

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""``torch.compile`` modes that capture CUDA graphs: refused with ``compile`` (the layer template computes with
other weight tensors at every layer and step, which a graph would copy into its static inputs)."""


# ---------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Machine:
    """What the plan needs of the machine; :meth:`detect` measures it, tests build it by hand."""

    device: torch.device  # the compute device
    cuda: bool = False  # torch.cuda.is_available()
    world_size: int = 1  # torch.distributed ranks (1: not running)
    rank: int = 0
    ram_available: int | None = None  # host RAM the run may take (None: not measured; not checked)
    disk_free: int | None = None  # free bytes of offload_dir's filesystem (None: not measured)
    cpus: int = 1  # the CPUs this process may run on
    grad_dtype_tensors: bool = True  # this torch has Tensor.grad_dtype (torch >= 2.10)
    gpu_memory: int | None = None  # the CUDA device's memory (None: not a GPU, or not measured)

    @classmethod
    def detect(cls, device: torch.device, offload_dir: str | None = None, ram_in_use: int = 0) -> "Machine":
        """This machine now; ``ram_in_use``: bytes the model holds that move into the store (available to it)."""
        import torch.distributed as dist

        running = dist.is_available() and dist.is_initialized()
        free = None
        if offload_dir is not None:  # the run directories of processes no longer alive are this run's space
            path = disk_memory.check_offload_dir(offload_dir)
            disk_memory.remove_stale_run_dirs(path)
            free = disk_memory.disk_free_bytes(path)
        gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" and torch.cuda.is_available() \
            else None
        return cls(device, torch.cuda.is_available(), dist.get_world_size() if running else 1,
                   dist.get_rank() if running else 0, host_memory.available_host_bytes() + ram_in_use, free,
                   MegaTrainConfig().resolve_host_threads(), hasattr(torch.Tensor, "grad_dtype"), gpu)


@dataclass(frozen=True)
class OptimizerChoice:
    """The optimizer a Trainer built: its class, whether megatrain can replace it by HostAdamW (a plain
    AdamW), whether it is kept (passed with its scheduler), whether it is a HostAdamW already."""

    name: str
    convertible: bool
    kept: bool = False
    host: bool = False


@dataclass(frozen=True)
class Run:
    """What the entry point knows of the run (None: not known there, its rules wait)."""

    bf16: bool = False  # the Trainer's / Accelerate's bf16 mixed precision
    grad_accum: int | None = None  # micro-batches per optimizer step
    optimizer: OptimizerChoice | None = None
    emulated_streams: bool = False  # the CUDA transfer pipelines emulated on the CPU (tests)
    seq_len: int | None = None  # the longest training sequence seen so far (the engine, per new maximum)
    attention: str | None = None  # the model's attention kernel (config._attn_implementation)
    gpu_working_set: int | None = None  # the streamed step's GPU bytes (megatrain estimate's plan), for residency
    experts: str | None = None  # the model's routed experts' kernel (config._experts_implementation); None: none


# ---------------------------------------------------------------------------------- the plan's sections
@dataclass(frozen=True)
class PrecisionPlan:
    compute: torch.dtype  # weights on the device and the compute
    grads: torch.dtype  # host accumulators of the bf16-streamed matrices (the rest: fp32)
    experts: torch.dtype | None = None  # wire and compute dtype of the routed experts (None: the model has none)


@dataclass(frozen=True)
class OptimizerPlan:
    moments: MomentFormat | None  # HostAdamW's moment format; None: megatrain replaces no AdamW
    kernel: Literal["native", "torch"]  # the host update's kernel
    device_update: bool  # the GPU takes a share of the update (optim/device_update.py)
    device_keeps_grads: bool  # ... its units' gradients stay on the GPU from backward to update
    threads: int  # torch CPU threads for the host work


@dataclass(frozen=True)
class HostPlan:
    staging: bool  # the compute-dtype copy of the matrices' masters in RAM (never for fp32 compute)
    pin: bool  # page-locked flats
    check_ram: bool  # admission against the RAM before allocating


@dataclass(frozen=True)
class DiskPlan:
    dir: str | None  # offload_dir
    window: int  # RAM slots of the tier
    io: str  # disk_io
    tiers: DiskTier  # which units' moments (and masters) are on disk, and the bytes


@dataclass(frozen=True)
class OwnershipPlan:
    sharded: bool  # each unit owned by one rank (data parallelism); False: every unit local
    world_size: int
    rank: int
    timeout_s: float


@dataclass(frozen=True)
class TransportPlan:
    streams: bool  # CUDA streams (or emulated ones); False: inline on the CPU
    receive_slots: tuple[int, int]  # (weight, gradient) slots for the units other ranks own


@dataclass(frozen=True)
class ActivationPlan:
    offload_checkpoints: bool | str  # True: pinned host; False: the device; "auto": the GPU budget decides;
    # "disk": files under disk_dir
    checkpoint_interval: int
    tile_tokens: int | str | None  # sequence_tile_tokens, resolved per call by memory/activations.tile_policy
    compute_bytes: int
    gpu_budget: int | None  # max_gpu_memory in bytes
    checkpoint_dtype: torch.dtype | None = None  # checkpoint_dtype="bf16" (None: each input's own dtype)
    disk_dir: str | None = None  # offload_dir: "disk" checkpoints, and host ones the RAM cannot take, go there
    # max_seq_len on CUDA: the caching allocator on expandable segments (memory/budget.py), as under max_gpu_memory
    expandable_segments: bool = False


@dataclass(frozen=True)
class LossPlan:
    chunked: bool  # at attach; "auto" is turned on by the Trainer integration under plain Trainer
    chunk_tokens: int | None


@dataclass(frozen=True)
class CompilePlan:
    backend: str  # torch.compile backend of the layer templates (runtime/compiled.py)
    mode: str | None


@dataclass(frozen=True)
class TrainingPlan:
    """Every decision of one engine, in the sections its components take (built by :func:`resolve`)."""

    config: MegaTrainConfig
    machine: Machine
    run: Run
    precision: PrecisionPlan
    optimizer: OptimizerPlan
    host: HostPlan
    disk: DiskPlan
    ownership: OwnershipPlan
    transport: TransportPlan
    activations: ActivationPlan
    loss: LossPlan
    adjustments: tuple[tuple[str, str], ...] = field(default=())  # (ADJUSTMENTS key, detail): what the plan changed
    compile: CompilePlan | None = None  # regional compilation of the layer templates; None: eager
    long_context: JointPlan | None = None  # max_seq_len: the placement planned at that length
    residency: ResidencyPlan = field(default=ResidencyPlan())

    def check_length(self, seq_len: int, longest_before: int = 0) -> None:
        """A training sequence longer than any before (``longest_before``): beyond ``max_seq_len`` it is logged
        (the first time) where the placement still fits it, and refused (before its forward allocates) where
        it does not."""
        check_length(self, seq_len, longest_before)

    @property
    def device(self) -> torch.device:
        return self.machine.device

    def check(self, **run) -> None:
        """Refuse what the options do not combine with once the run is known better (``optimizer=...``)."""
        check(self.config, self.machine, replace(self.run, **run))


# ---------------------------------------------------------------------------------- the rules
@dataclass(frozen=True)
class _Facts:
    config: MegaTrainConfig
    machine: Machine | None
    run: Run

    @property
    def compute(self) -> torch.dtype:
        return self.config.resolve_dtype(trainer_bf16=self.run.bf16)

    @property
    def sharded(self) -> bool:  # False where the machine is not known yet
        return self.machine is not None and self.machine.world_size > 1 and self.config.data_parallel is not False

    @property
    def host_adamw(self) -> bool | None:  # HostAdamW updates the host state (None: the optimizer is not known)
        o, c = self.run.optimizer, self.config
        return None if o is None else o.host or (o.convertible and c.replace_adamw and not o.kept)

    @property
    def resident(self) -> bool:  # resident units asked for by count (an int >= 1)
        return self.config.resident_units != "auto" and self.config.resident_units > 0

    @property
    def masters_on_disk(self) -> bool:
        return self.config.offload_dir is not None and self.config.offload_state == "all"


@dataclass(frozen=True)
class Rule:
    """Two choices that do not combine: ``refuses(facts)`` says when, ``message(facts)`` what, why and the fix."""

    pair: tuple[str, str]
    refuses: Callable[[_Facts], bool]
    message: Callable[[_Facts], str]
    error: type[Exception] = IncompatibleOptionsError


def _why_not_host_adamw(f: _Facts) -> str:
    o = f.run.optimizer
    return (f"the optimizer is {o.name}" if not o.convertible else
            "replace_adamw=False keeps torch's AdamW" if not f.config.replace_adamw else
            "an optimizer passed with its scheduler in Trainer(optimizers=(opt, sched)) is kept as it is")


def _host_adamw_fix(f: _Facts) -> str:
    """What makes HostAdamW take over, for the reason :func:`_why_not_host_adamw` gives."""
    o = f.run.optimizer
    return ("train with AdamW (optim='adamw_torch_fused', the default, or 'adamw_torch')" if not o.convertible else
            "replace_adamw=True (the default: HostAdamW replaces the AdamW)" if not f.config.replace_adamw else
            "leave optimizers=(...) out (Trainer then creates AdamW, which HostAdamW replaces)")


def _host_adamw_options(c: MegaTrainConfig) -> list[str]:
    wants = [f"optimizer_state={c.optimizer_state!r}"] if c.optimizer_state != "fp32" else []
    wants += [f"offload_dir={c.offload_dir!r}"] if c.offload_dir is not None else []
    return wants + ([f"grad_dtype={c.grad_dtype!r}"] if c.grad_dtype != "fp32" else [])


def _grad_bf16(why: str) -> Callable[[_Facts], str]:
    return lambda f: (f"MegaTrainConfig(grad_dtype={f.config.grad_dtype!r}) keeps the one bf16 gradient a bf16 "
                      f"weight gets per step, but {why}. {BF16_FIX}")


def _masters_need_staging(why: str) -> Callable[[_Facts], str]:
    return lambda f: ("offload_state='all' puts the fp32 masters on disk, which needs the bf16 staging copy that the "
                      f"device streams instead of them; here {why}, so the device reads the masters themselves. Fix: "
                      "bf16 compute (bf16=True or compute_dtype='bf16') with host_staging=True or 'auto', or "
                      "offload_state='moments'.")


LONG_CONTEXT_TOKENS = 16384
"""From this many tokens per sequence a kernel that materialises the scores is refused: HF's eager
attention holds ``heads x seq x seq`` scores and probabilities per layer (32 heads at 16K tokens:
16 GiB of bf16 scores for one sequence, and as much again for their gradient)."""


def _eager_at_long_context(f: _Facts) -> str:
    n = f.run.seq_len
    return (f"megatrain: a training sequence of {n} tokens with attn_implementation='eager': HF's eager attention "
            f"materialises the scores of every head ({n} x {n} = {n * n / 2**30:.2f} Gi elements per head and layer, "
            "with their softmax and gradients), which no sequence tiling bounds. Fix: load the model with "
            "attn_implementation='sdpa' (PyTorch's flash backend on CUDA) or 'flash_attention_2' (pip install "
            "flash-attn; packed batches through position_ids, without a mask); for Gemma 2's attention soft-capping, "
            "'flash_attention_2' or 'flex_attention' keep it (sdpa drops it); or train shorter sequences "
            f"(< {LONG_CONTEXT_TOKENS} tokens).")


def _resident_needs(what: str, fix: str) -> Callable[[_Facts], str]:
    return lambda f: (f"MegaTrainConfig(resident_units={f.config.resident_units!r}) keeps those units' fp32 masters, "
                      f"gradients and AdamW moments on the device, updated there by HostAdamW, but {what}. Fix: {fix}, "
                      "or resident_units=0 (every unit streams).")


RULES: tuple[Rule, ...] = (
    Rule((f"long context (sequences of {LONG_CONTEXT_TOKENS}+ tokens)", "attn_implementation='eager'"),
         lambda f: f.run.attention == "eager" and (f.run.seq_len or 0) >= LONG_CONTEXT_TOKENS,
         _eager_at_long_context, AttentionKernelError),
    Rule(("device", "machine: CUDA"),
         lambda f: f.machine is not None and f.machine.device.type == "cuda" and not f.machine.cuda,
         lambda f: f"device {f.machine.device} was asked for but CUDA is not available; use device='cpu'."),
    Rule(("data_parallel=True", "machine: one rank"),
         lambda f: f.machine is not None and f.config.data_parallel is True and f.machine.world_size <= 1,
         lambda f: "megatrain: data_parallel=True but torch.distributed is not initialised with more than one "
                   "rank. Fix: launch with torchrun / accelerate launch --num_processes N, or data_parallel='auto'."),
    Rule(("offload_checkpoints='disk'", "offload_dir=None"),
         lambda f: f.config.offload_checkpoints == "disk" and f.config.offload_dir is None,
         lambda f: "MegaTrainConfig(offload_checkpoints='disk') keeps the activation checkpoints in files under "
                   "offload_dir, but offload_dir is not set. Fix: offload_dir='/nvme/megatrain' (a local disk with "
                   "room for the checkpoints: megatrain estimate --offload-dir DIR plans it), or "
                   "offload_checkpoints=True (pinned host RAM)."),
    Rule(("checkpoint_dtype='bf16'", "compute_dtype fp32"),
         lambda f: f.config.checkpoint_dtype == "bf16" and f.compute != torch.bfloat16,
         lambda f: "MegaTrainConfig(checkpoint_dtype='bf16') rounds the activation checkpoints to bf16, but compute is "
                   "fp32, the exact mode whose recompute needs the fp32 inputs. Fix: bf16 compute (bf16=True or "
                   "compute_dtype='bf16'), or checkpoint_dtype='fp32' (the default)."),
    Rule(("offload_dir", "device_update"),
         lambda f: f.config.offload_dir is not None and f.config.device_update,
         lambda f: f"MegaTrainConfig(offload_dir={f.config.offload_dir!r}) does not combine with device_update=True "
                   "(the device's share would keep the moments it pages on the GPU). Fix: leave device_update off, "
                   "or offload_dir unset."),
    Rule(("grad_dtype='bf16'", "compute_dtype fp32"),
         lambda f: f.config.grad_dtype != "fp32" and f.compute != torch.bfloat16,
         _grad_bf16("compute is fp32 (the device's gradients are fp32)")),
    Rule(("grad_dtype='bf16'", "data parallelism"),
         lambda f: f.config.grad_dtype != "fp32" and f.sharded, _grad_bf16("data parallelism sums the ranks' gradients")),
    Rule(("grad_dtype='bf16'", "device_update"),
         lambda f: f.config.grad_dtype != "fp32" and f.config.device_update,
         _grad_bf16("device_update keeps fp32 gradients on the device")),
    Rule(("grad_dtype='bf16'", "machine: torch without Tensor.grad_dtype"),
         lambda f: f.config.grad_dtype != "fp32" and f.machine is not None and not f.machine.grad_dtype_tensors,
         _grad_bf16(f"this torch ({torch.__version__}) has no Tensor.grad_dtype (torch >= 2.10 has)")),
    Rule(("grad_dtype='bf16'", "gradient_accumulation_steps > 1"),
         lambda f: f.config.grad_dtype != "fp32" and (f.run.grad_accum or 1) > 1,
         lambda f: f"MegaTrainConfig(grad_dtype={f.config.grad_dtype!r}) keeps one bf16 gradient per weight and step, "
                   f"but gradient_accumulation_steps={f.run.grad_accum} (TrainingArguments; estimate's --grad-accum) "
                   "adds several. Fix: gradient_accumulation_steps=1 (a larger per_device_train_batch_size for the "
                   "same batch), or grad_dtype='fp32'."),
    Rule(("offload_state='all'", "compute_dtype fp32"),
         lambda f: f.masters_on_disk and f.compute == torch.float32, _masters_need_staging("compute is fp32")),
    Rule(("offload_state='all'", "host_staging=False"),
         lambda f: f.masters_on_disk and f.config.host_staging is False, _masters_need_staging("host_staging=False")),
    Rule(("offload_state='all'", "data parallelism"),
         lambda f: f.masters_on_disk and f.sharded,
         lambda f: "offload_state='all' puts the fp32 masters on disk, but data parallelism broadcasts the masters "
                   "from RAM (each unit's owner sends them to the other ranks). Fix: offload_state='moments', or "
                   "data_parallel=False to train each rank alone."),
    Rule(("device_update", "data parallelism"),
         lambda f: f.config.device_update and f.sharded,
         lambda f: "megatrain: device_update=True is not supported under data parallelism (the GPU share of the "
                   "update does not know the unit owners). Fix: device_update=False, or data_parallel=False to "
                   "train each rank alone."),
    Rule(("optimizer_state", "device_update"),
         lambda f: f.config.replace_adamw and f.config.device_update and f.config.optimizer_state != "fp32",
         lambda f: f"megatrain: optimizer_state={f.config.optimizer_state!r} cannot be combined with "
                   "device_update=True (the device's share updates fp32 moments). Fix: set device_update=False or "
                   "optimizer_state='fp32'."),
    Rule(("optimizer_state, offload_dir, grad_dtype", "an optimizer other than HostAdamW"),
         lambda f: f.host_adamw is False and bool(_host_adamw_options(f.config)),
         lambda f: f"megatrain: {' and '.join(_host_adamw_options(f.config))} applies to megatrain's HostAdamW, but "
                   f"{_why_not_host_adamw(f)}. Fix: train with AdamW (optim='adamw_torch_fused', the default, or "
                   "'adamw_torch'; no scheduler in optimizers=) and replace_adamw=True, or leave "
                   + " and ".join(w.split("=")[0] for w in _host_adamw_options(f.config)) + " at its default."),
    Rule(("data parallelism", "an optimizer other than HostAdamW"),
         lambda f: f.host_adamw is False and f.sharded,
         lambda f: f"megatrain data parallelism over {f.machine.world_size} ranks needs its HostAdamW (each rank "
                   f"updates the units it owns), but {_why_not_host_adamw(f)}. Fix: {_host_adamw_fix(f)}, or "
                   "data_parallel=False (each rank trains alone), or run one process."),
    Rule(("resident_units", "machine: CUDA"),
         lambda f: f.resident and f.machine is not None and f.machine.device.type == "cuda",
         _resident_needs("the CUDA path of resident units is tested on the CPU through emulated CUDA streams but "
                         "has not run on a GPU yet (tests/gpu/test_resident_gpu.py; docs/log.md)",
                         "train on CUDA with resident_units='auto' (0 there for now)")),
    Rule(("resident_units", "an optimizer other than HostAdamW"),
         lambda f: f.resident and (not f.config.replace_adamw or f.host_adamw is False),
         lambda f: _resident_needs(
             "replace_adamw=False keeps torch's AdamW" if not f.config.replace_adamw else _why_not_host_adamw(f),
             "replace_adamw=True" if not f.config.replace_adamw else _host_adamw_fix(f))(f)),
    Rule(("resident_units", "data parallelism"),
         lambda f: f.resident and f.sharded,
         _resident_needs("data parallelism keeps each unit's state on its owner rank's host",
                         "data_parallel=False (each rank trains alone)")),
    Rule(("resident_units", "device_update"),
         lambda f: f.resident and f.config.device_update,
         _resident_needs("device_update moves the state of its share up and down every step", "device_update=False")),
    Rule(("resident_units", "offload_dir"),
         lambda f: f.resident and f.config.offload_dir is not None,
         _resident_needs("offload_dir pages the moments through the disk tier", "offload_dir=None")),
    Rule(("resident_units", "optimizer_state"),
         lambda f: f.resident and f.config.optimizer_state != "fp32",
         _resident_needs("the device update keeps fp32 moments", "optimizer_state='fp32'")),
    Rule(("resident_units", "grad_dtype='bf16'"),
         lambda f: f.resident and f.config.grad_dtype != "fp32",
         _resident_needs("the device gradients are fp32 accumulators", "grad_dtype='fp32'")),
    Rule(("compile_mode", "CUDA graphs"),
         lambda f: f.config.compile and f.config.compile_mode in CUDA_GRAPH_MODES,
         lambda f: f"MegaTrainConfig(compile_mode={f.config.compile_mode!r}) (TrainingArguments.torch_compile_mode) "
                   "captures CUDA graphs, but the compiled layer template computes with other weight tensors at "
                   "every layer and step (streamed), which a graph would copy into its static inputs each replay. "
                   "Fix: compile_mode=None (torch_compile_mode unset) or 'max-autotune-no-cudagraphs'."),
)


def check(config: MegaTrainConfig, machine: Machine | None = None, run: Run = Run()) -> None:
    """Raise the first rule of :data:`RULES` that refuses these choices (those whose inputs are not known
    yet, e.g. the machine before attach or the optimizer before the Trainer built it, wait)."""
    facts = _Facts(config, machine, run)
    for rule in RULES:
        if rule.refuses(facts):
            raise rule.error(rule.message(facts))


# ---------------------------------------------------------------------------------- adjustments
ADJUSTMENTS: dict[str, tuple[tuple[str, str], str]] = {
    "compute_dtype auto": (("compute_dtype='auto'", "run: bf16"), "bf16 when the Trainer or Accelerate runs bf16, "
                           "else fp32"),
    "experts fp32": (("experts_dtype='auto'", "model: an experts kernel other than eager"), "the routed experts "
                     "cross the link and compute in fp32, as plain bf16 training computes them (transformers' "
                     "default grouped_mm ignores autocast): exact, at twice their link bytes; "
                     "experts_dtype='compute' sends them in bf16"),
    "staging fp32": (("host_staging", "compute_dtype fp32"), "no staging copy: the device reads the fp32 masters"),
    "staging dropped": (("host_staging='auto'", "machine: RAM"), "drops the bf16 host copy of the weights (2 B per "
                        "matrix parameter) where that makes the plan fit RAM; the GPU rounds the fp32 masters"),
    "state to disk": (("offload_state='auto'", "machine: RAM"), "the fewest units' moments go to disk that make the "
                      "plan fit RAM, then the fewest units' masters"),
    "offload_state without dir": (("offload_state", "offload_dir=None"), "nothing goes to disk"),
    "tier without HostAdamW": (("offload_dir", "replace_adamw=False"), "no disk tier at attach (no HostAdamW "
                               "moments); a Trainer's optimizer is refused"),
    "data_parallel auto": (("data_parallel='auto'", "machine: ranks"), "units owned by one rank each when "
                           "torch.distributed runs more than one"),
    "pin auto": (("pin_memory='auto'", "device"), "pinned on CUDA, not on the CPU"),
    "kernel auto": (("host_adamw_kernel='auto'", "device"), "megatrain's native kernel on CUDA, torch's on the CPU"),
    "device grads under a budget": (("device_update", "max_gpu_memory"), "the device's units do not keep their "
                                    "gradients on the GPU (no room is planned for them)"),
    "threads": (("host_threads=None", "machine: CPUs"), "every CPU this process may run on"),
    "resident auto": (("resident_units='auto'", "machine: device, GPU budget"), "0 on the CPU; on CUDA the count "
                      "that fits the budget less the step's working set is reported, 0 placed (until a GPU run measured it)"),
    "resident clamped": (("resident_units", "the model's units"), "a count above the number of units keeps every "
                         "unit resident"),
    "chunked_loss auto": (("chunked_loss='auto'", "entry point"), "off at attach; the Trainer integration turns it "
                          "on under plain transformers.Trainer"),
    "allocator expandable": (("max_seq_len", "machine: CUDA"), "the caching allocator is switched to expandable "
                             "segments (as under max_gpu_memory; a PYTORCH_CUDA_ALLOC_CONF naming expandable_segments "
                             "wins): at 512K tokens fixed segments reserved up to 24 GiB above the allocated peak"),
    "max_seq_len placement": (("max_seq_len", "machine: GPU, RAM, disk"), "offload_checkpoints, checkpoint_interval, "
                              "host_staging and offload_state left at 'auto' take the exact placement at that length "
                              "(LongContextFitError when only inexact options fit)"),
}
"""Where the plan changes or settles what was asked: key -> ((the two choices), what happens)."""


def combination_table() -> str:
    """docs/configuration.md's "what combines" table: every rule and adjustment of the plan."""
    rows = ["| choice | with | what happens |", "|---|---|---|"]
    rows += [f"| `{r.pair[0]}` | {r.pair[1]} | refused (`{r.error.__name__}`) |" for r in RULES]
    rows += [f"| `{pair[0]}` | {pair[1]} | {what} |" for pair, what in ADJUSTMENTS.values()]
    return "\n".join(rows)


# ---------------------------------------------------------------------------------- resolution
def resolve(config: MegaTrainConfig, machine: Machine, run: Run = Run(),
            sizes: Callable[[torch.dtype, torch.dtype | None], list[UnitSizes]] | None = None,
            shape: Callable[[], ModelShape] | None = None) -> TrainingPlan:
    """The plan of ``config`` on ``machine``: refuses what does not combine (:func:`check`), then decides.

    ``sizes(compute_dtype, experts_dtype)``: the units' flats as the store lays them out with these
    dtypes of the matrices and of the routed experts, for the admission against RAM and disk (None:
    nothing admitted, every moment in RAM). ``shape()``: the model's shape, for ``max_seq_len``'s
    placement (:func:`place_long_context`)."""
    check(config, machine, run)
    notes: list[tuple[str, str]] = []
    joint = None
    if config.max_seq_len is not None:
        config, joint = place_long_context(config, machine, run, shape, notes)
        check(config, machine, run)
    f, c = _Facts(config, machine, run), config
    compute = f.compute
    if c.compute_dtype == "auto":
        notes.append(("compute_dtype auto", str(compute).replace("torch.", "")))
    experts = None if run.experts is None else compute
    if compute != torch.float32 and experts_in_fp32(run.experts, c.experts_dtype):
        experts = torch.float32
        notes.append(("experts fp32", f"experts kernel {run.experts!r}"))
    moments = format_of(c.optimizer_state) if c.replace_adamw else None
    if c.offload_dir is not None and moments is None:
        notes.append(("tier without HostAdamW", ""))
    if c.offload_dir is None and c.offload_state != "auto":
        notes.append(("offload_state without dir", f"offload_state={c.offload_state!r}"))
    if f.sharded and c.data_parallel == "auto":
        notes.append(("data_parallel auto", f"{machine.world_size} ranks"))
    grads = torch.bfloat16 if c.grad_dtype == "bf16" else torch.float32
    expandable = joint is not None and machine.device.type == "cuda"
    if expandable:
        notes.append(("allocator expandable", f"max_seq_len={c.max_seq_len}"))
    staging, tiers = c.host_staging is not False, DiskTier(False)
    units = sizes(compute, experts) if sizes is not None else None
    if units is not None:
        masters_possible = compute != torch.float32 and c.host_staging is not False and not f.sharded
        staging, tiers = disk_memory.place_tiers(
            units, compute, c.host_staging, moments.mode if moments else None, c.offload_dir,
            c.offload_state, machine.ram_available if c.check_host_memory else None, machine.disk_free,
            masters_possible, grads, c.offload_window)
    if compute == torch.float32 and c.host_staging is not False:
        notes.append(("staging fp32", ""))
    elif c.host_staging == "auto" and not staging:
        notes.append(("staging dropped", ""))
    if c.offload_state == "auto" and tiers.on_disk:
        notes.append(("state to disk", f"moments of {len(tiers.units)} unit(s), masters of {len(tiers.masters)}: "
                      f"{host_memory.gib(tiers.disk_bytes)} GiB on disk, {host_memory.gib(tiers.ram_bytes)} GiB of RAM slots"))
    for key, option in (("pin auto", c.pin_memory), ("kernel auto", c.host_adamw_kernel),
                        ("chunked_loss auto", c.chunked_loss)):
        if option == "auto":
            notes.append((key, ""))
    budget = c.gpu_memory_bytes()
    if c.device_update and budget is not None:
        notes.append(("device grads under a budget", ""))
    if c.host_threads is None:
        notes.append(("threads", f"{machine.cpus}"))
    streams = machine.device.type == "cuda" or run.emulated_streams
    residency_plan = residency(c, machine, run, compute, units, notes)
    plan = TrainingPlan(
        config, machine, run, PrecisionPlan(compute, grads, experts),
        OptimizerPlan(moments, c.resolve_host_adamw_kernel(machine.device), c.device_update,
                      c.device_update and budget is None, c.host_threads or machine.cpus),
        HostPlan(staging and compute != torch.float32, c.resolve_pin(machine.device), c.check_host_memory),
        DiskPlan(c.offload_dir, c.offload_window, c.disk_io, tiers),
        OwnershipPlan(f.sharded, machine.world_size if f.sharded else 1, machine.rank if f.sharded else 0,
                      c.collective_timeout_s),
        TransportPlan(streams, (3, MAX_PENDING_SENDS + 2) if streams else (1, 1)),
        ActivationPlan(c.offload_checkpoints, c.resolve_checkpoint_interval(), c.sequence_tile_tokens,
                       torch.finfo(compute).bits // 8, budget,
                       torch.bfloat16 if c.checkpoint_dtype == "bf16" else None, c.offload_dir, expandable),
        LossPlan(c.chunked_loss is True, c.loss_chunk_tokens), tuple(notes),
        CompilePlan(c.compile_backend, c.compile_mode) if c.compile else None, joint, residency_plan)
    for key, detail in notes:
        logger.log(logging.INFO if key in ("staging dropped", "state to disk", "max_seq_len placement", "experts fp32")
                   else logging.DEBUG,
                   "megatrain plan: %s x %s: %s%s", *ADJUSTMENTS[key][0], ADJUSTMENTS[key][1],
                   f" ({detail})" if detail else "")
    return plan

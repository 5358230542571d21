"""The training plan's compatibility table: every pair of choices the plan refuses or adjusts, one row each.

Each row is (options, machine, run) -> a refusal (its type and the key words of its message) or an
adjustment (its key in ``plan.adjustments`` and the decision it leads to). The machine and the units'
layout are built by hand (no model, no GPU): a CUDA device is only a ``torch.device`` here. The last
tests check that the table covers every rule and adjustment of ``megatrain_hf/plan.py``, so a rule added
without a row fails here.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatrain_hf import MegaTrainConfig
from megatrain_hf.core.layout import TensorSpec, lay_out
from megatrain_hf.memory.host_tiers import host_tiers
from megatrain_hf.errors import (AttentionKernelError, DiskSpaceError, HostMemoryError, IncompatibleOptionsError,
                                  LongContextFitError, MegatrainError)
from megatrain_hf.memory.shapes import PRESETS
from megatrain_hf.memory.host import DEFAULT_HEADROOM_BYTES
from megatrain_hf.placement import unit_device_bytes
from megatrain_hf.plan import ADJUSTMENTS, RULES, Machine, OptimizerChoice, Run, check, resolve

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
HIDDEN, LAYERS = 256, 4
G = 2**30
H100 = dict(device=CUDA, cuda=True, gpu_memory=79 * G, ram_available=125 * G)  # max_seq_len's rows: the 7 B's shape


def shape():
    """The shape ``max_seq_len``'s placement plans (the engine's: the model's config)."""
    return PRESETS["llama-7b"]


def sizes(compute: torch.dtype, experts: torch.dtype | None = None):
    """A small model as the store lays it out: an embedding, LAYERS layers (a matrix streamed in the compute
    dtype, routed experts in ``experts`` if any, and a norm in fp32), a final norm, a head."""
    units = [[TensorSpec(1000 * HIDDEN, True, torch.float32)]]
    routed = [TensorSpec(8 * HIDDEN * HIDDEN, True, experts)] if experts is not None else []
    units += [[TensorSpec(4 * HIDDEN * HIDDEN, True, compute), *routed, TensorSpec(HIDDEN, True, torch.float32)]] * LAYERS
    units += [[TensorSpec(HIDDEN, True, torch.float32)], [TensorSpec(1000 * HIDDEN, True, compute)]]
    return [lay_out([TensorSpec(s.numel, s.trainable, s.wire) for s in unit]) for unit in units]


def ram(compute=torch.bfloat16, staging=True, moments="fp32", spare=0) -> int:
    """RAM that holds the tiers of :func:`sizes` (with the headroom), plus ``spare`` bytes."""
    tiers = host_tiers(sizes(compute), compute, staging=staging, optimizer_state=moments)
    return sum(tiers.values()) + DEFAULT_HEADROOM_BYTES + spare


def resident_bytes(n: int) -> int:
    """Device bytes of the first ``n`` units of :func:`sizes` kept resident (bf16 compute)."""
    return sum(unit_device_bytes(s, torch.bfloat16) for s in sizes(torch.bfloat16)[:n])


SGD = OptimizerChoice("SGD", convertible=False)
ADAMW = OptimizerChoice("AdamW", convertible=True)
KEPT = OptimizerChoice("AdamW", convertible=True, kept=True)

# (id, options, machine, run, expected): expected is ("refused", type, key words) or ("adjusts", key, decision)
ROWS = [
    # ------------------------------------------------------------------ refused
    ("cuda without CUDA", {}, dict(device=CUDA, cuda=False), {},
     ("refused", IncompatibleOptionsError, r"device cuda:0 was asked for but CUDA is not available")),
    ("eager attention at long context", {}, {}, dict(seq_len=16384, attention="eager"),
     ("refused", AttentionKernelError, r"16384 tokens with attn_implementation='eager'.*materialises the scores.*"
                                       r"Fix: load the model with attn_implementation='sdpa'")),
    ("data_parallel=True on one rank", dict(data_parallel=True), {}, {},
     ("refused", IncompatibleOptionsError, r"data_parallel=True but torch.distributed .*Fix: launch with torchrun")),
    ("disk checkpoints without offload_dir", dict(offload_checkpoints="disk"), {}, {},
     ("refused", IncompatibleOptionsError, r"offload_checkpoints='disk'.*offload_dir is not set\. Fix: offload_dir=")),
    ("bf16 checkpoints with fp32 compute", dict(checkpoint_dtype="bf16"), {}, dict(bf16=False),
     ("refused", IncompatibleOptionsError, r"checkpoint_dtype='bf16'.*compute is fp32.*Fix: bf16 compute")),
    ("offload_dir with device_update", dict(offload_dir="DIR", device_update=True), {}, {},
     ("refused", IncompatibleOptionsError, r"offload_dir=.* does not combine with device_update=True.*Fix")),
    ("grad bf16 with fp32 compute", dict(grad_dtype="bf16"), {}, dict(bf16=False),
     ("refused", IncompatibleOptionsError, r"grad_dtype='bf16'.*compute is fp32.*Fix: .*grad_dtype='fp32'")),
    ("grad bf16 under data parallelism", dict(grad_dtype="bf16"), dict(world_size=2), dict(bf16=True),
     ("refused", IncompatibleOptionsError, r"grad_dtype='bf16'.*data parallelism sums the ranks' gradients")),
    ("grad bf16 with device_update", dict(grad_dtype="bf16", device_update=True), {}, dict(bf16=True),
     ("refused", IncompatibleOptionsError, r"grad_dtype='bf16'.*device_update keeps fp32 gradients")),
    ("grad bf16 on a torch without grad_dtype", dict(grad_dtype="bf16"), dict(grad_dtype_tensors=False),
     dict(bf16=True), ("refused", IncompatibleOptionsError, r"grad_dtype='bf16'.*has no Tensor.grad_dtype")),
    ("grad bf16 with accumulation", dict(grad_dtype="bf16"), {}, dict(bf16=True, grad_accum=4),
     ("refused", IncompatibleOptionsError, r"gradient_accumulation_steps=4 .*adds several\. Fix")),
    ("masters on disk with fp32 compute", dict(offload_dir="DIR", offload_state="all"), {}, dict(bf16=False),
     ("refused", IncompatibleOptionsError, r"offload_state='all' .*needs the bf16 staging copy.*compute is fp32")),
    ("masters on disk without staging", dict(offload_dir="DIR", offload_state="all", host_staging=False), {},
     dict(bf16=True), ("refused", IncompatibleOptionsError, r"bf16 staging copy.*here host_staging=False.*Fix")),
    ("masters on disk under data parallelism", dict(offload_dir="DIR", offload_state="all"), dict(world_size=2),
     dict(bf16=True), ("refused", IncompatibleOptionsError, r"data parallelism broadcasts the masters.*Fix")),
    ("device_update under data parallelism", dict(device_update=True), dict(world_size=2), {},
     ("refused", IncompatibleOptionsError, r"device_update=True is not supported under data parallelism.*Fix")),
    ("compressed moments with device_update", dict(optimizer_state="8bit", device_update=True), {}, {},
     ("refused", IncompatibleOptionsError, r"optimizer_state='8bit' cannot be combined with device_update")),
    ("compile with a CUDA-graph mode", dict(compile=True, compile_mode="reduce-overhead"), {}, {},
     ("refused", IncompatibleOptionsError, r"compile_mode='reduce-overhead'.*captures CUDA graphs.*Fix: compile_mode=None")),
    ("HostAdamW options with SGD", dict(optimizer_state="4bit", grad_dtype="bf16"), {},
     dict(bf16=True, optimizer=SGD),
     ("refused", IncompatibleOptionsError, r"optimizer_state='4bit' and grad_dtype='bf16' applies to megatrain's "
                                           r"HostAdamW, but the optimizer is SGD\. Fix")),
    ("HostAdamW options with a kept optimizer", dict(offload_dir="DIR"), {}, dict(optimizer=KEPT),
     ("refused", IncompatibleOptionsError, r"offload_dir=.* applies to .*HostAdamW, but an optimizer passed with "
                                           r"its scheduler .* is kept")),
    ("HostAdamW options with replace_adamw=False", dict(optimizer_state="bf16", replace_adamw=False), {},
     dict(optimizer=ADAMW), ("refused", IncompatibleOptionsError, r"replace_adamw=False keeps torch's AdamW")),
    ("data parallelism with SGD", {}, dict(world_size=2), dict(optimizer=SGD),
     ("refused", IncompatibleOptionsError, r"data parallelism over 2 ranks needs its HostAdamW .*, but the optimizer "
                                           r"is SGD\. Fix")),
    ("data parallelism with replace_adamw=False", dict(replace_adamw=False), dict(world_size=2), dict(optimizer=ADAMW),
     ("refused", IncompatibleOptionsError, r"data parallelism over 2 ranks needs its HostAdamW .*, but "
                                           r"replace_adamw=False keeps torch's AdamW\. Fix: replace_adamw=True .*"
                                           r"or data_parallel=False")),
    ("data parallelism with a kept optimizer", {}, dict(world_size=2), dict(optimizer=KEPT),
     ("refused", IncompatibleOptionsError, r"needs its HostAdamW .* is kept as it is\. Fix: leave optimizers=\(\.\.\.\) "
                                           r"out")),
    ("resident units on CUDA", dict(resident_units=2), dict(device=CUDA, cuda=True), {},
     ("refused", IncompatibleOptionsError, r"resident_units=2.*CUDA path of resident units .*has not run on a GPU yet.*Fix")),
    ("resident units with SGD", dict(resident_units=2), {}, dict(optimizer=SGD),
     ("refused", IncompatibleOptionsError, r"resident_units=2.*the optimizer is SGD\. Fix: train with AdamW")),
    ("resident units with replace_adamw=False", dict(resident_units=1, replace_adamw=False), {}, {},
     ("refused", IncompatibleOptionsError, r"resident_units=1.*replace_adamw=False keeps torch's AdamW\. Fix: "
                                           r"replace_adamw=True")),
    ("resident units under data parallelism", dict(resident_units=2), dict(world_size=2), {},
     ("refused", IncompatibleOptionsError, r"resident_units=2.*data parallelism.*Fix: data_parallel=False")),
    ("resident units with device_update", dict(resident_units=2, device_update=True), {}, {},
     ("refused", IncompatibleOptionsError, r"resident_units=2.*device_update.*Fix: device_update=False")),
    ("resident units with a disk tier", dict(resident_units=2, offload_dir="DIR"), {}, {},
     ("refused", IncompatibleOptionsError, r"resident_units=2.*offload_dir pages the moments.*Fix: offload_dir=None")),
    ("resident units with compressed moments", dict(resident_units=2, optimizer_state="8bit"), {}, {},
     ("refused", IncompatibleOptionsError, r"resident_units=2.*fp32 moments\. Fix: optimizer_state='fp32'")),
    ("resident units with bf16 gradients", dict(resident_units=2, grad_dtype="bf16"), {}, dict(bf16=True),
     ("refused", IncompatibleOptionsError, r"resident_units=2.*fp32 accumulators\. Fix: grad_dtype='fp32'")),
    ("RAM short", dict(host_staging=True), dict(ram_available=ram(spare=-1)), dict(bf16=True),
     ("refused", HostMemoryError, r"(?s)megatrain needs [\d.]+ MiB of host RAM .*short by +1 B\n")),
    ("disk short", dict(offload_dir="DIR", offload_state="moments"), dict(disk_free=2**20), {},
     ("refused", DiskSpaceError, r"disk tier needs [\d.]+ MiB .* but its filesystem has 1\.00 MiB free")),
    ("max_seq_len that only inexact options fit", dict(max_seq_len=524288), H100, dict(bf16=True),
     ("refused", LongContextFitError, r"max_seq_len=524288\).*longest that fits is 2\d{5} tokens.*Fix: "
                                      r"checkpoint_dtype='bf16' \(not exact\) fits \d+ tokens.*max_seq_len=2\d{5}\.")),
    # ------------------------------------------------------------------ adjusted
    ("compute auto follows bf16", {}, {}, dict(bf16=True),
     ("adjusts", "compute_dtype auto", lambda p: p.precision.compute == torch.bfloat16)),
    ("no staging copy for fp32 compute", dict(host_staging=True), {}, {},
     ("adjusts", "staging fp32", lambda p: p.host.staging is False)),
    ("staging dropped when RAM is short", {}, dict(ram_available=ram(spare=-1)), dict(bf16=True),
     ("adjusts", "staging dropped", lambda p: p.host.staging is False)),
    ("moments to disk when RAM is short", dict(offload_dir="DIR", host_staging=True, offload_window=2),
     dict(ram_available=ram(moments=False, spare=2**23)), dict(bf16=True),
     ("adjusts", "state to disk", lambda p: 0 < len(p.disk.tiers.units) < LAYERS + 3 and not p.disk.tiers.masters)),
    ("offload_state without offload_dir", dict(offload_state="all"), {}, dict(bf16=True),
     ("adjusts", "offload_state without dir", lambda p: not p.disk.tiers.on_disk)),
    ("offload_dir without HostAdamW", dict(offload_dir="DIR", replace_adamw=False), {}, {},
     ("adjusts", "tier without HostAdamW", lambda p: p.optimizer.moments is None and not p.disk.tiers.on_disk)),
    ("data parallel auto on two ranks", {}, dict(world_size=2, rank=1), {},
     ("adjusts", "data_parallel auto", lambda p: p.ownership.sharded and p.ownership.rank == 1)),
    ("pin auto on CUDA", {}, dict(device=CUDA, cuda=True), {},
     ("adjusts", "pin auto", lambda p: p.host.pin and p.transport.streams and p.transport.receive_slots[0] == 3)),
    ("kernel auto on CUDA", {}, dict(device=CUDA, cuda=True), {},
     ("adjusts", "kernel auto", lambda p: p.optimizer.kernel == "native")),
    ("device_update under a GPU budget", dict(device_update=True, max_gpu_memory="8GiB"), {}, {},
     ("adjusts", "device grads under a budget", lambda p: p.optimizer.device_update
      and not p.optimizer.device_keeps_grads)),
    ("resident auto sized by the GPU budget", dict(max_gpu_memory=resident_bytes(2) + 2**30), dict(device=CUDA, cuda=True),
     dict(bf16=True, gpu_working_set=2**30),
     ("adjusts", "resident auto", lambda p: p.residency.fit == 2 and p.residency.units == frozenset()
      and p.residency.budget == resident_bytes(2))),
    ("resident count above the units", dict(resident_units=99), {}, dict(bf16=True),
     ("adjusts", "resident clamped", lambda p: p.residency.units == frozenset(range(LAYERS + 3))
      and p.residency.device_bytes == resident_bytes(LAYERS + 3))),
    ("threads follow the CPUs", {}, dict(cpus=7), {},
     ("adjusts", "threads", lambda p: p.optimizer.threads == 7)),
    ("chunked loss auto at attach", {}, {}, {},
     ("adjusts", "chunked_loss auto", lambda p: p.loss.chunked is False)),
    ("max_seq_len places the checkpoints", dict(max_seq_len=262144), H100, dict(bf16=True),
     ("adjusts", "max_seq_len placement", lambda p: (p.activations.offload_checkpoints, p.activations.checkpoint_interval,
                                                     p.host.staging) == (True, 8, False))),
    ("max_seq_len on CUDA: expandable segments", dict(max_seq_len=262144), H100, dict(bf16=True),
     ("adjusts", "allocator expandable", lambda p: p.activations.expandable_segments)),
    ("experts whose kernel ignores autocast", {}, {}, dict(bf16=True, experts="grouped_mm"),
     ("adjusts", "experts fp32", lambda p: p.precision.experts == torch.float32
      and p.precision.compute == torch.bfloat16)),
]


def _inputs(tmp_path, options, machine, run):
    options = {k: (str(tmp_path) if v == "DIR" else v) for k, v in options.items()}
    return (MegaTrainConfig(**options), Machine(**({"device": CPU, "disk_free": 2**40} | machine)), Run(**run))


@pytest.mark.parametrize("name,options,machine,run,expected", ROWS, ids=[r[0] for r in ROWS])
def test_the_plan_refuses_or_adjusts(tmp_path, name, options, machine, run, expected):
    config, machine, run = _inputs(tmp_path, options, machine, run)
    kind, what, detail = expected
    if kind == "refused":
        with pytest.raises(what, match=detail) as info:
            resolve(config, machine, run, sizes, shape)
        assert isinstance(info.value, MegatrainError)
        return
    plan = resolve(config, machine, run, sizes, shape)
    assert what in [key for key, _ in plan.adjustments], plan.adjustments
    assert detail(plan), plan


def test_every_rule_and_adjustment_has_a_row(tmp_path):
    """Each rule of RULES is the first to refuse some row, and each adjustment is some row's."""
    from megatrain_hf.plan import _Facts

    first = set()
    for _, options, machine, run, (kind, _, _) in ROWS:
        facts = _Facts(*_inputs(tmp_path, options, machine, run))
        refusing = [rule.pair for rule in RULES if rule.refuses(facts)]
        assert (kind == "refused") >= bool(refusing), (options, refusing)  # an adjusted row is refused by none
        first |= set(refusing[:1])
    assert first == {rule.pair for rule in RULES}, f"rules without a row: {set(r.pair for r in RULES) - first}"
    adjusted = {what for _, _, _, _, (kind, what, _) in ROWS if kind == "adjusts"}
    assert adjusted == set(ADJUSTMENTS), f"adjustments without a row: {set(ADJUSTMENTS) - adjusted}"


def test_rules_wait_for_what_they_need():
    """check() without the machine or the optimizer leaves their rules for later; the plan's check() adds them."""
    config = MegaTrainConfig(grad_dtype="bf16", optimizer_state="8bit")
    check(config, run=Run(bf16=True))  # one rank or several? which optimizer? not known yet: nothing refused
    plan = resolve(config, Machine(CPU), Run(bf16=True))
    with pytest.raises(IncompatibleOptionsError, match="the optimizer is SGD"):
        plan.check(optimizer=SGD)
    plan.check(optimizer=ADAMW)
    with pytest.raises(IncompatibleOptionsError, match=r"gradient_accumulation_steps=2"):
        plan.check(grad_accum=2)


def test_every_refusal_says_what_why_and_the_fix(tmp_path):
    for name, options, machine, run, (kind, what, _) in ROWS:
        if kind == "refused" and what is IncompatibleOptionsError:
            config, m, r = _inputs(tmp_path, options, machine, run)
            with pytest.raises(IncompatibleOptionsError) as info:
                resolve(config, m, r, sizes)
            assert re.search(r"Fix|use device=|Unset", str(info.value)), (name, str(info.value))


def test_residency_counts_units_in_forward_order():
    """An explicit count places the first units; "auto" places none on the CPU (the streamed run unchanged)."""
    plan = resolve(MegaTrainConfig(resident_units=3), Machine(CPU), Run(bf16=True), sizes)
    assert plan.residency.units == frozenset({0, 1, 2}) and plan.residency.device_bytes == resident_bytes(3)
    auto = resolve(MegaTrainConfig(), Machine(CPU), Run(bf16=True), sizes)
    assert auto.residency.units == frozenset() and not [k for k, _ in auto.adjustments if k.startswith("resident")]
    off = resolve(MegaTrainConfig(resident_units=0), Machine(CUDA, cuda=True), Run(bf16=True), sizes)
    assert off.residency.units == frozenset()
    # the budget less the working set holds 2 units and a byte short of 3
    budget = dict(max_gpu_memory=resident_bytes(3) - 1 + 2**20)
    tight = resolve(MegaTrainConfig(**budget), Machine(CUDA, cuda=True), Run(bf16=True, gpu_working_set=2**20), sizes)
    assert tight.residency.fit == 2
    roomy = resolve(MegaTrainConfig(**budget), Machine(CUDA, cuda=True), Run(bf16=True), sizes)
    assert roomy.residency.fit == 3  # no working set known: the whole budget


def test_resident_units_are_validated():
    for value in (-1, "all", 1.5, True, None):
        with pytest.raises(MegatrainError, match=r"resident_units=.*allowed: 'auto'"):
            MegaTrainConfig(resident_units=value)


@pytest.mark.parametrize("options, run, experts", [
    ({}, dict(bf16=True, experts="grouped_mm"), torch.float32),  # plain bf16 computes them in fp32
    ({}, dict(bf16=True, experts="batched_mm"), torch.float32),  # its gather sums gradients in the weights' dtype
    ({}, dict(bf16=True, experts="my_kernel"), torch.float32),  # a kernel not known to follow autocast
    ({}, dict(bf16=True, experts="eager"), torch.bfloat16),  # F.linear per expert: autocast's own rounding
    (dict(experts_dtype="compute"), dict(bf16=True, experts="grouped_mm"), torch.bfloat16),
    ({}, dict(bf16=False, experts="grouped_mm"), torch.float32),  # fp32 compute: nothing to decide
    ({}, dict(bf16=True), None),  # a dense model
])
def test_the_routed_experts_dtype(options, run, experts):
    plan = resolve(MegaTrainConfig(**options), Machine(CPU), Run(**run), sizes)
    assert plan.precision.experts == experts
    noted = "experts fp32" in [key for key, _ in plan.adjustments]
    assert noted == (experts == torch.float32 and run["bf16"])


def test_fp32_experts_are_admitted_with_their_bytes():
    """The admission counts the experts the plan sends in fp32 without a staging copy: RAM that holds the
    bf16-experts layout's tiers minus their staging copy fits the fp32 one and not the bf16 one."""
    compute = torch.bfloat16
    config = MegaTrainConfig(host_staging="auto")

    def need(experts):
        return sum(host_tiers(sizes(compute, experts), compute, staging=True).values()) + DEFAULT_HEADROOM_BYTES

    assert need(torch.float32) < need(torch.bfloat16)  # no staging copy of the fp32 experts
    machine = Machine(CPU, ram_available=need(torch.float32))
    kept = resolve(config, machine, Run(bf16=True, experts="grouped_mm"), sizes)
    assert kept.host.staging and kept.precision.experts == torch.float32
    dropped = resolve(MegaTrainConfig(host_staging="auto", experts_dtype="compute"), machine,
                      Run(bf16=True, experts="grouped_mm"), sizes)
    assert not dropped.host.staging  # the bf16 experts' staging copy does not fit that RAM

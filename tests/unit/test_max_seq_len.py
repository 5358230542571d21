"""``max_seq_len``: the placement the engine takes before allocating (``memory/seq_placement.py``, ``plan.py``).

The anchor shapes (7 B Llama-2, Llama-3-8B) on a hand-built machine of a 139 or 79 GiB GPU and 125 GiB of
RAM: the placement the engine's plan takes is the one ``megatrain estimate --max-seq-len`` prints (the
same decisions, the same adjustment line); only exact choices are taken; options the user set are kept;
a length no exact placement fits is refused naming the longest that fits and the options that fit more.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatrain_hf import MegaTrainConfig
from megatrain_hf.cli import main
from megatrain_hf.errors import LongContextFitError, MegatrainConfigError, UsageError
from megatrain_hf.memory import seq_placement
from megatrain_hf.memory.model_layout import shape_sizes
from megatrain_hf.memory.shapes import PRESETS
from megatrain_hf.plan import Machine, Run, resolve

G = 2**30
K = 1024


def _machine(gpu_gib: int, disk: int | None = None, ram: int = 125 * G) -> Machine:
    return Machine(torch.device("cuda", 0), cuda=True, ram_available=ram, gpu_memory=gpu_gib * G, disk_free=disk)


def _plan(model: str, gpu_gib: int, disk: int | None = None, ram: int = 125 * G, **options):
    return resolve(MegaTrainConfig(**options), _machine(gpu_gib, disk, ram), Run(bf16=True),
                   lambda compute, experts: shape_sizes(PRESETS[model], compute), lambda: PRESETS[model])


# (model, GPU GiB, length) -> (offload_checkpoints, checkpoint_interval, host_staging): the exact placement of the
# shortest estimated step (docs/long-context.md#setting-max_seq_len)
PLACEMENTS = {
    ("llama-7b", 139, 256 * K): (False, 2, True),
    ("llama-7b", 79, 256 * K): (True, 8, False),
    ("llama3-8b", 139, 256 * K): (False, 2, False),
    ("llama3-8b", 79, 128 * K): (False, 2, False),
}


@pytest.mark.parametrize("model,gpu,seq", list(PLACEMENTS), ids=[f"{m}-{g}GiB-{s // K}K" for m, g, s in PLACEMENTS])
def test_the_engine_takes_the_placement_estimate_prints(capsys, model, gpu, seq):
    plan = _plan(model, gpu, max_seq_len=seq, compute_dtype="bf16")
    act = plan.activations
    assert (act.offload_checkpoints, act.checkpoint_interval, plan.host.staging) == PLACEMENTS[model, gpu, seq]
    c = plan.config  # only exact choices were taken
    assert (c.checkpoint_dtype, c.optimizer_state, c.grad_dtype) == ("fp32", "fp32", "fp32")
    assert act.checkpoint_dtype is None and plan.precision.grads == torch.float32
    joint = plan.long_context
    assert joint.fits(gpu * G, 125 * G, None) and joint.exact
    detail = dict(plan.adjustments)["max_seq_len placement"]
    assert main(["estimate", "--model", model, "--max-seq-len", str(seq), "--gpu-gib", str(gpu),
                 "--host-gib", "125"]) == 0
    out = capsys.readouterr().out
    home = "pinned host" if act.offload_checkpoints else "on the device"
    assert re.search(rf"activation checkpoints +{home}, every {act.checkpoint_interval} unit\(s\)", out), out
    assert re.search(rf"host staging copy +{'kept' if plan.host.staging else 'none'}", out)
    assert f"adjusted: max_seq_len with machine: GPU, RAM, disk: " in out and f"({detail})" in out
    assert f"{act.checkpoint_interval} unit(s)" in out and f"JOINT PLAN at {seq} tokens" in out


def test_without_max_seq_len_the_defaults_stay():
    plan = _plan("llama-7b", 79)
    assert (plan.activations.offload_checkpoints, plan.activations.checkpoint_interval) == ("auto", 1)
    assert plan.long_context is None and "max_seq_len placement" not in dict(plan.adjustments)


def test_an_option_the_user_set_is_kept():
    plan = _plan("llama-7b", 139, max_seq_len=256 * K, compute_dtype="bf16", checkpoint_interval=4)
    assert plan.activations.checkpoint_interval == 4 and plan.activations.offload_checkpoints is False
    assert "checkpoint_interval=" not in dict(plan.adjustments)["max_seq_len placement"].split("; set ")[1]
    for fixed in ("offload_checkpoints=False", "checkpoint_interval=4"):  # the placement needs host checkpoints, every 8th
        with pytest.raises(LongContextFitError, match=rf"max_seq_len=262144\).*Fix: leaving {fixed.split('=')[0]} at "
                                                      r"'auto' \(exact\) fits max_seq_len=262144"):
            _plan("llama-7b", 79, max_seq_len=256 * K, compute_dtype="bf16", **eval(f"dict({fixed})"))


def test_an_inexact_option_the_user_set_is_planned_with():
    plan = _plan("llama-7b", 139, max_seq_len=512 * K, compute_dtype="bf16", checkpoint_dtype="bf16")
    assert plan.activations.checkpoint_dtype == torch.bfloat16 and plan.long_context.ckpt.dtype == "bf16"
    assert plan.config.optimizer_state == "fp32" and plan.config.grad_dtype == "fp32"


def test_the_7b_at_512k_on_the_80gb_machine_without_disk_with_the_joint_plans_options():
    """What ``megatrain estimate --seq-len 524288 --model llama-7b --gpu-gib 79 --host-gib 125`` prints, set
    as options: the engine's placement takes it without a disk tier (GPU 78.47 of 79 GiB: thin)."""
    plan = _plan("llama-7b", 79, max_seq_len=512 * K, compute_dtype="bf16", checkpoint_dtype="bf16",
                 optimizer_state="8bit", grad_dtype="bf16")
    act, joint = plan.activations, plan.long_context
    assert (act.offload_checkpoints, act.checkpoint_interval, plan.host.staging) == (True, 2, False)
    assert joint.fits(79 * G, 125 * G, None) and not joint.disk
    assert 78 * G < sum(joint.gpu.values()) <= 79 * G - G // 2
    assert "524288 tokens: checkpoints: 1 on the GPU (the head's) + 17 in pinned host RAM" in dict(
        plan.adjustments)["max_seq_len placement"]


def test_the_disk_tier_takes_what_the_ram_cannot_when_offload_dir_is_given(tmp_path):
    # 480K on the H200 machine: five checkpoints spill to the disk tier (the shortest step of those that fit)
    plan = _plan("llama-7b", 139, 60 * G, max_seq_len=480 * K, compute_dtype="bf16", offload_dir=str(tmp_path))
    joint = plan.long_context
    assert (joint.disk_units, joint.host_units, plan.activations.offload_checkpoints) == (5, 0, True)
    assert plan.activations.disk_dir == str(tmp_path) and plan.config.offload_state == "auto"
    # 100 GiB of RAM cannot hold the 7 B's fp32 state: its moments go to disk
    plan = _plan("llama-7b", 139, 200 * G, ram=100 * G, max_seq_len=128 * K, compute_dtype="bf16",
                 offload_dir=str(tmp_path))
    assert plan.config.offload_state == "moments" and plan.long_context.state.on_disk == "moments"
    assert plan.disk.tiers.on_disk and plan.config.optimizer_state == "fp32"
    with pytest.raises(LongContextFitError, match=r"offload_dir on a local disk with [\d.]+ GiB free \(exact\)"):
        _plan("llama-7b", 139, ram=100 * G, max_seq_len=128 * K, compute_dtype="bf16")


@pytest.mark.parametrize("gpu", [139, 79])
def test_a_length_no_exact_placement_fits_is_refused_with_the_longest_and_the_fix(gpu):
    with pytest.raises(LongContextFitError) as info:
        _plan("llama-7b", gpu, max_seq_len=512 * K, compute_dtype="bf16")
    message = str(info.value)
    longest = int(re.search(r"with exact options the longest that fits is (\d+) tokens", message).group(1))
    fixed = seq_placement.Fixed("bf16")
    shape, budget = PRESETS["llama-7b"], (gpu * G, 125 * G, None)
    assert seq_placement.holds(shape, longest, *budget, fixed) is not None  # the longest named fits ...
    assert seq_placement.holds(shape, longest + K, *budget, fixed) is None  # ... and is the longest
    assert f"Fix: checkpoint_dtype='bf16' (not exact) fits" in message and "optimizer_state='8bit'" in message
    assert message.endswith(f"max_seq_len={longest}.")
    if gpu == 139:  # the disk tier would hold it exactly
        assert re.search(r"offload_dir on a local disk with [\d.]+ GiB free \(exact\)", message)
        assert "checkpoint_dtype='bf16' (not exact) fits max_seq_len=524288" in message
    assert "does not fit a " + f"{gpu}.00 GiB GPU, 125.00 GiB of host RAM" in message


def test_estimate_exits_1_with_the_engines_refusal(capsys):
    assert main(["estimate", "--model", "llama-7b", "--max-seq-len", str(512 * K), "--gpu-gib", "79",
                 "--host-gib", "125"]) == 1
    out = capsys.readouterr().out
    assert "the engine would refuse to attach here: megatrain: MegaTrainConfig(max_seq_len=524288)" in out


@pytest.mark.parametrize("value", [0, -4, 1.5, "128K", True])
def test_max_seq_len_is_validated(value):
    with pytest.raises(MegatrainConfigError, match=r"max_seq_len=.*allowed: None or the longest training sequence"):
        MegaTrainConfig(max_seq_len=value)


def test_checkpoint_interval_auto_is_one_without_max_seq_len():
    assert MegaTrainConfig().checkpoint_interval == "auto"
    assert MegaTrainConfig().resolve_checkpoint_interval() == 1
    with pytest.raises(MegatrainConfigError, match="checkpoint_interval"):
        MegaTrainConfig(checkpoint_interval=0)


def test_the_plan_needs_the_shape():
    with pytest.raises(UsageError, match="max_seq_len needs the model's shape"):
        resolve(MegaTrainConfig(max_seq_len=4096), _machine(79), Run(bf16=True),
                lambda compute, experts: shape_sizes(PRESETS["llama-7b"], compute))


def test_max_seq_len_on_cuda_puts_the_allocator_on_expandable_segments():
    """At 512K tokens fixed segments reserved up to 24 GiB above the allocated peak (docs/benchmarks.md): under
    ``max_seq_len`` on CUDA the plan switches the allocator to expandable segments, and says so; not on the CPU,
    not without ``max_seq_len``."""
    plan = _plan("llama-7b", 139, max_seq_len=128 * K, compute_dtype="bf16")
    assert plan.activations.expandable_segments
    assert "allocator expandable" in dict(plan.adjustments)
    assert not _plan("llama-7b", 139, compute_dtype="bf16").activations.expandable_segments
    cpu = Machine(torch.device("cpu"), ram_available=125 * G)
    on_cpu = resolve(MegaTrainConfig(max_seq_len=1024), cpu, Run(), lambda compute, experts: shape_sizes(
        PRESETS["llama-7b"], compute), lambda: PRESETS["llama-7b"])
    assert on_cpu.long_context is not None and not on_cpu.activations.expandable_segments

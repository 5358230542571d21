"""The joint long-context plan (``memory/long_context.py``) and ``megatrain estimate --gpu-gib``.

Both anchor shapes (7 B Llama-2, MHA, vocab 32K; Llama-3-8B, GQA, vocab 128K) fit 512K tokens on the
H200 machine (139 GiB GPU, 125 GiB RAM, 60 GiB of disk) and on an 80 GB H100 with the same RAM and no disk;
the placement printed is the plan's, its options are ones the training plan accepts, and a length that
nothing fits raises a typed error naming the longest that fits and what to change.
"""

from __future__ import annotations

import pytest
import torch

from megatrain_hf import MegaTrainConfig
from megatrain_hf.cli import main
from megatrain_hf.errors import LongContextFitError, MegatrainError
from megatrain_hf.memory import activations
from megatrain_hf.memory.long_context import best_plan, candidates, longest, plan_long_context
from megatrain_hf.memory.shapes import PRESETS
from megatrain_hf.plan import Machine, Run, check

G = 2**30
S = 524288
MACHINES = {"h200": (139 * G, 125 * G, 60 * G), "h100": (79 * G, 125 * G, None)}


def test_llama3_8b_preset_is_the_llama3_shape():
    s = PRESETS["llama3-8b"]
    assert (s.layers, s.hidden, s.intermediate, s.heads, s.kv_heads, s.vocab) == (32, 4096, 14336, 32, 8, 128256)


def test_the_working_set_model_of_a_tiled_layer():
    """One function: 28 h bytes per token for MHA (fp32 input and incoming gradient, which takes the outgoing
    gradient (the recomputed output's storage is freed); q/k/v/o and their gradients in bf16,
    FlashAttention's fp32 dq accumulator), the fp32 log-sum-exp of every head, plus one tile."""
    ws = activations.long_context_working_set
    tile = 4096 * (6 * 2 * 11008 + 24 * 4096)
    assert ws(S, 4096, 4096, 4096, 11008, 2, 4096, heads=32) == S * (28 * 4096 + 4 * 32) + tile
    assert ws(S, 4096, 4096, 1024, 14336, 2, 4096, heads=32) == (S * (22 * 4096 + 4 * 32)
                                                                 + 4096 * (6 * 2 * 14336 + 24 * 4096))
    assert ws(1024, 4096, 4096, 4096, 11008, 2, 4096) == 1024 * (28 * 4096 + 6 * 2 * 11008 + 24 * 4096 + 4 * 64)


@pytest.mark.parametrize("model", ["llama-7b", "llama3-8b"])
@pytest.mark.parametrize("machine", MACHINES)
def test_512k_fits_both_anchor_machines(tmp_path, model, machine):
    gpu, host, disk = MACHINES[machine]
    plan = plan_long_context(PRESETS[model], S, gpu, host, disk)
    assert plan.fits(gpu, host, disk)
    assert sum(plan.gpu.values()) <= gpu and sum(plan.host.values()) <= host
    assert disk is not None or not plan.disk  # no disk tier planned where there is none
    options = {k: (str(tmp_path) if v == "DIR" else v) for k, v in plan.options().items()}
    check(MegaTrainConfig(**options), Machine(torch.device("cuda"), cuda=True), Run(bf16=True, grad_accum=1))


def test_the_plan_prefers_exact_and_puts_the_state_on_disk_to_free_ram_for_checkpoints():
    """7 B at 512K on the H200 machine: fp32 checkpoints and fp32 moments fit once the moments go to disk,
    which costs a few percent of a step that takes minutes; the plan says so."""
    gpu, host, disk = MACHINES["h200"]
    plan = plan_long_context(PRESETS["llama-7b"], S, gpu, host, disk)
    assert plan.exact and plan.state.on_disk != "none" and plan.ckpt.home == "host"
    compute = next(v for k, v in plan.seconds.items() if k.startswith("compute"))
    assert compute > 300 and plan.seconds["disk: optimizer state"] < 0.1 * compute
    assert "the disk tier adds" in plan.verdict() and "% of the" in plan.verdict()
    # without the disk no exact placement fits: the plan says what it gave up
    lossy = plan_long_context(PRESETS["llama-7b"], S, gpu, host, None)
    assert not lossy.exact and "NOT exact" in lossy.lines()[0]


def test_a_fitting_exact_candidate_beats_every_lossy_one():
    gpu, host, disk = 139 * G, 500 * G, None  # RAM for everything
    plan = best_plan(PRESETS["llama-7b"], 131072, gpu, host, disk)
    assert plan.exact
    fitting = [p for p in candidates(PRESETS["llama-7b"], 131072, gpu, host, disk) if p.fits(gpu, host, disk)]
    assert plan.step_seconds == min(p.step_seconds for p in fitting if p.exact)


def test_a_length_beyond_what_fits_is_refused_with_the_longest_and_the_fix():
    gpu, host, disk = MACHINES["h100"]
    seq, plan = longest(PRESETS["llama3-8b"], gpu, host, disk)
    assert S <= seq < 2 * S and plan is not None
    assert best_plan(PRESETS["llama3-8b"], seq + 1024, gpu, host, disk) is None
    with pytest.raises(LongContextFitError) as info:
        plan_long_context(PRESETS["llama3-8b"], 2 * S, gpu, host, disk)
    message = str(info.value)
    assert isinstance(info.value, MegatrainError) and isinstance(info.value, MemoryError)
    assert f"at {2 * S} tokens per sequence does not fit a 79.00 GiB GPU" in message
    assert f"the longest that fits is {seq} tokens (checkpoints:" in message
    assert "Fix: a GPU with" in message and f"--seq-len {seq}" in message


def test_disk_is_named_as_the_fix_when_only_the_disk_tier_would_fit():
    """7 B at 1M tokens on the H200 machine without a disk: the RAM cannot hold the checkpoints the GPU
    cannot; the fix names the disk tier's size."""
    with pytest.raises(LongContextFitError, match=r"Fix: .*the disk tier with [0-9.]+ GiB free \(offload_dir"):
        plan_long_context(PRESETS["llama-7b"], 2 * S, 139 * G, 125 * G, None)


@pytest.mark.parametrize("model", ["llama-7b", "llama3-8b"])
def test_estimate_prints_the_placement_peaks_and_tier_times(capsys, model):
    assert main(["estimate", "--model", model, "--seq-len", str(S), "--gpu-gib", "139", "--host-gib", "125",
                 "--disk-gib", "60"]) == 0
    out = capsys.readouterr().out
    assert f"JOINT PLAN at {S} tokens" in out
    assert f"at seq {S} on a 139.00 GiB GPU and 125.00 GiB host RAM and 60.00 GiB of disk: fits (checkpoints:" in out
    for line in ("  GPU (GiB)", "  host RAM (GiB)", "  time per step, estimated (s)", "    compute (attention 9"):
        assert line in out
    assert main(["estimate", "--model", model, "--seq-len", str(S), "--gpu-gib", "79", "--host-gib", "125"]) == 0
    out = capsys.readouterr().out
    assert f"at seq {S} on a 79.00 GiB GPU and 125.00 GiB host RAM: fits (checkpoints:" in out
    assert "    one layer's backward (every per-token op tiled)" in out  # the placement is printed


def test_estimate_refuses_a_length_that_does_not_fit(capsys):
    assert main(["estimate", "--model", "llama-7b", "--seq-len", str(4 * S), "--gpu-gib", "79",
                 "--host-gib", "125"]) == 1
    out = capsys.readouterr().out
    assert f"at seq {4 * S} on a 79.00 GiB GPU and 125.00 GiB host RAM: does NOT fit" in out
    assert "the longest that fits is" in out and "Fix:" in out

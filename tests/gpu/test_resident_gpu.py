"""On a CUDA GPU: resident units (``resident_units=N``) against the streamed run (``"auto"``: 0 on CUDA).

Marked `gpu` (skipped without CUDA). Through Trainer, a tiny Llama (``GPU_SHAPE``), accumulation 2 and
``max_grad_norm`` small enough that every step clips: the first units' masters, gradients and moments stay
on the GPU (gradients added there on the compute stream, the update on a side stream the next fetch waits
on), the others stream. fp32: every loss and every final parameter within ``FP32_RESIDENT_ATOL`` of the
streamed run's (the same fused AdamW formula, CUDA's kernel instead of the host's); bf16: within the
tolerances of ``test_cuda_parity.py``. A resume from a mid-run checkpoint ends where the uninterrupted
resident run ends.

The plan still refuses an explicit count on CUDA (``plan.py``, rule ``resident_units`` x ``machine:
CUDA``) until this file passed on a GPU: the resident runs are marked ``xfail(strict=True)`` on that
refusal only. A GPU run that lifts the rule and sees them pass (XPASS, a failure under strict) removes the
marker; any other failure (a tolerance, a device mismatch) fails as usual. The measured differences go to
$MEGATRAIN_GPU_REPORT like the parity tests'.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import GPU_SHAPE, RandomTokens, assert_close_losses, state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, engine_of
from megatrain_hf.errors import IncompatibleOptionsError

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.gpu.test_cuda_parity import (BF16_LOSS_ATOL, BF16_UPDATE_RTOL, _no_tf32, _report,  # noqa: E402, F401
                                        assert_close_updates)  # (_no_tf32: its autouse fixture, here too)

FP32_RESIDENT_ATOL = 1e-6
"""fp32: losses and parameters of the resident run within this of the streamed run's."""
RESIDENT = 3  # of the tiny Llama's 7 units (embedding, 4 layers, final norm, head): the head streams

REFUSED_ON_CUDA = pytest.mark.xfail(
    raises=IncompatibleOptionsError, strict=True,
    reason="plan.py refuses resident_units on CUDA until this file passed on a GPU; lift the rule, drop the marker")



def _data():
    return RandomTokens(n=64, seq=128, vocab=GPU_SHAPE["vocab_size"])


def _run(path, resident, bf16, resume=None, seed=0, **args):
    model = tiny_model("llama", seed=seed, **{**GPU_SHAPE, "attention_dropout": 0.0})
    init = state_of(model)
    config = MegaTrainConfig(resident_units=resident)
    _, losses = train(model, training_args(path, use_cpu=False, bf16=bf16, max_grad_norm=0.05, **args),
                      dataset=_data(), callbacks=[MegaTrainPlugin(config)], resume=resume)
    return model, init, losses


def _check_placement(model, resident):
    engine = engine_of(model)
    assert engine.device.type == "cuda"
    assert engine.plan.residency.units == frozenset(range(resident))  # "auto": 0 placed on CUDA until measured
    assert all(p.device.type == "cpu" for p in model.parameters())  # the host parameters stay the model's
    if resident:
        state = engine.resident
        assert all(t.device.type == "cuda" for t in state.master.values())
        for u in state.units:
            assert all(e.tensor.grad is None for e in engine.store.owned_trainable(u))


def _assert_close(name, ref, ref_losses, got, got_losses, init, bf16):
    ref_state, state = state_of(ref), state_of(got)
    record = _report(name, ref_losses, got_losses, ref_state, state)
    if bf16:
        assert_close_losses(ref_losses, got_losses, BF16_LOSS_ATOL)
        assert_close_updates(init, ref_state, state, BF16_UPDATE_RTOL)
    else:
        assert_close_losses(ref_losses, got_losses, FP32_RESIDENT_ATOL)
        assert record["max_param_diff"] <= FP32_RESIDENT_ATOL, record["max_param_diff"]


@REFUSED_ON_CUDA
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_resident_units_train_like_the_streamed_run_on_cuda(tmp_path, bf16):
    ref, init, ref_losses = _run(tmp_path / "streamed", "auto", bf16, gradient_accumulation_steps=2)
    _check_placement(ref, 0)
    got, _, losses = _run(tmp_path / "resident", RESIDENT, bf16, gradient_accumulation_steps=2)
    _check_placement(got, RESIDENT)
    _assert_close(f"resident_{'bf16' if bf16 else 'fp32'}", ref, ref_losses, got, losses, init, bf16)


@REFUSED_ON_CUDA
def test_resident_resume_on_cuda_ends_where_the_run_ends(tmp_path):
    args = dict(gradient_accumulation_steps=2, save_strategy="steps", save_steps=3)
    full, init, full_losses = _run(tmp_path / "run", RESIDENT, True, **args)
    resumed, _, resumed_losses = _run(tmp_path / "run", RESIDENT, True, resume=str(tmp_path / "run" / "checkpoint-3"),
                                      seed=123, **args)
    assert len(resumed_losses) == len(full_losses) - 6
    _assert_close("resident_resume_bf16", full, full_losses[6:], resumed, resumed_losses, init, True)

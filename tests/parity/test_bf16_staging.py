"""The bf16 streaming path on the CPU: matrices travel through the bf16 staging copy.

Plain Trainer with bf16=True (autocast) rounds fp32 weights to bf16 inside every matmul; megatrain
rounds them once into the staging copy after each update. Same rounding, so the runs agree to
bf16 tolerance -- and only if the staging copy is refreshed after every optimizer step, by
HostAdamW or by a stock optimizer (engine's step hook), which is what this test guards.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close_losses, assert_close_params, state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, engine_of

# Measured on CPU: 0.0 difference (identical rounding); a stale staging copy gives 1.8e-2 / 5.5e-3.
LOSS_ATOL_BF16 = 1e-4
PARAM_ATOL_BF16 = 1e-5


@pytest.mark.parametrize("optim, staging", [("adamw_torch_fused", True), ("sgd", True), ("adamw_torch_fused", False)])
def test_bf16_staging_matches_autocast(tmp_path, optim, staging):
    """host_staging=False: no bf16 host copy; the fp32 masters are rounded after the "upload"."""
    lr = 2e-3 if optim.startswith("adamw") else 0.05
    ref = tiny_model("llama")
    _, ref_losses = train(ref, training_args(tmp_path / "ref", bf16=True, optim=optim, learning_rate=lr))
    model = tiny_model("llama")
    _, losses = train(
        model,
        training_args(tmp_path / "mt", bf16=True, optim=optim, learning_rate=lr),
        callbacks=[MegaTrainPlugin(MegaTrainConfig(compute_dtype="auto", host_staging=staging))],
    )
    engine = engine_of(model)
    assert engine.compute_dtype == torch.bfloat16
    assert (engine.store.buffers[1].staging_host is not None) == staging
    assert_close_losses(ref_losses, losses, LOSS_ATOL_BF16)
    assert_close_params(state_of(ref), state_of(model), PARAM_ATOL_BF16)


def test_stale_staging_would_be_caught(tmp_path):
    """Guard the guard: with staging refresh disabled the comparison above fails."""
    model = tiny_model("llama")
    ref = tiny_model("llama")
    _, ref_losses = train(ref, training_args(tmp_path / "ref", bf16=True))
    plugin = MegaTrainPlugin(MegaTrainConfig(compute_dtype="auto"))
    from megatrain_hf.core.staging import StagingCache

    original = StagingCache.stage
    first = {}

    def stage_once(self, u, master=None):  # stage each unit once, never refresh
        if u not in first:
            first[u] = True
            original(self, u, master)

    StagingCache.stage = stage_once
    try:
        _, losses = train(model, training_args(tmp_path / "mt", bf16=True), callbacks=[plugin])
    finally:
        StagingCache.stage = original
    with pytest.raises(AssertionError):
        assert_close_losses(ref_losses, losses, LOSS_ATOL_BF16)


def test_lora_bf16_matches_autocast(tmp_path):
    """LoRA matrices travel in fp32 (PEFT casts the adapter input to their dtype); the frozen base
    weights are kept in bf16 on the host, i.e. exactly what autocast computes with."""
    peft = pytest.importorskip("peft")

    def build():
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(tiny_model("llama"), config)

    ref = build()
    _, ref_losses = train(ref, training_args(tmp_path / "ref", bf16=True))
    model = build()
    _, losses = train(model, training_args(tmp_path / "mt", bf16=True), callbacks=[MegaTrainPlugin()])
    assert_close_losses(ref_losses, losses, LOSS_ATOL_BF16)
    ref_state, state = state_of(ref), state_of(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert_close_params({n: ref_state[n] for n in trainable}, {n: state[n] for n in trainable}, PARAM_ATOL_BF16)
    for n, p in model.named_parameters():
        if not p.requires_grad and p.dtype == torch.bfloat16:  # frozen matrices: stored in bf16
            torch.testing.assert_close(state[n], ref_state[n].to(torch.bfloat16).float(), atol=0, rtol=0)


def test_norm_weights_of_any_shape_stay_fp32(tmp_path):
    """Cohere's per-head q/k LayerNorm weights are heads x head_dim matrices by shape, but autocast
    leaves a norm in fp32: they cross the link in fp32, and bf16 training matches plain Trainer's
    (measured on CPU: 0.0; in bf16 on the wire 6.6e-5 in the loss)."""
    ref = tiny_model("cohere")
    _, ref_losses = train(ref, training_args(tmp_path / "ref", bf16=True))
    model = tiny_model("cohere")
    _, losses = train(model, training_args(tmp_path / "mt", bf16=True),
                      callbacks=[MegaTrainPlugin(MegaTrainConfig(compute_dtype="auto"))])
    engine = engine_of(model)
    assert engine.compute_dtype == torch.bfloat16
    q_norm = next(e for e in engine.store.entries[1] if e.name == "self_attn.q_norm.weight")
    assert q_norm.tensor.ndim == 2 and q_norm.wire == torch.float32
    assert_close_losses(ref_losses, losses, 1e-5)
    assert_close_params(state_of(ref), state_of(model), PARAM_ATOL_BF16)

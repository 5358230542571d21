"""On a CUDA GPU: megatrain through Trainer against plain full-GPU Trainer.

Marked `gpu` (skipped without CUDA). Tolerances are explicit per dtype; the measured differences
are appended to $MEGATRAIN_GPU_REPORT (JSON lines) when set, so docs/benchmarks.md can quote them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import RandomTokens, assert_close_losses, assert_close_params, state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainPlugin, engine_of

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# bf16: both runs round matmul weights to bf16 the same way (autocast vs staging); kernels may
# still pick different algorithms for different memory layouts, hence a tolerance.
BF16_LOSS_ATOL = 2e-2
BF16_PARAM_ATOL = 2e-3
FP32_LOSS_ATOL = 1e-5
FP32_PARAM_ATOL = 1e-5

SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256)


def _report(name, ref_losses, losses, ref_state, state):
    path = os.environ.get("MEGATRAIN_GPU_REPORT")
    record = {
        "test": name,
        "max_loss_diff": max(abs(a - b) for a, b in zip(ref_losses, losses)),
        "max_param_diff": max((ref_state[n] - state[n]).abs().max().item() for n in ref_state),
        "ref_losses": ref_losses,
        "losses": losses,
    }
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def _args(path, **kw):
    return training_args(path, use_cpu=False, **kw)


def _data():
    return RandomTokens(n=64, seq=128, vocab=SHAPE["vocab_size"])


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_bf16_parity(tmp_path, family):
    ref = tiny_model(family, **SHAPE)
    _, ref_losses = train(ref, _args(tmp_path / "ref", bf16=True), dataset=_data())
    model = tiny_model(family, **SHAPE)
    _, losses = train(model, _args(tmp_path / "mt", bf16=True), dataset=_data(), callbacks=[MegaTrainPlugin()])
    engine = engine_of(model)
    assert engine.device.type == "cuda" and engine.compute_dtype == torch.bfloat16 and engine.store.pin
    assert all(p.device.type == "cpu" for p in model.parameters())  # masters never left the host
    ref_state = {n: p.cpu() for n, p in state_of(ref).items()}
    rec = _report(f"bf16_parity_{family}", ref_losses, losses, ref_state, state_of(model))
    assert_close_losses(ref_losses, losses, BF16_LOSS_ATOL)
    assert_close_params(ref_state, state_of(model), BF16_PARAM_ATOL)
    assert rec["max_loss_diff"] <= BF16_LOSS_ATOL


def test_fp32_parity_and_generate(tmp_path):
    ref = tiny_model("llama", **SHAPE)
    _, ref_losses = train(ref, _args(tmp_path / "ref"), dataset=_data())
    model = tiny_model("llama", **SHAPE)
    _, losses = train(model, _args(tmp_path / "mt"), dataset=_data(), callbacks=[MegaTrainPlugin()])
    ref_state = {n: p.cpu() for n, p in state_of(ref).items()}
    _report("fp32_parity_llama", ref_losses, losses, ref_state, state_of(model))
    assert_close_losses(ref_losses, losses, FP32_LOSS_ATOL)
    assert_close_params(ref_state, state_of(model), FP32_PARAM_ATOL)
    prompt = torch.tensor([[1, 5, 9, 3]], device="cuda")
    ref.eval()
    model.eval()
    assert model.device.type == "cuda"
    expected = ref.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(expected, got)


def test_lora_bf16(tmp_path):
    peft = pytest.importorskip("peft")

    def build():
        cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(tiny_model("llama", **SHAPE), cfg)

    ref = build()
    _, ref_losses = train(ref, _args(tmp_path / "ref", bf16=True), dataset=_data())
    model = build()
    _, losses = train(model, _args(tmp_path / "mt", bf16=True), dataset=_data(), callbacks=[MegaTrainPlugin()])
    ref_state = {n: p.cpu() for n, p in state_of(ref).items()}
    _report("lora_bf16_llama", ref_losses, losses, ref_state, state_of(model))
    assert_close_losses(ref_losses, losses, BF16_LOSS_ATOL)
    assert_close_params(ref_state, state_of(model), BF16_PARAM_ATOL)

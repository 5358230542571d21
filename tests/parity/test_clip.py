"""``Engine.clip_grad_norm_``: exact global-norm clipping for every entry point, not only Trainer.

A hand-written loop and ``MegaTrainAccelerator`` clip through the engine (the norm from the per-unit
norms the gradient sink recorded; with HostAdamW the multiply inside its next update, otherwise at
once) and train exactly like plain PyTorch / Accelerate with ``clip_grad_norm_`` (CPU, fp32).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from megatrain_hf import HostAdamW, MegaTrainConfig, attach, engine_of
from tests.helpers import RandomTokens, assert_close_losses, assert_close_params, state_of, tiny_model

ATOL = 1e-6
MAX_NORM = 0.05  # small enough that every step clips


def _batches(n: int = 8):
    return [b for b in DataLoader(RandomTokens(n=2 * n), batch_size=2, shuffle=False)]


def _plain_loop(model, accumulation: int = 2):
    torch.manual_seed(0)  # (dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, fused=True)
    losses, norms = [], []
    for i, batch in enumerate(_batches()):
        loss = model(**batch).loss / accumulation
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
    return losses, norms


def _megatrain_loop(model, host_adamw: bool, defer: bool, accumulation: int = 2):
    torch.manual_seed(0)  # (dropout)
    engine = attach(model, MegaTrainConfig(device="cpu"))
    if host_adamw:
        optimizer = HostAdamW(model.parameters(), engine.store, lr=2e-3, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, fused=True)
    losses, norms = [], []
    for i, batch in enumerate(_batches()):
        loss = model(**batch).loss / accumulation
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0:
            norms.append(float(engine.clip_grad_norm_(MAX_NORM, optimizer=optimizer, defer=defer)))
            optimizer.step()
            optimizer.zero_grad()
    engine.synchronize()
    return losses, norms


@pytest.mark.parametrize("host_adamw, defer", [(True, True), (True, False), (False, True)],
                         ids=["hostadamw-in-update", "hostadamw-at-once", "torch-adamw"])
def test_a_hand_written_loop_clips_exactly(host_adamw, defer):
    ref, model = tiny_model("llama"), tiny_model("llama")
    ref_losses, ref_norms = _plain_loop(ref)
    losses, norms = _megatrain_loop(model, host_adamw, defer)
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_losses(ref_norms, norms, ATOL)
    assert all(n > MAX_NORM for n in ref_norms)  # every step clipped
    assert_close_params(state_of(ref), state_of(model), ATOL)


def test_a_nonfinite_norm_skips_the_host_adamw_step():
    model = tiny_model("llama")
    engine = attach(model, MegaTrainConfig(device="cpu"))
    optimizer = HostAdamW(model.parameters(), engine.store, lr=2e-3)
    before = state_of(model)
    batch = _batches(1)[0]
    model(**batch).loss.backward()
    next(model.parameters()).grad[0] = float("nan")
    assert not torch.isfinite(engine.clip_grad_norm_(1.0, optimizer=optimizer))
    optimizer.step()
    engine.synchronize()
    assert optimizer.skipped_steps == 1
    after = state_of(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def _accelerate_loop(model, accelerator_cls, host_adamw: bool = False, **kwargs):
    torch.manual_seed(0)
    accelerator = accelerator_cls(cpu=True, gradient_accumulation_steps=2, **kwargs)
    if host_adamw:  # attached before prepare, to build HostAdamW on its store
        engine = attach(model, MegaTrainConfig(device="cpu"))
        optimizer = HostAdamW(model.parameters(), engine.store, lr=2e-3, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, fused=True)
    loader = DataLoader(RandomTokens(n=16), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses, norms = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            losses.append(loss.item())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
    if engine_of(model) is not None:
        engine_of(model).synchronize()
    return losses, norms


@pytest.mark.parametrize("host_adamw", [False, True], ids=["torch-adamw", "hostadamw"])
def test_megatrain_accelerator_clips_through_the_engine(host_adamw, monkeypatch):
    from accelerate import Accelerator

    from megatrain_hf import MegaTrainAccelerator
    from megatrain_hf.engine import Engine

    calls = []
    clip = Engine.clip_grad_norm_
    monkeypatch.setattr(Engine, "clip_grad_norm_", lambda self, *a, **k: calls.append(k) or clip(self, *a, **k))
    ref, model = tiny_model("qwen2"), tiny_model("qwen2")
    ref_losses, ref_norms = _accelerate_loop(ref, Accelerator)
    losses, norms = _accelerate_loop(model, MegaTrainAccelerator, host_adamw,
                                     megatrain_config=MegaTrainConfig(device="cpu"))
    assert len(calls) == len(norms) and all((k["optimizer"] is not None) == host_adamw for k in calls)
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_losses(ref_norms, norms, ATOL)
    assert_close_params(state_of(ref), state_of(model), ATOL)

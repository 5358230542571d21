"""Everything a user attaches to the head or the loss runs under megatrain as under plain Trainer
(issue 33, items 2 and 3): ``model.loss_function``, ``model.loss_type``, forward / pre-forward /
full-backward hooks on ``lm_head`` (also added mid-training), torch's global module hooks,
Trainer's ``compute_loss_func`` and a subclass's ``compute_loss``. The chunked loss gives way to
HF's full-logit forward through the streamed head whenever one of them is present, checked at
every forward, with an INFO line. CPU, fp32, exact against plain Trainer."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback

from tests.helpers import (
    RandomTokens,
    assert_close_losses,
    assert_close_params,
    state_of,
    tiny_model,
    train,
    training_args,
)
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, attach, engine_of

LOGGER = "megatrain_hf.models.chunked_loss"


def _model():
    return tiny_model("llama", attention_dropout=0.0)


def z_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
    """Cross-entropy plus a z-loss term (what PaLM adds): differs from plain CE by far more than 1e-6."""
    logits = logits.float()
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat, targets = logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device)
    ce = F.cross_entropy(flat, targets, ignore_index=ignore_index, reduction="sum")
    z = (torch.logsumexp(flat, dim=-1) ** 2)[targets != ignore_index].sum()
    total = ce + 0.5 * z
    return total / (num_items_in_batch if num_items_in_batch is not None else (targets != ignore_index).sum())


def _pair(tmp_path, prepare, **trainer_kwargs):
    """(reference losses, params, model), (megatrain's) with ``prepare(model)`` applied to both."""
    results = []
    for name, callbacks in (("ref", []), ("mt", [MegaTrainPlugin()])):
        model = _model()
        prepare(model)
        trainer, losses = train(model, training_args(tmp_path / name), callbacks=callbacks, **trainer_kwargs)
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]  # also when the model returns none
        results.append((losses + logged, state_of(model), model))
    return results


def _assert_exact(ref, got):
    assert_close_losses(ref[0], got[0], 1e-6)
    assert_close_params(ref[1], got[1], 1e-6)


def test_custom_loss_function_is_honoured(tmp_path, caplog):
    def prepare(model):
        model.loss_function = z_loss

    with caplog.at_level(logging.INFO, logger=LOGGER):
        ref, got = _pair(tmp_path, prepare)
    assert engine_of(got[2]).chunked_loss_active  # plain Trainer: chunked by default, and it gave way
    assert "loss_function is z_loss" in caplog.text and "full logits" in caplog.text
    _assert_exact(ref, got)
    plain_ce = _pair(tmp_path / "ce", lambda m: None)[0]
    assert abs(plain_ce[0][0] - ref[0][0]) > 1e-3  # the custom loss changes the result: the test can fail


def test_loss_type_is_honoured(tmp_path, caplog):
    def prepare(model):
        model.loss_type = "ForMaskedLM"  # no shift: another loss than the causal one

    with caplog.at_level(logging.INFO, logger=LOGGER):
        ref, got = _pair(tmp_path, prepare)
    assert "ForMaskedLMLoss" in caplog.text
    _assert_exact(ref, got)


class _Counter:
    def __init__(self):
        self.calls = {"pre": 0, "fwd": 0, "bwd": 0}

    def install(self, head):
        head.register_forward_pre_hook(self.pre)
        head.register_forward_hook(self.fwd)
        head.register_full_backward_hook(self.bwd)

    def pre(self, module, args):
        self.calls["pre"] += 1

    def fwd(self, module, args, output):
        self.calls["fwd"] += 1
        return output / 1.7  # a logit temperature: changes training

    def bwd(self, module, grad_input, grad_output):
        self.calls["bwd"] += 1


def test_lm_head_hooks_fire_as_in_plain_trainer(tmp_path):
    counters = []

    def prepare(model):
        counters.append(_Counter())
        counters[-1].install(model.lm_head)

    ref, got = _pair(tmp_path, prepare)
    assert counters[0].calls == counters[1].calls == {"pre": 12, "fwd": 12, "bwd": 12}
    _assert_exact(ref, got)


class _HookLater(TrainerCallback):
    """Registers a temperature hook on lm_head after step 2: checked at every forward, not at attach."""

    def __init__(self, model):
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.model.lm_head.register_forward_hook(lambda m, a, out: out * 0.5)


def test_hook_added_during_training_is_honoured(tmp_path):
    results = []
    for name, plugins in (("ref", []), ("mt", [MegaTrainPlugin()])):
        model = _model()
        _, losses = train(model, training_args(tmp_path / name), callbacks=[_HookLater(model), *plugins])
        results.append((losses, state_of(model)))
    _assert_exact(*results)


def test_global_module_hook_is_honoured(tmp_path):
    seen, heads = [], []

    def prepare(model):
        heads.append(model.lm_head)

    def hook(module, args, output):
        if any(module is head for head in heads):
            seen.append(1)
            return output * 0.5
        return None

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        ref, got = _pair(tmp_path, prepare)
    finally:
        handle.remove()
    assert len(seen) == 24  # the head of 12 micro-batches, twice
    _assert_exact(ref, got)


def test_compute_loss_func_is_honoured(tmp_path):
    def loss_func(outputs, labels, num_items_in_batch=None):
        return z_loss(outputs.logits, labels, 128, num_items_in_batch=num_items_in_batch)

    ref, got = _pair(tmp_path, lambda m: None, compute_loss_func=loss_func)
    _assert_exact(ref, got)


class _OwnLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        loss = outputs.loss + 0.01 * outputs.logits.float().pow(2).mean()
        return (loss, outputs) if return_outputs else loss


def test_subclass_compute_loss_is_honoured(tmp_path):
    results = []
    for name, callbacks in (("ref", []), ("mt", [MegaTrainPlugin()])):
        model = _model()
        trainer = _OwnLoss(model=model, args=training_args(tmp_path / name), train_dataset=RandomTokens(),
                           callbacks=callbacks)
        trainer.train()
        results.append(([h["loss"] for h in trainer.state.log_history if "loss" in h], state_of(model)))
    _assert_exact(*results)


def test_chunked_loss_true_with_compute_loss_override_warns(tmp_path, caplog):
    model = _model()
    with caplog.at_level(logging.WARNING, logger="megatrain_hf"):
        _OwnLoss(model=model, args=training_args(tmp_path), train_dataset=RandomTokens(),
                 callbacks=[MegaTrainPlugin(chunked_loss=True)])
    assert "_OwnLoss.compute_loss" in caplog.text and "logits=None" in caplog.text


def test_without_customisation_the_chunked_kernel_runs():
    """The check does not turn the chunked loss off by itself: a plain model still gets logits=None."""
    data = RandomTokens(n=2)
    batch = {k: torch.stack([data[i][k] for i in range(2)]) for k in data[0]}
    model = _model()
    attach(model, MegaTrainConfig(chunked_loss=True), device="cpu")
    assert model(**batch).logits is None
    handle = model.lm_head.register_forward_hook(lambda m, a, out: None)
    assert model(**batch).logits is not None  # a hook: HF's forward, the head's hooks run
    handle.remove()
    assert model(**batch).logits is None

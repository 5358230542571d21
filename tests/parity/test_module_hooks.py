"""Module hooks on decoder sub-modules under megatrain (issue 33, item 6), against plain Trainer.

A hook may draw random numbers: the automatic layer-major choice sees every module hook (forward,
pre-forward, backward, torch's global ones) as a possible source of randomness and keeps plain
accumulation's order; the backward's recompute re-runs a hook that drew random numbers (not only
one that changed a value), so the ops after it draw what they drew in the forward. CPU, fp32."""

from __future__ import annotations

import logging

import torch

from tests.helpers import (
    assert_close_losses,
    assert_close_params,
    state_of,
    tiny_model,
    train,
    training_args,
    without_dropout,
)
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, attach
from megatrain_hf.core.hooks import hooked_modules


def _noise(module, args, output):
    return output + 0.05 * torch.randn_like(output)  # random, modifying


def _run(tmp_path, name, model, plugins, **args):
    trainer, losses = train(model, training_args(tmp_path / name, **args), callbacks=plugins)
    return losses, state_of(model)


def test_random_hook_keeps_plain_order_under_layer_major_auto(tmp_path, caplog):
    results = []
    with caplog.at_level(logging.INFO, logger="megatrain_hf"):
        for name, plugins in (("ref", []), ("mt", [MegaTrainPlugin()])):
            model = tiny_model("llama", **without_dropout("llama"))
            model.model.layers[0].mlp.register_forward_hook(_noise)
            results.append(_run(tmp_path, name, model, plugins))
    assert "modules have hooks (model.layers.0.mlp._forward_hooks)" in caplog.text
    assert "not layer-major" in caplog.text
    assert_close_losses(results[0][0], results[1][0], 1e-6)
    assert_close_params(results[0][1], results[1][1], 1e-6)


def test_random_pre_hook_without_output_change_replays_in_recompute(tmp_path):
    """A pre-hook that draws random numbers and changes nothing, before the attention's dropout: the
    recompute runs it again, so the dropout mask of the backward is the forward's."""
    draws = []

    def draw(module, args):
        draws.append(torch.rand(3))  # e.g. a random sampling decision for logging

    results = []
    for name, plugins in (("ref", []), ("mt", [MegaTrainPlugin()])):
        model = tiny_model("llama", attention_dropout=0.3)
        model.model.layers[1].self_attn.register_forward_pre_hook(draw)
        results.append(_run(tmp_path, name, model, plugins, gradient_accumulation_steps=1))
    assert_close_losses(results[0][0], results[1][0], 1e-6)
    assert_close_params(results[0][1], results[1][1], 1e-6)


def test_hooked_modules_sees_user_hooks_only():
    model = tiny_model("llama")
    engine = attach(model, MegaTrainConfig(), device="cpu")
    batch = torch.randint(0, 128, (2, 8))
    model(input_ids=batch, output_hidden_states=True, output_attentions=True)  # HF's capture hooks stay

    def hooked_modules_of(model):
        return hooked_modules([(unit.name, unit.module) for unit in engine.units])

    assert hooked_modules_of(model) == []  # megatrain's own and HF's output capture draw nothing
    handle = model.model.layers[1].self_attn.o_proj.register_full_backward_hook(lambda *a: None)
    assert hooked_modules_of(model) == ["model.layers.1.self_attn.o_proj._backward_hooks"]
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
    try:
        assert hooked_modules_of(model) == ["torch global _forward_pre_hooks"]
    finally:
        handle.remove()


def test_sub_module_hooks_fire_once_per_forward_and_modifying_ones_in_the_recompute(tmp_path):
    """What the README says: a hook on a decoder sub-module fires once per forward; one that changes a
    value (or draws random numbers) runs again in the backward's recompute, as under torch's
    activation checkpointing."""
    counts = []
    for name, plugins in (("ref", []), ("mt", [MegaTrainPlugin()])):
        model = tiny_model("llama", **without_dropout("llama"))
        calls = {"watch": 0, "scale": 0}

        def watch(module, args, output, calls=calls):
            calls["watch"] += 1

        def scale(module, args, output, calls=calls):
            calls["scale"] += 1
            return output * 0.9

        model.model.layers[0].mlp.register_forward_hook(watch)
        model.model.layers[1].mlp.register_forward_hook(scale)
        _run(tmp_path, name, model, plugins)
        counts.append(calls)
    assert counts[0] == {"watch": 12, "scale": 12}
    assert counts[1] == {"watch": 12, "scale": 24}

"""Callables bound to a unit's real modules (axolotl's LoRA kernels' form) under megatrain vs plain Trainer.

axolotl (``lora_qkv_kernel`` / ``lora_o_kernel`` / ``lora_mlp_kernel``, on by default with ``adapter: lora``)
rewrites the attention class's ``forward`` to call ``self.apply_qkv(...)`` / ``self.apply_o(...)``, sets those
on each real attention module as methods bound with ``types.MethodType``, and sets each MLP's ``forward`` the
same way. The template mirrored them as they were: the streamed layer computed q/k/v/o with the real module's
host parameters, and the attention adapters' gradients were lost (every attention ``lora_B`` stayed 0). Here
the same forms -- the class forward rewritten as axolotl rewrites it, the methods axolotl binds when its
kernels are off (``original_apply_qkv`` / ``original_apply_o``), an MLP ``forward`` bound per instance -- train
exactly as plain Trainer, and the per-instance ``forward`` runs. (axolotl's own Triton kernels run in the
integration job, ``make test-integrations``.)
"""

from __future__ import annotations

import functools
import importlib
import inspect
import textwrap
import types

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers.models.llama import modeling_llama

from megatrain_hf import MegaTrainPlugin
from megatrain_hf.errors import UnitCallableError
from tests.helpers import assert_close_losses, assert_close_params, state_of, tiny_model, train, training_args

CALLS = {"mlp": 0}


def apply_qkv(self, hidden_states):  # axolotl's original_apply_qkv
    return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)


def apply_o(self, hidden_states):  # axolotl's original_apply_o
    return self.o_proj(hidden_states)


def mlp_kernel(self, x):  # a per-instance MLP forward (where axolotl binds apply_lora_mlp_swiglu)
    CALLS["mlp"] += 1
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.fixture
def axolotl_attention(monkeypatch):
    """LlamaAttention.forward rewritten as axolotl's ``patch_self_attn_lora`` rewrites it."""
    source = textwrap.dedent(inspect.getsource(modeling_llama.LlamaAttention.forward))
    qkv = ("query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n"
           "key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n"
           "value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n")
    source = textwrap.indent(source, " ")  # match the lines whatever their indentation
    lines = [line.strip() for line in qkv.splitlines()]
    for line in lines:
        assert line in source, f"transformers' LlamaAttention.forward changed: {line!r} not found"
    indent = source[: source.index(lines[0])].rsplit("\n", 1)[1]
    source = source.replace(indent + lines[0] + "\n" + indent + lines[1] + "\n" + indent + lines[2],
                            indent + "query_states, key_states, value_states = self.apply_qkv(hidden_states)\n"
                            + indent + "query_states = query_states.view(hidden_shape).transpose(1, 2)\n"
                            + indent + "key_states = key_states.view(hidden_shape).transpose(1, 2)\n"
                            + indent + "value_states = value_states.view(hidden_shape).transpose(1, 2)")
    assert "self.o_proj(attn_output)" in source
    source = textwrap.dedent(source.replace("self.o_proj(attn_output)", "self.apply_o(attn_output)"))
    namespace = dict(vars(importlib.import_module(modeling_llama.__name__)))
    exec(source, namespace)  # noqa: S102 (the test's own rewrite of transformers' source, as axolotl does)
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", namespace["forward"])


def _lora_model(bind, seed: int = 0):
    model = tiny_model("llama", seed=seed, attention_dropout=0.0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=True,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    for layer in model.base_model.model.model.layers:
        bind(layer)
    return model


def _axolotl_form(layer):
    layer.self_attn.apply_qkv = types.MethodType(apply_qkv, layer.self_attn)
    layer.self_attn.apply_o = types.MethodType(apply_o, layer.self_attn)
    layer.mlp.forward = types.MethodType(mlp_kernel, layer.mlp)


def _partial_form(layer):
    layer.self_attn.apply_qkv = functools.partial(apply_qkv, layer.self_attn)
    layer.self_attn.apply_o = functools.partial(apply_o, layer.self_attn)
    layer.mlp.forward = functools.partial(mlp_kernel, layer.mlp)


@pytest.mark.parametrize("bind", [_axolotl_form, _partial_form], ids=["method", "partial"])
def test_methods_bound_to_real_modules_train_exactly(tmp_path, axolotl_attention, bind):
    ref = _lora_model(bind)
    _, ref_losses = train(ref, training_args(tmp_path / "ref", gradient_accumulation_steps=1))
    CALLS["mlp"] = 0
    got = _lora_model(bind)
    _, got_losses = train(got, training_args(tmp_path / "got", gradient_accumulation_steps=1),
                          callbacks=[MegaTrainPlugin()])
    assert CALLS["mlp"] > 0  # the per-instance MLP forward ran under megatrain (the template had dropped it)
    assert_close_losses(ref_losses, got_losses, atol=1e-6)
    ref_state, got_state = state_of(ref), state_of(got)
    assert_close_params(ref_state, got_state, atol=1e-6)
    for name, value in got_state.items():  # every adapter trained (the attention ones stayed 0)
        if "lora_B" in name:
            assert value.abs().max() > 0, name


def test_a_closure_over_a_real_module_is_refused_at_attach(tmp_path, axolotl_attention):
    def bind(layer):
        attn = layer.self_attn
        layer.self_attn.apply_qkv = lambda hidden: apply_qkv(attn, hidden)
        layer.self_attn.apply_o = types.MethodType(apply_o, layer.self_attn)

    model = _lora_model(bind)
    with pytest.raises(UnitCallableError, match=r"self_attn\.apply_qkv .*closure cell 'attn'"):
        train(model, training_args(tmp_path, max_steps=1), callbacks=[MegaTrainPlugin()])

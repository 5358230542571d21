"""A partly frozen model trained with bf16=True: every weight save_model writes is bit-equal to plain
Trainer's file (issue 33, item 5): frozen fp32 weights stay fp32 in memory and in the file (the
compute still gets them rounded to bf16 on the device, as autocast rounds them). CPU."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.helpers import tiny_model, train, training_args
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, attach


def _frozen(model):
    for name, p in model.named_parameters():
        if name.startswith("model.layers.0.") or name == "model.embed_tokens.weight":
            p.requires_grad_(False)
    return model


def _saved(tmp_path, name, plugins):
    model = _frozen(tiny_model("llama", attention_dropout=0.0))
    original = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer, _ = train(model, training_args(tmp_path / name, bf16=True, max_steps=2), callbacks=plugins)
    trainer.save_model(str(tmp_path / name / "final"))
    return load_file(str(tmp_path / name / "final" / "model.safetensors")), original


def test_save_model_writes_frozen_weights_as_plain_trainer(tmp_path):
    ref, original = _saved(tmp_path, "ref", [])
    got, _ = _saved(tmp_path, "mt", [MegaTrainPlugin()])
    assert ref.keys() == got.keys()
    for name in original:  # frozen: unchanged fp32, bit for bit
        assert got[name].dtype == torch.float32 == ref[name].dtype, name
        assert torch.equal(got[name], original[name]) and torch.equal(ref[name], original[name]), name
    for name in ref:  # every tensor of the file in plain Trainer's dtype
        assert got[name].dtype == ref[name].dtype, name


def test_every_saved_weight_bit_equal_in_fp32(tmp_path):
    """The class rule in fp32 (bitwise where plain Trainer's AdamW is reproduced bitwise): the whole file."""
    files = []
    for name, plugins in (("ref", []), ("mt", [MegaTrainPlugin()])):
        model = _frozen(tiny_model("llama", attention_dropout=0.0))
        trainer, _ = train(model, training_args(tmp_path / name, max_steps=2), callbacks=plugins)
        trainer.save_model(str(tmp_path / name / "final"))
        files.append(load_file(str(tmp_path / name / "final" / "model.safetensors")))
    assert files[0].keys() == files[1].keys()
    for name in files[0]:
        assert files[1][name].dtype == files[0][name].dtype, name
        torch.testing.assert_close(files[1][name], files[0][name], atol=1e-6, rtol=0, msg=name)


def test_peft_base_stays_in_wire_dtype_and_is_not_saved():
    """A PEFT model's checkpoints hold the adapters: its frozen base keeps the 2 B/param bf16 storage."""
    import pytest

    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    attach(model, MegaTrainConfig(), device="cpu", bf16=True)
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert base.dtype == torch.bfloat16
    plain = tiny_model("llama")
    attach(_frozen(plain), MegaTrainConfig(), device="cpu", bf16=True)
    assert plain.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32

"""Modules patched per instance after attach (Liger-Kernel's pattern under Trainer(use_liger_kernel=True),
which patches the model when ``train()`` starts): the new attributes and bound ``forward`` reach the template
at the next bind, and training is exact (CPU, fp32) against the same patch on a plain model."""

from __future__ import annotations

import types

import torch

from tests.helpers import RandomTokens, tiny_model
from megatrain_hf import attach


def _offset_rms_forward(self, hidden_states):
    """An RMSNorm with Liger's attributes (``offset``, ``casting_mode``): weight * (offset + 1) scaling."""
    assert self.casting_mode == "llama"
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    normed = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return normed * (self.offset + self.weight)


def _patch(model) -> None:
    """As Liger's ``_patch_rms_norm_module``: plain attributes set, then ``forward`` bound to the instance."""
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.offset, norm.casting_mode = 0.5, "llama"
            norm.__dict__["forward"] = types.MethodType(_offset_rms_forward, norm)


def _train(model, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = RandomTokens(n=2 * steps).ids
    losses = []
    for i in range(steps):
        batch = ids[2 * i: 2 * i + 2]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_instance_patch_after_attach_trains_exactly():
    ref = tiny_model("llama")
    _patch(ref)
    ref_losses = _train(ref)

    model = tiny_model("llama")
    engine = attach(model, device="cpu")
    _patch(model)  # after attach: what the templates mirrored at attach lacks these attributes
    losses = _train(model)

    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
    # the template's norm ran the instance's forward, rebound to the template (not the real module)
    unit = engine.units[1]
    template_norm = unit.template.module.input_layernorm
    assert template_norm.__dict__["forward"].__self__ is template_norm
    assert template_norm.offset == 0.5


def test_attribute_removed_after_attach_is_not_mirrored():
    model = tiny_model("llama")
    norm = model.model.layers[0].input_layernorm
    norm.extra_scale = 2.0
    engine = attach(model, device="cpu")
    ids = RandomTokens(n=2).ids
    model(input_ids=ids, labels=ids)
    template_norm = engine.units[1].template.module.input_layernorm
    assert template_norm.extra_scale == 2.0
    del norm.extra_scale
    model(input_ids=ids, labels=ids)
    assert not hasattr(template_norm, "extra_scale")


def _patch_final_norm(model) -> None:
    """As Liger patches ``model.norm``: a unit's root (the final norm is a unit of its own), after attach."""
    norm = model.model.norm
    norm.offset, norm.casting_mode = 0.5, "llama"
    norm.__dict__["forward"] = types.MethodType(_offset_rms_forward, norm)


def test_unit_root_forward_replaced_after_attach_streams_and_trains_exactly():
    """Liger replaces the final norm's instance forward after attach; that replaced the engine's streamed forward
    of the unit, so the norm computed with its host master (on CUDA: a CPU tensor given to a Triton kernel). The
    replacement is adopted as the unit's own forward on the template, and the streamed forward put back."""
    ref = tiny_model("llama")
    _patch(ref)
    _patch_final_norm(ref)
    ref_losses = _train(ref)

    model = tiny_model("llama")
    engine = attach(model, device="cpu")
    _patch(model)
    _patch_final_norm(model)
    losses = _train(model)

    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
    norm_unit = next(u for u in engine.units if u.module is model.model.norm)
    streamed = model.model.norm.__dict__["forward"]
    assert getattr(streamed, "func", None).__name__ == "_unit_forward"  # the engine's forward is back
    assert norm_unit.mirror.root_forward.__self__ is norm_unit.template.module  # Liger's, on the template

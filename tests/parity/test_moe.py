"""Mixture-of-experts families against plain training (CPU, fp32).

The router's load-balancing loss (``output_router_logits=True``): HF captures the router logits
with output-capture hooks on the routers, sub-modules of the streamed layers, and adds
``router_aux_loss_coef`` x the loss in the model's forward; its gradient must reach the routers
and the layers below as in plain training. An expert that gets no token in a micro-batch: the
experts are one fused tensor per projection, so its rows of the gradient are exactly zero, as in
plain training, and AdamW treats them as torch's AdamW does (the Trainer parity checks it).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    MOE_FAMILIES,
    RandomTokens,
    assert_close_losses,
    assert_close_params,
    state_of,
    tiny_model,
    train,
    training_args,
)
from megatrain_hf import MegaTrainPlugin, attach

ATOL = 1e-6


def _batch(n: int = 2, seq: int = 16) -> dict:
    data = RandomTokens(n=n, seq=seq)
    return {k: torch.stack([data[i][k] for i in range(n)]) for k in data[0]}


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _routed(model) -> list[torch.Tensor]:
    """Per router call in training: tokens each expert got (a forward hook on every router)."""
    counts = []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "num_experts"):
            gate.register_forward_hook(lambda m, a, out: counts.append(
                torch.bincount(out[2].reshape(-1), minlength=m.num_experts)) if m.training else None)
    return counts


@pytest.mark.parametrize("aux", [True, False], ids=["aux-loss", "no-aux-loss"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_aux_loss_and_its_gradient_arrive(family, aux):
    batch = _batch()
    ref = tiny_model(family, attention_dropout=0.0, output_router_logits=aux)
    ref_out = ref(**batch)
    ref_out.loss.backward()
    model = tiny_model(family, attention_dropout=0.0, output_router_logits=aux)
    engine = attach(model, device="cpu")
    out = model(**batch)
    out.loss.backward()
    engine.synchronize()
    assert torch.equal(ref_out.loss, out.loss)
    if aux:
        assert out.aux_loss is not None and out.aux_loss.requires_grad  # the captured logits carry the graph
        assert torch.equal(ref_out.aux_loss, out.aux_loss)
        assert len(out.router_logits) == len([m for m in model.modules() if type(m).__name__.endswith("TopKRouter")])
    else:
        assert out.aux_loss is None
    expected, got = _grads(ref), _grads(model)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=ATOL, rtol=0, msg=name)


def test_the_aux_loss_changes_the_router_gradient():
    """The parity above is not vacuous: the auxiliary term's gradient is a visible part of the router's."""
    batch = _batch()
    grads = []
    for aux in (True, False):
        model = tiny_model("mixtral", attention_dropout=0.0, output_router_logits=aux)
        model(**batch).loss.backward()
        grads.append(model.model.layers[0].mlp.gate.weight.grad)
    assert (grads[0] - grads[1]).abs().max() > 1e-4


def _sparse_mixtral(seed: int = 0):
    """8 experts, top-1: a micro-batch of 4 tokens reaches at most 4 experts of each layer."""
    return tiny_model("mixtral", seed=seed, num_local_experts=8, num_experts_per_tok=1)


def test_expert_without_tokens_gets_the_plain_gradient():
    batch = _batch(n=1, seq=4)
    ref = _sparse_mixtral()
    routed = _routed(ref)
    ref(**batch).loss.backward()
    model = _sparse_mixtral()
    engine = attach(model, device="cpu")
    model(**batch).loss.backward()
    engine.synchronize()
    idle = (routed[0] == 0).nonzero().flatten()
    assert len(idle) >= 4  # layer 0: at least 4 of 8 experts got no token
    experts_ref, experts = ref.model.layers[0].mlp.experts, model.model.layers[0].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        grad, grad_ref = getattr(experts, name).grad, getattr(experts_ref, name).grad
        assert torch.equal(grad[idle], torch.zeros_like(grad[idle]))  # fused tensor: zero rows, as plain
        assert torch.equal(grad_ref[idle], torch.zeros_like(grad_ref[idle]))
    expected, got = _grads(ref), _grads(model)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=ATOL, rtol=0, msg=name)


def test_trainer_parity_with_idle_experts(tmp_path):
    """Six steps of 2 micro-batches of 4 tokens over 8 top-1 experts: experts idle in a micro-batch
    (and in whole steps) train exactly as under plain Trainer, aux loss included."""
    data = RandomTokens(n=24, seq=4)
    args = dict(per_device_train_batch_size=1)
    ref = _sparse_mixtral()
    ref_routed = _routed(ref)
    _, ref_losses = train(ref, training_args(tmp_path / "ref", **args), dataset=data)
    model = _sparse_mixtral()
    routed = _routed(model)  # the hooks on the real routers run once per forward, as in plain training
    _, losses = train(model, training_args(tmp_path / "mt", **args), dataset=data, callbacks=[MegaTrainPlugin()])
    assert len(ref_routed) == len(routed) == 12 * 2  # 12 micro-batches x 2 layers
    assert all(torch.equal(a, b) for a, b in zip(ref_routed, routed))  # the same routing
    step_idle = [(ref_routed[s * 4 + l] + ref_routed[s * 4 + 2 + l] == 0).any().item()
                 for s in range(6) for l in range(2)]
    assert any(step_idle)  # some expert got no token in a whole optimizer step
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_params(state_of(ref), state_of(model), ATOL)

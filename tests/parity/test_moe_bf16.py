"""Mixture-of-experts families in bf16 against plain Trainer ``bf16=True`` (CPU autocast).

transformers' default experts kernel, ``grouped_mm``, is not autocast-enabled and casts its input to
the weights' dtype (pytorch/pytorch#174763): plain bf16 training computes the routed experts with the
fp32 masters. megatrain's default (``experts_dtype="auto"``) sends them in fp32 too, so the runs are
bitwise equal; ``experts_dtype="compute"`` sends them in bf16 like every matrix, which is measurably
another arithmetic (the numbers are in docs/log-moe.md). ``experts_implementation="eager"`` (one
``F.linear`` per expert) is autocast's arithmetic on bf16 weights, so the rule keeps bf16 there.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import (
    MOE_FAMILIES,
    RandomTokens,
    assert_close_losses,
    assert_close_params,
    assert_same_state,
    state_of,
    tiny_model,
    train,
    training_args,
)
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, attach, engine_of
from megatrain_hf.core.layout import Kind
from megatrain_hf.core.streams import EmulatedStreams

# experts_dtype="compute" against plain, measured on the CPU (6 steps, docs/log-moe.md): losses 1.2e-4 (qwen2_moe)
# to 5.9e-4 (mixtral) apart, the worst parameter 5.2e-3 to 6.4e-3.
COMPUTE_LOSS_BOUND, COMPUTE_PARAM_BOUND = 2e-3, 2e-2


def _moe_model(family: str, kernel: str | None = None):
    model = tiny_model(family)
    if kernel is not None:
        model.set_experts_implementation(kernel)
    return model


def _experts_wires(model) -> dict[str, torch.dtype]:
    """Wire dtype of every parameter of the experts modules and of the routers, by name."""
    engine = engine_of(model)
    return {f"{engine.units[u].name}.{e.name}": e.wire for u, entries in enumerate(engine.store.entries)
            for e in entries if ".experts." in f".{e.name}" or e.name.endswith("gate.weight")}


def _plain_and_megatrain(tmp_path, family: str, kernel: str | None = None, **options):
    ref = _moe_model(family, kernel)
    _, ref_losses = train(ref, training_args(tmp_path / "ref", bf16=True))
    model = _moe_model(family, kernel)
    _, losses = train(model, training_args(tmp_path / "mt", bf16=True),
                      callbacks=[MegaTrainPlugin(MegaTrainConfig(**options))])
    return ref, ref_losses, model, losses


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bf16_moe_is_plain_trainers_arithmetic(tmp_path, family, caplog):
    """The default: the experts in fp32 on the wire and in the compute, the routers (nn.Linear-like) in bf16;
    every micro-batch loss and every parameter after 6 steps bitwise plain Trainer's."""
    with caplog.at_level(logging.INFO, logger="megatrain_hf.plan"):
        ref, ref_losses, model, losses = _plain_and_megatrain(tmp_path, family)
    assert model.config._experts_implementation == "grouped_mm"
    wires = _experts_wires(model)
    assert {w for n, w in wires.items() if ".experts." in n} == {torch.float32}
    assert {w for n, w in wires.items() if n.endswith("gate.weight") and ".experts." not in n} == {torch.bfloat16}
    assert engine_of(model).plan.precision.experts == torch.float32
    assert [r for r in caplog.records if "experts_dtype='auto'" in r.getMessage() and r.levelno == logging.INFO]
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(model))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_compute_experts_are_another_arithmetic(tmp_path, family):
    """experts_dtype="compute": bf16 experts, as before the default changed -- not plain's arithmetic (the test
    above would fail), within the measured distance."""
    ref, ref_losses, model, losses = _plain_and_megatrain(tmp_path, family, experts_dtype="compute")
    assert {w for n, w in _experts_wires(model).items() if ".experts." in n} == {torch.bfloat16}
    assert "experts fp32" not in [key for key, _ in engine_of(model).plan.adjustments]
    worst_loss = max(abs(a - b) for a, b in zip(ref_losses, losses))
    ref_state, state = state_of(ref), state_of(model)
    worst_param = max((ref_state[n] - state[n]).abs().max().item() for n in ref_state)
    assert 1e-5 < worst_loss and 1e-3 < worst_param  # measurably not plain's
    assert_close_losses(ref_losses, losses, COMPUTE_LOSS_BOUND)
    assert_close_params(ref_state, state, COMPUTE_PARAM_BOUND)


def test_eager_experts_stay_bf16_and_match(tmp_path):
    """experts_implementation="eager" runs F.linear on each expert's slice, which autocast rounds as the bf16
    copy is rounded: "auto" keeps them in bf16, and the run is plain's bitwise."""
    ref, ref_losses, model, losses = _plain_and_megatrain(tmp_path, "mixtral", kernel="eager")
    assert {w for n, w in _experts_wires(model).items() if ".experts." in n} == {torch.bfloat16}
    assert engine_of(model).plan.precision.experts == torch.bfloat16
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(model))


@pytest.mark.parametrize("experts_dtype", ["auto", "compute"])
def test_link_bytes_of_the_experts(experts_dtype):
    """One forward + backward with the CUDA pipeline emulated: every weight crosses the link in its wire dtype
    (fp32 experts: 4 B each, twice per step), the gradients come down in fp32 either way."""
    model = tiny_model("mixtral", attention_dropout=0.0)
    engine = attach(model, MegaTrainConfig(experts_dtype=experts_dtype), device="cpu", bf16=True,
                    streams=EmulatedStreams())
    data = RandomTokens(n=2)
    batch = {k: torch.stack([data[i][k] for i in range(2)]) for k in data[0]}
    engine.stats.reset()
    model(**batch).loss.backward()
    engine.synchronize()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    size = 4 if experts_dtype == "auto" else 2
    store = engine.store
    wire = [sum(e.numel * e.wire.itemsize for e in entries if e.owner == u and e.kind is not Kind.BUFFER)
            for u, entries in enumerate(store.entries)]
    assert sum(e.numel * e.wire.itemsize for entries in store.entries for e in entries
               if ".experts." in f".{e.name}") == size * experts
    assert engine.stats.h2d_bytes == 2 * sum(wire) - wire[-1]  # forward and backward; the head stays resident
    assert engine.stats.d2h_bytes == 4 * store.trainable_numel()
    engine.detach()

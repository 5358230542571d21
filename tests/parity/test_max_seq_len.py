"""``max_seq_len`` through the engine on the CPU: the placement it takes trains bitwise as the same options set
by hand, and a sequence longer than ``max_seq_len`` is logged once, or refused where the placement no longer
fits it.

On the CPU the device is the host; ``max_gpu_memory`` is the device budget the placement plans against, so a
budget just under the default placement's makes it choose another (host checkpoints, an interval).
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, attach
from megatrain_hf.errors import LongContextFitError
from megatrain_hf.memory import seq_placement
from megatrain_hf.memory.long_context import _best, candidates
from megatrain_hf.memory.shapes import ModelShape
from tests.helpers import SEQ, assert_same_state, state_of, tiny_model, train, training_args

LAYERS = 4


def _budget_for_another_placement(shape: ModelShape, seq: int, pick=max) -> tuple[int, dict]:
    """A device budget under which the exact placement at ``seq`` is not the default one (every checkpoint on
    the device), and that placement's options (``pick``: the largest such budget, or the smallest that fits)."""
    fixed = seq_placement.Fixed()  # fp32 compute, as the Trainer runs here
    plans = candidates(shape, seq, 1 << 62, 1 << 62, None, compute_dtype="fp32", **fixed.narrowed(False))
    default = next(p for p in plans if (p.ckpt.home, p.ckpt.interval) == ("gpu", 1))
    budget = pick(sum(p.gpu.values()) for p in plans if sum(p.gpu.values()) < sum(default.gpu.values()))
    best = _best(plans, budget, 1 << 62, None)
    assert (best.ckpt.home, best.ckpt.interval) != ("gpu", 1)
    return budget, {k: best.options()[k] for k in ("offload_checkpoints", "checkpoint_interval")}


@pytest.mark.parametrize("pick", [max, min], ids=["an-interval", "host-checkpoints"])
def test_the_placement_trains_bitwise_as_the_same_options_set_by_hand(tmp_path, caplog, pick):
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    budget, chosen = _budget_for_another_placement(ModelShape.from_hf_config(model.config), SEQ, pick)
    if pick is min:  # the least device memory: the checkpoints in host RAM
        assert chosen["offload_checkpoints"] is True
    args = dict(gradient_accumulation_steps=1, max_steps=4)
    with caplog.at_level(logging.INFO, logger="megatrain_hf.plan"):
        _, losses = train(model, training_args(tmp_path / "auto", **args),
                          callbacks=[MegaTrainPlugin(max_seq_len=SEQ, max_gpu_memory=budget)])
    placed = [r.getMessage() for r in caplog.records if "max_seq_len" in r.getMessage()]
    assert len(placed) == 1 and placed[0].startswith("megatrain plan: max_seq_len x machine")
    assert ", ".join(f"{k}={v!r}" for k, v in chosen.items()) in placed[0]
    ref = tiny_model("llama", num_hidden_layers=LAYERS)
    _, ref_losses = train(ref, training_args(tmp_path / "hand", **args),
                          callbacks=[MegaTrainPlugin(max_gpu_memory=budget, **chosen)])
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(model))


def _step(model, seq: int) -> None:
    ids = torch.randint(0, 128, (1, seq), generator=torch.Generator().manual_seed(seq))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()


def test_a_longer_sequence_is_logged_once_where_the_placement_still_fits(caplog):
    model = tiny_model("llama", num_hidden_layers=LAYERS, attention_dropout=0.0)
    engine = attach(model, MegaTrainConfig(max_seq_len=32))
    try:
        with caplog.at_level(logging.WARNING, logger="megatrain_hf.plan"):
            _step(model, 32)
            assert not caplog.records
            _step(model, 48)
            _step(model, 56)
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1 and "a training sequence of 48 tokens is longer than max_seq_len=32" in warned[0]
    finally:
        engine.detach()


def test_a_longer_sequence_the_placement_does_not_fit_is_refused_before_its_forward():
    model = tiny_model("llama", num_hidden_layers=LAYERS, attention_dropout=0.0)
    engine = attach(model, MegaTrainConfig(max_seq_len=32))
    placed = engine.plan.long_context
    engine.detach()
    model = tiny_model("llama", num_hidden_layers=LAYERS, attention_dropout=0.0)
    engine = attach(model, MegaTrainConfig(max_seq_len=32, max_gpu_memory=sum(placed.gpu.values())))
    try:
        assert engine.plan.long_context.ckpt == placed.ckpt  # the budget it was planned at: the same placement
        _step(model, 32)
        with pytest.raises(LongContextFitError, match=r"a training sequence of 48 tokens is longer than "
                                                      r"MegaTrainConfig\(max_seq_len=32\).*Fix: max_seq_len=48"):
            _step(model, 48)
    finally:
        engine.detach()

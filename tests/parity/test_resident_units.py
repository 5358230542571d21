"""Resident units (``resident_units=N``) train exactly like the streamed run, on the CPU as the "device".

Through Trainer + the plugin, fp32, ``max_grad_norm`` small enough that every step clips, accumulation
2: every logged loss and every final parameter of ``resident_units=2`` and of every unit resident equal
the streamed run's (``resident_units=0``) bitwise; the checkpoints' model and optimizer files are the
same bytes; a resume from a mid-run checkpoint ends where the uninterrupted run ends. The device state
is a separate copy on the CPU, so the host flats are not what trains.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from tests.helpers import assert_same_state, optimizer_files, state_of, tiny_model, train, training_args

from megatrain_hf import HostAdamW, MegaTrainConfig, MegaTrainPlugin, attach
from megatrain_hf.errors import IncompatibleOptionsError

ALL = 99  # more than the tiny model's units: every unit resident


def _run(tmp_path, name, resident, model=None, resume=None, bf16=False, **args):
    model = model if model is not None else tiny_model("llama")
    config = MegaTrainConfig(resident_units=resident)
    trainer, losses = train(model, training_args(tmp_path / name, max_grad_norm=0.05, bf16=bf16, **args),
                            callbacks=[MegaTrainPlugin(config)], resume=resume)
    return trainer, model, losses


def _files(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if name.endswith(".safetensors")}


@pytest.mark.parametrize("resident", [2, ALL], ids=["two-units", "every-unit"])
def test_resident_units_train_like_the_streamed_run(tmp_path, resident):
    _, ref, ref_losses = _run(tmp_path, "streamed", 0)
    trainer, got, losses = _run(tmp_path, "resident", resident)
    engine = got._megatrain_engine
    units = len(engine.units)
    assert engine.resident is not None and engine.resident.units == frozenset(range(min(resident, units)))
    assert engine.plan.residency.units == engine.resident.units
    assert losses == ref_losses and len(losses) == 12
    assert_same_state(state_of(ref), state_of(got))


def test_resident_device_state_is_what_trains(tmp_path):
    """The device copies train; the host masters are level only after a synchronize (a read of the model)."""
    trainer, got, _ = _run(tmp_path, "resident", 2, max_steps=2)
    engine = got._megatrain_engine
    resident, store = engine.resident, engine.store
    for u in resident.units:
        assert resident.master[u].data_ptr() != store.buffers[u].master_host.data_ptr()
        assert torch.equal(resident.master[u], store.buffers[u].master_host)  # synchronized at the end of train()
        e = store.owned_trainable(u)[0]
        assert e.tensor.grad is None or e.tensor.grad.data_ptr() == resident.grad[u][e.offset:].data_ptr()
    assert not resident.host_stale


def test_resident_checkpoints_and_resume_equal_the_streamed_run(tmp_path):
    args = dict(save_strategy="steps", save_steps=3)
    ref_trainer, ref, ref_losses = _run(tmp_path, "streamed", 0, **args)
    trainer, got, losses = _run(tmp_path, "resident", 2, **args)
    assert losses == ref_losses
    for step in (3, 6):
        streamed, resident = tmp_path / "streamed" / f"checkpoint-{step}", tmp_path / "resident" / f"checkpoint-{step}"
        assert _files(streamed) == _files(resident)
        assert optimizer_files(streamed) == optimizer_files(resident)
    resumed = tiny_model("llama", seed=9)
    _, _, resumed_losses = _run(tmp_path, "resident", 2, model=resumed,
                                resume=str(tmp_path / "resident" / "checkpoint-3"), **args)
    assert resumed_losses == ref_losses[len(ref_losses) // 2:]
    assert_same_state(state_of(ref), state_of(resumed))


def test_resident_units_with_bf16_compute_equal_the_streamed_run(tmp_path):
    """bf16 compute: the resident units' compute-dtype copy is refreshed by each device update."""
    _, ref, ref_losses = _run(tmp_path, "streamed", 0, bf16=True, max_steps=4)
    _, got, losses = _run(tmp_path, "resident", 3, bf16=True, max_steps=4)
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(got))


def _hand_step(model, engine, optimizer, seed, max_norm=0.05):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    engine.clip_grad_norm_(max_norm, optimizer=optimizer)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _hand_run(resident, edit=None):
    model = tiny_model("llama")
    engine = attach(model, MegaTrainConfig(device="cpu", resident_units=resident))
    optimizer = engine.host_optimizer(torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1))
    losses = []
    for seed in range(4):
        if seed == 2 and edit is not None:
            edit(model, engine, optimizer)
        losses.append(_hand_step(model, engine, optimizer, seed))
    engine.synchronize()
    return model, engine, optimizer, losses


def test_loads_and_edits_between_steps_reach_the_device():
    """A model load_state_dict, an in-place edit of a parameter and an optimizer load between steps reach
    the resident units' device state, as they reach the host flats of the streamed run."""
    donor = tiny_model("llama", seed=5).state_dict()

    def edit(model, engine, optimizer):
        state = optimizer.state_dict()
        model.load_state_dict(donor)
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.5)  # in place: its version counter
        for s in state["state"].values():
            s["exp_avg"] = s["exp_avg"] * 0.5
        optimizer.load_state_dict(state)

    ref, _, ref_opt, ref_losses = _hand_run(0, edit)
    got, engine, opt, losses = _hand_run(2, edit)
    assert engine.resident is not None
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(got))
    for a, b in zip(ref_opt.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_a_nonfinite_norm_skips_the_resident_update():
    model = tiny_model("llama")
    engine = attach(model, MegaTrainConfig(device="cpu", resident_units=2))
    optimizer = engine.host_optimizer(torch.optim.AdamW(model.parameters(), lr=2e-3))
    before = state_of(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    model.model.embed_tokens.weight.grad[0, 0] = float("nan")  # a resident unit's device gradient
    assert not math.isfinite(float(engine.clip_grad_norm_(1.0, optimizer=optimizer)))
    optimizer.step()
    optimizer.zero_grad()
    engine.synchronize()
    assert optimizer.skipped_steps == 1
    assert_same_state(before, state_of(model))


def test_another_optimizer_on_resident_units_is_refused():
    model = tiny_model("llama")
    engine = attach(model, MegaTrainConfig(device="cpu", resident_units=1))
    with pytest.raises(Exception, match="scheduler= cannot replace it"):
        HostAdamW(model.parameters(), engine.store, scheduler=lambda *a: None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(IncompatibleOptionsError, match="only HostAdamW updates them there"):
        optimizer.step()

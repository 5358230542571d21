"""Resident units (``resident_units=N``) train exactly like the streamed run, on the CPU as the "device".

Through Trainer + the plugin, fp32, ``max_grad_norm`` small enough that every step clips, accumulation
2: every logged loss and every final parameter of ``resident_units=2`` and of every unit resident equal
the streamed run's (``resident_units=0``) bitwise; the checkpoints' model and optimizer files are the
same bytes; a resume from a mid-run checkpoint ends where the uninterrupted run ends. The device state
is a separate copy on the CPU, so the host flats are not what trains.

Each runs on the plain CPU path and over ``EmulatedStreams`` (``emulated``): the CUDA code of resident
units -- gradients added into the device accumulator on the compute stream with ``.grad`` left None, norms
as device scalars, the update on a side stream whose event each fetch waits on -- with events that
complete late. The hand loops check the gradient path on its own: accumulation, clipping deferred and
not (any norm type), ``zero_grad`` of the optimizer and of the model (in place too), a NaN skip.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from tests.helpers import assert_same_state, optimizer_files, state_of, tiny_model, train, training_args

from megatrain_hf import HostAdamW, MegaTrainConfig, MegaTrainPlugin, attach
from megatrain_hf.core.streams import EmulatedStreams
from megatrain_hf.errors import IncompatibleOptionsError, UsageError

ALL = 99  # more than the tiny model's units: every unit resident
LATE = 0.005  # the emulated streams' events complete this late
PATHS = [pytest.param(False, id="inline"), pytest.param(True, id="emulated")]


def _run(tmp_path, name, resident, model=None, resume=None, bf16=False, emulated=False, **args):
    model = model if model is not None else tiny_model("llama")
    config = MegaTrainConfig(resident_units=resident)
    if emulated:  # attached first with the emulated streams; the plugin reuses the engine (same options)
        attach(model, config, device="cpu", bf16=bf16, streams=EmulatedStreams(latency_s=LATE))
    trainer, losses = train(model, training_args(tmp_path / name, max_grad_norm=0.05, bf16=bf16, **args),
                            callbacks=[MegaTrainPlugin(config)], resume=resume)
    return trainer, model, losses


def _files(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if name.endswith(".safetensors")}


@pytest.mark.parametrize("emulated", PATHS)
@pytest.mark.parametrize("resident", [2, ALL], ids=["two-units", "every-unit"])
def test_resident_units_train_like_the_streamed_run(tmp_path, resident, emulated):
    _, ref, ref_losses = _run(tmp_path, "streamed", 0)
    trainer, got, losses = _run(tmp_path, "resident", resident, emulated=emulated)
    engine = got._megatrain_engine
    assert (engine.streams is not None) == emulated
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
        for e in store.owned_trainable(u):
            assert e.tensor.grad is None  # on every device: the gradient is the device accumulator's
    assert not resident.host_stale


@pytest.mark.parametrize("emulated", PATHS)
def test_resident_checkpoints_and_resume_equal_the_streamed_run(tmp_path, emulated):
    args = dict(save_strategy="steps", save_steps=3, emulated=emulated)
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


@pytest.mark.parametrize("emulated", PATHS)
def test_resident_units_with_bf16_compute_equal_the_streamed_run(tmp_path, emulated):
    """bf16 compute: the resident units' compute-dtype copy is refreshed by each device update."""
    _, ref, ref_losses = _run(tmp_path, "streamed", 0, bf16=True, max_steps=4)
    _, got, losses = _run(tmp_path, "resident", 3, bf16=True, max_steps=4, emulated=emulated)
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(got))


def _hand_loop(resident, streams=None):
    """A tiny Llama attached with ``resident_units=resident`` (over ``streams``) and its HostAdamW."""
    model = tiny_model("llama")
    engine = attach(model, MegaTrainConfig(device="cpu", resident_units=resident), streams=streams)
    return model, engine, engine.host_optimizer(torch.optim.AdamW(model.parameters(), lr=2e-3))


def _batch(seed):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))
    return ids


def _hand_run(resident, edit=None, emulated=False, steps=4, accumulate=1, clip=None, zero=None):
    """A hand loop: ``accumulate`` backward passes per step, ``clip(engine, optimizer)`` (default: deferred
    clipping at 0.05), ``zero(model, optimizer)`` (default: the optimizer's set-to-none)."""
    model = tiny_model("llama")
    streams = EmulatedStreams(latency_s=LATE) if emulated else None
    engine = attach(model, MegaTrainConfig(device="cpu", resident_units=resident), streams=streams)
    optimizer = engine.host_optimizer(torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1))
    clip = clip or (lambda engine, optimizer: engine.clip_grad_norm_(0.05, optimizer=optimizer))
    zero = zero or (lambda model, optimizer: optimizer.zero_grad())
    losses, norms = [], []
    for step in range(steps):
        if step == 2 and edit is not None:
            edit(model, engine, optimizer)
        for micro in range(accumulate):
            ids = _batch(step * accumulate + micro)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        norms.append(float(clip(engine, optimizer)))
        optimizer.step()
        zero(model, optimizer)
    engine.synchronize()
    return model, engine, optimizer, losses + norms


def _same_optimizer_state(a, b):
    for x, y in zip(a.state_dict()["state"].values(), b.state_dict()["state"].values()):
        assert torch.equal(x["exp_avg"], y["exp_avg"]) and torch.equal(x["exp_avg_sq"], y["exp_avg_sq"])
        assert torch.equal(x["step"], y["step"])


def _zero_in_place(model, optimizer):
    optimizer.zero_grad(set_to_none=False)


def _model_zero(model, optimizer):
    model.zero_grad()  # Trainer's call: the resident gradients are emptied by the model's zero_grad too


def _not_deferred(engine, optimizer):
    return engine.clip_grad_norm_(0.05, optimizer=optimizer, defer=False)


def _l1(engine, optimizer):
    return engine.clip_grad_norm_(0.5, norm_type=1.0, optimizer=optimizer)


GRADIENT_PATHS = {
    "accumulation-3": dict(accumulate=3),
    "zero-in-place": dict(zero=_zero_in_place, accumulate=2),
    "model-zero-grad": dict(zero=_model_zero, accumulate=2),
    "clip-not-deferred": dict(clip=_not_deferred),
    "clip-l1-norm": dict(clip=_l1),
}


@pytest.mark.parametrize("emulated", PATHS)
@pytest.mark.parametrize("case", GRADIENT_PATHS)
def test_the_device_gradient_path_equals_the_host_one(case, emulated):
    """Accumulation over several backward passes, zero_grad in place and through the model, clipping
    multiplied at once (L2 and L1): losses, norms, weights and optimizer state bitwise as streamed."""
    ref, _, ref_opt, ref_out = _hand_run(0, **GRADIENT_PATHS[case])
    got, engine, opt, out = _hand_run(2, emulated=emulated, **GRADIENT_PATHS[case])
    assert engine.resident is not None and (engine.streams is not None) == emulated
    assert out == ref_out
    assert_same_state(state_of(ref), state_of(got))
    _same_optimizer_state(ref_opt, opt)


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
    for emulated in (False, True):
        got, engine, opt, losses = _hand_run(2, edit, emulated=emulated)
        assert engine.resident is not None
        assert losses == ref_losses
        assert_same_state(state_of(ref), state_of(got))
        _same_optimizer_state(ref_opt, opt)


@pytest.mark.parametrize("emulated", PATHS)
def test_a_nonfinite_norm_skips_the_resident_update(emulated):
    model, engine, optimizer = _hand_loop(2, EmulatedStreams(latency_s=LATE) if emulated else None)
    before = state_of(model)
    ids = _batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    embedding = engine.store.owned_trainable(0)[0]
    assert embedding.tensor is model.model.embed_tokens.weight and embedding.tensor.grad is None
    engine.resident.gradient(embedding)[0, 0] = float("nan")  # the resident unit's device gradient
    assert not math.isfinite(float(engine.clip_grad_norm_(1.0, optimizer=optimizer)))
    optimizer.step()
    optimizer.zero_grad()
    engine.synchronize()
    assert optimizer.skipped_steps == 1
    assert_same_state(before, state_of(model))
    # the next step trains from the emptied accumulator (no NaN carried over)
    model(input_ids=ids, labels=ids).loss.backward()
    assert math.isfinite(float(engine.clip_grad_norm_(1.0, optimizer=optimizer)))
    optimizer.step()
    engine.synchronize()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_every_unit_resident_moves_nothing_over_the_link():
    """Every unit resident, over the emulated streams: no upload, no gradient down, no readiness gate
    closed; each fetch makes the compute stream wait for its unit's update (issued on the update stream)."""
    model, engine, optimizer = _hand_loop(ALL, EmulatedStreams(latency_s=0.2))
    ids = _batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    resident, stats, gates = engine.resident, engine.stats, engine.store.gates
    assert set(resident._updated) == set(resident.grad)  # each unit's update event, pending for 0.2 s
    compute = engine.streams.current()
    assert compute._done_at < max(event._done_at for event in resident._updated.values())
    assert all(gates._ready[u].is_set() and gates.generation[u] == 0 for u in range(len(engine.units)))
    optimizer.zero_grad()
    with torch.no_grad():
        model(input_ids=ids)  # its fetches wait (stream order) for the updates
    assert compute._done_at >= max(event._done_at for event in resident._updated.values())
    model(input_ids=ids, labels=ids).loss.backward()
    assert stats.uploads == 0 and stats.h2d_bytes == 0 and stats.d2h_bytes == 0
    engine.synchronize()
    assert not resident._updated
    engine.detach()
    assert all(torch.equal(p.grad, resident.gradient(e)) for u in resident.grad
               for e in engine.store.owned_trainable(u) for p in [e.tensor])  # .grad again, as host copies


def test_a_resident_parameter_with_hooks_or_a_grad_of_its_own_is_refused():
    model = tiny_model("llama")
    engine = attach(model, MegaTrainConfig(device="cpu", resident_units=1))
    ids = _batch(0)
    handle = model.model.embed_tokens.weight.register_hook(lambda g: g)
    with pytest.raises(UsageError, match="has tensor hooks"):
        model(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    model.model.embed_tokens.weight.grad = torch.zeros_like(model.model.embed_tokens.weight)
    with pytest.raises(UsageError, match="has a .grad of its own"):
        model(input_ids=ids, labels=ids).loss.backward()
    engine.detach()


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


def test_the_sequence_tiles_are_sized_from_what_the_resident_units_leave_of_the_budget():
    """Under ``max_gpu_memory`` the resident units' state takes part of the budget: "auto" sequence tiles are
    sized from the rest (a tile that fit the whole budget would not fit beside them)."""
    tiles = {}
    for resident in (0, ALL):
        model = tiny_model("llama")
        engine = attach(model, MegaTrainConfig(device="cpu", resident_units=resident, max_gpu_memory="40MB",
                                               sequence_tile_tokens="auto"))
        mlp = model.model.layers[0].mlp
        tiles[resident] = (engine.plan.residency.device_bytes,
                           engine.runner.tile_policy(2**20, model.config.hidden_size, mlp.intermediate_size))
        engine.detach()
    (none, untouched), (taken, smaller) = tiles[0], tiles[ALL]
    assert none == 0 and taken > 0
    assert smaller < untouched  # the tile of the budget less the resident units' bytes


def test_the_metrics_report_the_share_updated_on_the_device(tmp_path):
    """``megatrain/update_device_frac`` counts the resident units' elements (1 with every unit resident; absent
    with none), the host's rows the streamed units' only: over a hand loop, after ``synchronize``, exactly
    the resident and the streamed elements of each step."""
    from tests.helpers import LogRecorder

    model, engine, optimizer = _hand_loop(2)
    numel = [sum(p.numel() for p in unit.parameters()) for unit in
             [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]]
    assert not model.config.tie_word_embeddings
    optimizer.take_update_stats(), optimizer.take_device_numel()
    for step in range(3):
        ids = _batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    assert optimizer.take_device_numel() == 3 * sum(numel[:2])
    assert optimizer.take_update_stats()[1] == 3 * sum(numel[2:])
    engine.detach()
    for resident in (0, ALL):
        logs = LogRecorder()
        train(tiny_model("llama"), training_args(tmp_path / str(resident), logging_steps=1),
              callbacks=[MegaTrainPlugin(MegaTrainConfig(resident_units=resident, metrics="all")), logs])
        shares = [h.get("megatrain/update_device_frac") for h in logs.logs if "loss" in h]
        assert shares and all(s == (None if resident == 0 else 1.0) for s in shares), shares


class _PinnedCounter(EmulatedStreams):
    """Emulated streams that record each pinned allocation's shape."""

    def __init__(self, latency_s: float) -> None:
        super().__init__(latency_s)
        self.pinned_shapes: list[tuple[int, ...]] = []

    def pinned(self, shape, dtype):
        self.pinned_shapes.append(tuple(shape))
        return super().pinned(shape, dtype)


def test_the_resident_update_sends_its_scalars_up_from_pinned_memory():
    """Each resident group's step counts and clip coefficient go up in one copy from pinned memory (on CUDA a
    non-blocking one: a copy from pageable memory would block the training thread on the update stream)."""
    streams = _PinnedCounter(LATE)
    model, engine, optimizer = _hand_loop(2, streams)
    ids = _batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    engine.clip_grad_norm_(0.05, optimizer=optimizer)  # clips: the coefficient goes up with the step counts
    before = len(streams.pinned_shapes)
    optimizer.step()
    engine.synchronize()
    entries = [len(optimizer.groups_of(u)[0]) for u in sorted(engine.resident.units)]
    assert streams.pinned_shapes[before:] == [(n + 1,) for n in entries]


def test_a_new_optimizer_binds_its_device_moments_after_the_last_update_ran():
    """Building a HostAdamW again drops the device moments the last one's updates write: the host waits for
    those updates first (their memory would be handed to the new moments while an update still writes)."""
    model, engine, optimizer = _hand_loop(ALL, EmulatedStreams(latency_s=0.5))
    ids = _batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    pending = list(engine.resident._updated.values())
    assert pending and not any(event.query() for event in pending)
    engine.host_optimizer(torch.optim.AdamW(model.parameters(), lr=2e-3))
    assert all(event.query() for event in pending)
    engine.detach()


def test_reading_a_resident_gradient_after_the_step_waits_for_its_update():
    """The update multiplies the resident gradients by the clip coefficient in place, on the update stream: a
    read issued after ``step()`` (a norm for logging, no forward in between) runs after it."""
    model, engine, optimizer = _hand_loop(ALL, EmulatedStreams(latency_s=0.5))
    ids = _batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    engine.clip_grad_norm_(0.05, optimizer=optimizer)
    optimizer.step()
    compute, last = engine.streams.current(), max(e._done_at for e in engine.resident._updated.values())
    assert compute._done_at < last
    engine.clip_grad_norm_(1.0)  # recomputes the norms from the clipped device gradients
    assert compute._done_at >= last
    engine.detach()


def test_an_optimizer_replaced_by_a_newer_one_is_refused_its_step():
    """A second HostAdamW binds the resident units' device moments to its own: the first one's step would
    update them with its own step counts, so it is refused with the fix; the newer one trains."""
    model = tiny_model("llama")
    engine = attach(model, MegaTrainConfig(device="cpu", resident_units=2))
    old = engine.host_optimizer(torch.optim.AdamW(model.parameters(), lr=2e-3))
    new = engine.host_optimizer(torch.optim.AdamW(model.parameters(), lr=2e-3))
    ids = _batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(UsageError, match="a newer HostAdamW of this model took over"):
        old.step()
    new.step()
    new.synchronize()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    engine.detach()

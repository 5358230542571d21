"""Activation checkpoints offloaded to host memory (``offload_checkpoints=True``), CPU, fp32.

The checkpoints make a round trip through pooled host buffers; the bytes that come back are the
bytes that went down, so training must equal training without offload bit for bit, in
micro-batch order and layer-major. The pool must stop growing after the first step, return the
buffers of a graph dropped without backward, and refuse clearly when the RAM is short.
"""

from __future__ import annotations

import gc

import pytest
import torch

from megatrain_hf.memory.budget import BUDGET_MARGIN
from tests.helpers import (
    assert_close_losses,
    assert_close_params,
    state_of,
    tiny_model,
    train,
    training_args,
)
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, attach, engine_of
from megatrain_hf.errors import HostMemoryError, MegatrainConfigError, UsageError


def _equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("layer_major", [False, True], ids=["microbatch-order", "layer-major"])
def test_offload_trains_bit_for_bit_like_no_offload(tmp_path, layer_major):
    args = dict(gradient_accumulation_steps=2)
    kw = {} if not layer_major else {"attention_dropout": 0.0}  # dropout keeps micro-batch order
    ref = tiny_model("llama", **kw)
    _, ref_losses = train(ref, training_args(tmp_path / "ref", **args), callbacks=[MegaTrainPlugin()])
    model = tiny_model("llama", **kw)
    trainer, losses = train(model, training_args(tmp_path / "off", **args),
                            callbacks=[MegaTrainPlugin(offload_checkpoints=True)])
    assert losses == ref_losses
    _equal_states(state_of(ref), state_of(model))
    engine = engine_of(model)
    assert engine.offload is not None and engine.offload.pool_bytes > 0
    assert engine.budget.kept_checkpoint_bytes == 0  # nothing counted as kept on the device


def test_offload_layer_major_four_microbatches_matches_plain_trainer(tmp_path):
    args = dict(gradient_accumulation_steps=4)
    ref = tiny_model("qwen2", attention_dropout=0.0)
    _, ref_losses = train(ref, training_args(tmp_path / "ref", **args))
    model = tiny_model("qwen2", attention_dropout=0.0)
    _, losses = train(model, training_args(tmp_path / "off", **args),
                      callbacks=[MegaTrainPlugin(offload_checkpoints=True, layer_major=True)])
    assert_close_losses(ref_losses, losses, 1e-6)
    assert_close_params(state_of(ref), state_of(model), 5e-6)


def test_groups_shrink_to_what_host_ram_holds(tmp_path, monkeypatch):
    """Step 1 runs one micro-batch at a time and measures its checkpoints on the host; later steps
    run as many per layer-major group as the pool plus the free RAM hold (here: 2 of 4)."""
    import megatrain_hf.memory.host as memory

    args = dict(gradient_accumulation_steps=4)
    ref = tiny_model("llama", attention_dropout=0.0)
    _, ref_losses = train(ref, training_args(tmp_path / "ref", **args))
    model = tiny_model("llama", attention_dropout=0.0)
    seen = []

    def available() -> int:
        engine = engine_of(model)
        if engine is None or engine.budget.offload_bytes_per_token is None:
            return 1 << 40
        per = int(engine.budget.offload_bytes_per_token * engine.budget.microbatch_tokens)
        return memory.DEFAULT_HEADROOM_BYTES + 2 * per - engine.offload.pool_bytes

    monkeypatch.setattr(memory, "available_host_bytes", available)
    original = MegaTrainPlugin.on_step_end

    def record(self, args, state, control, **kwargs):
        seen.append(engine_of(model).budget.in_flight)
        return original(self, args, state, control, **kwargs)

    monkeypatch.setattr(MegaTrainPlugin, "on_step_end", record)
    _, losses = train(model, training_args(tmp_path / "off", **args),
                      callbacks=[MegaTrainPlugin(offload_checkpoints=True, layer_major=True)])
    assert seen[0] == 1 and set(seen[1:]) == {2}, seen
    assert_close_losses(ref_losses, losses, 1e-6)
    assert_close_params(state_of(ref), state_of(model), 5e-6)

    # check_host_memory=False: the OS under-reports (a VM whose RAM grows on use): the same
    # reading no longer shrinks the groups
    seen.clear()
    model = tiny_model("llama", attention_dropout=0.0)
    train(model, training_args(tmp_path / "trust", **args),
          callbacks=[MegaTrainPlugin(offload_checkpoints=True, layer_major=True, check_host_memory=False)])
    assert seen[0] == 1 and set(seen[1:]) == {4}, seen


def _loss(model, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).loss


def test_pool_reuses_buffers_and_gets_them_back_from_dropped_graphs():
    model = tiny_model("llama", attention_dropout=0.0)
    engine = attach(model, MegaTrainConfig(offload_checkpoints=True), device="cpu")
    pool = engine.offload
    _loss(model).backward()
    after_one = pool.pool_bytes
    assert after_one > 0
    for seed in range(1, 4):
        model.zero_grad()
        _loss(model, seed).backward()
    assert pool.pool_bytes == after_one  # steady: every step reuses the same buffers
    loss = _loss(model, 9)  # a graph that never runs backward
    assert sum(len(v) for v in pool._free.values()) == 0  # its checkpoints hold every buffer
    del loss
    gc.collect()
    assert sum(b.numel() * b.element_size() for v in pool._free.values() for _, _, b in v) == after_one
    assert pool.in_use_bytes == 0
    model.zero_grad()
    _loss(model).backward()
    assert pool.pool_bytes == after_one
    engine.detach()


def test_batches_of_other_lengths_reuse_the_pool():
    """Padded batches change length from step to step: the pool serves shorter checkpoints from
    larger buffers (best fit) and grows only when a longer batch needs more."""
    model = tiny_model("llama", attention_dropout=0.0)
    engine = attach(model, MegaTrainConfig(offload_checkpoints=True), device="cpu")
    pool = engine.offload

    def step(length: int) -> None:
        ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length))
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()

    step(32)
    longest = pool.pool_bytes
    for length in (8, 31, 17, 32, 9, 24):
        step(length)
    assert pool.pool_bytes == longest  # every shorter batch fitted in the buffers of the longest
    step(40)
    assert pool.pool_bytes > longest
    engine.detach()


def test_short_ram_unpins_free_buffers_that_are_too_small(monkeypatch):
    model = tiny_model("llama", attention_dropout=0.0)
    engine = attach(model, MegaTrainConfig(offload_checkpoints=True), device="cpu")
    pool = engine.offload
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    small = pool.pool_bytes
    freed = []
    monkeypatch.setattr(pool, "_free_flat", freed.append)
    room = pool._headroom + 9 * small // 2  # the longer batch fits only once the short buffers are gone
    monkeypatch.setattr(pool, "_available_bytes", lambda: room - pool.pool_bytes)
    long_ids = torch.randint(0, 128, (2, 32))
    model.zero_grad()
    model(input_ids=long_ids, labels=long_ids).loss.backward()
    assert len(freed) == 3 and pool.pool_bytes == 4 * small  # 3 buffers of the 4x longer batch (the head keeps its own)
    engine.detach()


def test_backward_twice_over_one_graph_is_refused():
    model = tiny_model("llama", attention_dropout=0.0)
    engine = attach(model, MegaTrainConfig(offload_checkpoints=True), device="cpu")
    loss = _loss(model)
    loss.backward(retain_graph=True)
    with pytest.raises(UsageError, match="used by a second backward over the same graph"):
        loss.backward()
    engine.detach()


def test_short_host_ram_is_refused_with_the_fix(monkeypatch):
    model = tiny_model("llama", attention_dropout=0.0)
    engine = attach(model, MegaTrainConfig(offload_checkpoints=True), device="cpu")
    monkeypatch.setattr(engine.offload, "_available_bytes", lambda: engine.offload._headroom + 100)
    with pytest.raises(HostMemoryError, match=r"checkpoints needs .* MiB more host RAM .*offload_checkpoints=False"):
        _loss(model)
    engine.detach()


def test_offload_checkpoints_must_be_a_bool():
    with pytest.raises(MegatrainConfigError, match="offload_checkpoints=.yes.; allowed: True, False, 'auto' or 'disk'"):
        MegaTrainConfig(offload_checkpoints="yes")
    with pytest.raises(MegatrainConfigError, match="allowed: True, False, 'auto' or 'disk'"):
        MegaTrainConfig(offload_checkpoints=1)  # not a bool: would silently mean off


def test_auto_offload_when_the_gpu_budget_is_short(tmp_path, monkeypatch):
    """offload_checkpoints="auto" under max_gpu_memory: the first measurement plans 2 of 4
    micro-batches with the checkpoints on the GPU (all 4 without them), so the engine offloads them,
    measures again (one, then two at a time) and then runs all 4 per group; training stays exact
    (GPU peaks simulated on the CPU)."""
    from megatrain_hf import Engine
    from transformers import Trainer
    from tests.helpers import RandomTokens

    groups = []
    original = Engine.run_layer_major
    monkeypatch.setattr(Engine, "run_layer_major", lambda self, fns: groups.append(len(fns)) or original(self, fns))
    args = dict(gradient_accumulation_steps=4, max_steps=8)
    ref = tiny_model("llama", attention_dropout=0.0)
    _, ref_losses = train(ref, training_args(tmp_path / "ref", **args))
    model = tiny_model("llama", attention_dropout=0.0)
    trainer = Trainer(model=model, args=training_args(tmp_path / "mt", **args), train_dataset=RandomTokens(),
                      callbacks=[MegaTrainPlugin(max_gpu_memory="1GiB", offload_checkpoints="auto")])
    engine = engine_of(model)
    per = 16 * 2 * 8 + 16 * 2 * 4 * 64 * (len(engine.units) - 1)
    engine.budget.budget = int((1000 + 2.5 * per) / BUDGET_MARGIN)  # 2 fit with the checkpoints kept
    # kept: each micro-batch in flight adds its checkpoints; offloaded: a tenth of that
    engine.budget.peak_source = lambda: 1000 + (engine.budget.in_flight or 1) * (per if engine.offload is None else per // 10)
    trainer.train()
    assert engine.offload is not None and engine.offload.pool_bytes > 0
    # step 1 measures (one at a time): 2 of 4 fit -> offload; measure again (1, then 2); then all 4
    assert groups == [1] * 4 + [1] * 4 + [2] * 2 + [4] * 5, groups
    assert_close_params(state_of(ref), state_of(model), 5e-6)


def test_auto_keeps_checkpoints_on_the_gpu_when_offloading_would_not_help(tmp_path, monkeypatch):
    """The growth per micro-batch is mostly not checkpoints (here 10x them, e.g. full logits):
    offloading them would not let more micro-batches in, so "auto" leaves them on the GPU."""
    from transformers import Trainer
    from tests.helpers import RandomTokens

    model = tiny_model("llama", attention_dropout=0.0)
    trainer = Trainer(model=model, args=training_args(tmp_path, gradient_accumulation_steps=4),
                      train_dataset=RandomTokens(), callbacks=[MegaTrainPlugin(max_gpu_memory="1GiB")])
    engine = engine_of(model)
    ckpt = 16 * 2 * 8 + 16 * 2 * 4 * 64 * (len(engine.units) - 1)
    engine.budget.budget = int((1000 + 25 * ckpt) / BUDGET_MARGIN)  # 2 fit; 2 would fit without checkpoints too
    engine.budget.peak_source = lambda: 1000 + (engine.budget.in_flight or 1) * 10 * ckpt
    trainer.train()
    assert engine.offload is None and engine.budget.in_flight == 2

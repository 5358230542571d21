"""Activation checkpoint homes: the device, pinned host memory, the disk tier (``offload_dir``), CPU.

Every home keeps the bytes it was given, so training through plain ``Trainer`` with the checkpoints on
the device (the GPU-equivalent home on the CPU), in host buffers, in the disk tier's file, or split
between host and disk unit by unit (a spill when the RAM is short) is bitwise the same, in
micro-batch order, layer-major and with ``checkpoint_interval``. ``checkpoint_dtype="bf16"`` rounds the
checkpoints: the same in every home, not the fp32 result, and close to it.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, engine_of
from megatrain_hf.core.checkpoint_disk import FILE_NAME
from megatrain_hf.errors import IncompatibleOptionsError
from tests.helpers import assert_same_state, state_of, tiny_model, train, training_args


def _run(tmp_path, name: str, args: dict, model_kw: dict | None = None, **plugin):
    model = tiny_model("llama", **(model_kw or {}))
    trainer, losses = train(model, training_args(tmp_path / name, **args), callbacks=[MegaTrainPlugin(**plugin)])
    return model, losses


def _disk_dir(tmp_path, name: str) -> str:
    path = tmp_path / f"disk-{name}"
    path.mkdir()
    return str(path)


@pytest.mark.parametrize("layer_major", [False, True], ids=["microbatch-order", "layer-major"])
def test_device_host_and_disk_homes_train_bit_for_bit_alike(tmp_path, layer_major):
    args = dict(gradient_accumulation_steps=2, max_steps=4)
    kw = {"attention_dropout": 0.0} if layer_major else {}
    ref, ref_losses = _run(tmp_path, "device", args, kw, offload_checkpoints=False)
    host, host_losses = _run(tmp_path, "host", args, kw, offload_checkpoints=True)
    disk_dir = _disk_dir(tmp_path, "d")
    disk, disk_losses = _run(tmp_path, "disk", args, kw, offload_checkpoints="disk", offload_dir=disk_dir)
    assert host_losses == ref_losses and disk_losses == ref_losses
    assert_same_state(state_of(ref), state_of(host))
    assert_same_state(state_of(ref), state_of(disk))
    pool = engine_of(disk).offload
    assert pool.bytes_written > 0 and pool.bytes_read == pool.bytes_written  # every checkpoint went and came back
    assert pool.pool_bytes <= 3 * max(pool.bytes_written // 12, 4096) * 4  # staging slots, not the depth
    run_dir = pool.run_dir
    assert os.path.exists(os.path.join(run_dir, FILE_NAME))
    engine_of(disk).detach()
    assert not os.path.exists(run_dir)  # the run's directory goes with the engine


def test_disk_home_with_checkpoint_interval(tmp_path):
    args = dict(gradient_accumulation_steps=1, max_steps=3)
    kw = dict(num_hidden_layers=4)
    ref, ref_losses = _run(tmp_path, "device", args, kw, checkpoint_interval=2)
    disk, losses = _run(tmp_path, "disk", args, kw, checkpoint_interval=2, offload_checkpoints="disk",
                        offload_dir=_disk_dir(tmp_path, "d"))
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(disk))


def test_host_checkpoints_spill_to_disk_unit_by_unit_when_ram_is_short(tmp_path, monkeypatch):
    """The pinned pool takes two checkpoints; the RAM has no more, so the others go to the disk tier."""
    import megatrain_hf.memory.host as memory

    args = dict(gradient_accumulation_steps=1, max_steps=3)
    kw = dict(num_hidden_layers=4)
    ref, ref_losses = _run(tmp_path, "device", args, kw)
    holder = {}

    def available() -> int:
        engine = engine_of(holder["model"]) if "model" in holder else None
        if engine is None or engine.offload is None:
            return 1 << 40
        ckpt = 2 * 16 * 64 * 4  # micro-batch 2 x 16 tokens x hidden 64, fp32
        return memory.DEFAULT_HEADROOM_BYTES + 2 * ckpt - engine.offload.pool_bytes

    monkeypatch.setattr(memory, "available_host_bytes", available)
    model = tiny_model("llama", **kw)
    holder["model"] = model
    _, losses = train(model, training_args(tmp_path / "spill", **args),
                      callbacks=[MegaTrainPlugin(offload_checkpoints=True, offload_dir=_disk_dir(tmp_path, "s"))])
    engine = engine_of(model)
    assert engine.checkpoint_homes.disk_file is not None and engine.checkpoint_homes.disk_file.bytes_written > 0
    assert 0 < engine.offload.pool_bytes <= 2 * 2 * 16 * 64 * 4
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(model))


def test_bf16_checkpoints_are_the_same_in_every_home_and_close_to_fp32(tmp_path):
    args = dict(gradient_accumulation_steps=1, max_steps=4, bf16=True)
    ref, ref_losses = _run(tmp_path, "fp32", args)
    dev, dev_losses = _run(tmp_path, "device", args, checkpoint_dtype="bf16")
    host, host_losses = _run(tmp_path, "host", args, checkpoint_dtype="bf16", offload_checkpoints=True)
    disk, disk_losses = _run(tmp_path, "disk", args, checkpoint_dtype="bf16", offload_checkpoints="disk",
                             offload_dir=_disk_dir(tmp_path, "d"))
    assert dev_losses == host_losses == disk_losses
    assert_same_state(state_of(dev), state_of(host))
    assert_same_state(state_of(dev), state_of(disk))
    assert dev_losses[0] == ref_losses[0]  # the forward does not read the checkpoints
    assert any(not torch.equal(a, b) for a, b in zip(state_of(ref).values(), state_of(dev).values()))  # rounded
    assert max(abs(a - b) for a, b in zip(ref_losses, dev_losses)) < 5e-2
    assert engine_of(disk).offload.bytes_written < 2 * 16 * 64 * 4 * 4 // 2 + 4096 * 4 * 4  # half the fp32 bytes


def test_disk_checkpoints_need_an_offload_dir_and_bf16_needs_bf16_compute(tmp_path):
    with pytest.raises(IncompatibleOptionsError, match="offload_dir is not set. Fix"):
        _run(tmp_path, "nodir", dict(max_steps=1), offload_checkpoints="disk")
    with pytest.raises(IncompatibleOptionsError, match="checkpoint_dtype='bf16'.*compute is fp32"):
        _run(tmp_path, "fp32", dict(max_steps=1), checkpoint_dtype="bf16")
    assert MegaTrainConfig(checkpoint_dtype="bf16").checkpoint_dtype == "bf16"

"""On a CUDA GPU: activation checkpoints on the disk tier (``offload_checkpoints="disk"``) and spilled
from the pinned host pool, against checkpoints kept on the GPU, with transfer-bound shapes (narrow
layers, many tokens: a missing wait on the offload stream or the writer thread changes the numbers).

Runs under ``torch.use_deterministic_algorithms`` so the homes can be compared bitwise."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import RandomTokens, state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainPlugin, engine_of

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

SHAPE = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=256, max_position_embeddings=256, attention_dropout=0.0)


@pytest.fixture(autouse=True)
def deterministic(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def _run(tmp_path, name, **plugin):
    model = tiny_model("llama", **SHAPE)
    args = training_args(tmp_path / name, use_cpu=False, max_steps=3, per_device_train_batch_size=32,
                         gradient_accumulation_steps=2, bf16=plugin.get("checkpoint_dtype") == "bf16")
    _, losses = train(model, args, dataset=RandomTokens(n=384, seq=256, vocab=256),
                      callbacks=[MegaTrainPlugin(**plugin)])
    return model, losses


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_disk_and_spilled_checkpoints_match_the_gpu_home(tmp_path, dtype):
    bf16 = {"checkpoint_dtype": "bf16"} if dtype == "bf16" else {}
    ref, ref_losses = _run(tmp_path, "gpu", **bf16)
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    disk, disk_losses = _run(tmp_path, "disk", offload_checkpoints="disk", offload_dir=str(disk_dir), **bf16)
    pool = engine_of(disk).offload
    assert pool.bytes_written > 0 and pool.bytes_read == pool.bytes_written
    host, host_losses = _run(tmp_path, "host", offload_checkpoints=True, offload_dir=str(disk_dir), **bf16)
    assert disk_losses == ref_losses and host_losses == ref_losses
    for other in (disk, host):
        got = state_of(other)
        for n, t in state_of(ref).items():
            assert torch.equal(t, got[n]), n
    engine_of(disk).detach()
    assert not os.listdir(disk_dir)

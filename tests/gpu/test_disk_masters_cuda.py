"""On a CUDA GPU: the fp32 masters on disk (``offload_state="all"``) against the same run in RAM.

The device streams the pinned bf16 staging copy and the pinned fp32 tail (norms, embedding) either
way; only where the update's masters live differs. GPU kernels are not bitwise reproducible run to run
(atomics in the embedding backward), so losses and updates are compared with the bf16 tolerances of
``test_cuda_parity.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import GPU_SHAPE, RandomTokens, assert_close_losses, state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, engine_of

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

SHAPE = GPU_SHAPE


def test_bf16_masters_on_disk_match_the_in_ram_run(tmp_path):
    data = RandomTokens(n=64, seq=128, vocab=SHAPE["vocab_size"])
    (tmp_path / "disk").mkdir()
    runs, init = {}, state_of(tiny_model("llama", **SHAPE))
    for name, options in (("ram", {}), ("all", dict(offload_dir=str(tmp_path / "disk"), offload_state="all"))):
        model = tiny_model("llama", **SHAPE)
        trainer, losses = train(model, training_args(tmp_path / name, use_cpu=False, bf16=True,
                                                     gradient_accumulation_steps=4), dataset=data,
                                callbacks=[MegaTrainPlugin(MegaTrainConfig(**options))])
        runs[name] = (losses, state_of(model), trainer)
    optimizer = runs["all"][2].optimizer.optimizer
    store = optimizer.store
    assert optimizer.master_units and store.pin and engine_of(runs["all"][2].model).device.type == "cuda"
    assert all(store.buffers[u].master_host is None and store.buffers[u].master_paged is not None
               for u in optimizer.master_units)
    assert optimizer.disk_tier is store.tier_files.pager  # the files made while the model attached
    assert_close_losses(runs["ram"][0], runs["all"][0], 2e-2)
    for n, p in runs["ram"][1].items():  # each tensor's whole update, relative to its size (as test_cuda_parity)
        ref, got = p - init[n], runs["all"][1][n] - init[n]
        assert (got - ref).norm() <= 0.05 * ref.norm() + 1e-12, n

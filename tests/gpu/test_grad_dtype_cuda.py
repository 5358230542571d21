"""On a CUDA GPU: bf16 gradient accumulators (``grad_dtype="bf16"``) against fp32 ones.

The gradients cross the link in bf16 and land in pinned bf16 flats; the norms for clipping still come
from their fp32 casts on the device. GPU kernels are not bitwise reproducible run to run (atomics in the
embedding backward), so the comparison uses ``test_cuda_parity.py``'s bf16 tolerances.
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


def test_bf16_gradient_accumulators_match_fp32_ones(tmp_path):
    data = RandomTokens(n=64, seq=128, vocab=SHAPE["vocab_size"])
    runs, init = {}, state_of(tiny_model("llama", **SHAPE))
    for name in ("fp32", "bf16"):
        model = tiny_model("llama", **SHAPE)
        trainer, losses = train(model, training_args(tmp_path / name, use_cpu=False, bf16=True,
                                                     gradient_accumulation_steps=1, per_device_train_batch_size=4),
                                dataset=data, callbacks=[MegaTrainPlugin(MegaTrainConfig(grad_dtype=name))])
        engine = engine_of(trainer.model)
        runs[name] = (losses, state_of(model), engine.store)
    store = runs["bf16"][2]
    low = store.accumulators.low_entries()
    registered = {id(t) for t in store._registered}  # the flats the store pinned (cudaHostRegister)
    assert store.pin and low and all(id(store.buffers[e.owner].grad_low) in registered for e in low)
    assert all(store.accumulators.region(e).dtype == torch.bfloat16 for e in low)
    assert_close_losses(runs["fp32"][0], runs["bf16"][0], 2e-2)
    for n, p in runs["fp32"][1].items():
        ref, got = p - init[n], runs["bf16"][1][n] - init[n]
        assert (got - ref).norm() <= 0.05 * ref.norm() + 1e-12, n

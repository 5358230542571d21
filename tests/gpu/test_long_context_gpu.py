"""On a CUDA GPU, bf16: sequence-tiled MLP and checkpoint_interval against the untiled megatrain run.

Marked `gpu` (skipped without CUDA). Tolerance: tiling changes only where the MLP's tokens are
split (per-token math) and sums the weights' gradients over tiles in fp32 instead of in one
matmul's accumulator, so the difference is bf16 rounding: losses within 2e-2 (as the bf16 parity
tests), each tensor's whole update within 5% of its norm. Differences are appended to
$MEGATRAIN_GPU_REPORT (JSON lines) when set.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import RandomTokens, assert_close_losses, state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainPlugin, engine_of

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from test_cuda_parity import BF16_LOSS_ATOL, BF16_UPDATE_RTOL, _report, assert_close_updates  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=1024, max_position_embeddings=2048, attention_dropout=0.0)


def _run(path, family, **options):
    model = tiny_model(family, **SHAPE)
    init = state_of(model)
    data = RandomTokens(n=16, seq=1024, vocab=SHAPE["vocab_size"])
    _, losses = train(model, training_args(path, use_cpu=False, bf16=True, max_steps=4), dataset=data,
                      callbacks=[MegaTrainPlugin(**options)])
    assert engine_of(model).device.type == "cuda"
    return init, losses, state_of(model)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("options", [dict(sequence_tile_tokens=300), dict(checkpoint_interval=3),
                                     dict(sequence_tile_tokens=300, checkpoint_interval=2, offload_checkpoints=True)])
def test_tiled_and_interval_bf16(tmp_path, family, options):
    init, ref_losses, ref_state = _run(tmp_path / "ref", family, sequence_tile_tokens=None)
    _, losses, state = _run(tmp_path / "mt", family, **options)
    _report(f"longctx_{family}_{'_'.join(f'{k}={v}' for k, v in options.items())}", ref_losses, losses, ref_state,
            state)
    assert_close_losses(ref_losses, losses, BF16_LOSS_ATOL)
    assert_close_updates(init, ref_state, state, BF16_UPDATE_RTOL)

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

from tests.gpu.test_cuda_parity import BF16_LOSS_ATOL, BF16_UPDATE_RTOL, _report, assert_close_updates  # noqa: E402

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


@pytest.mark.parametrize("attention", ["sdpa", "flash_attention_2"])
def test_long_sequence_memory_within_the_plan(attention):
    """One 32K-token sequence in bf16 through SDPA's flash backend (or flash-attn when installed), every
    decoder layer tiled whole: the GPU peak of the forward and backward stays within the plan's
    per-layer working set, checkpoints and logits chunk (memory/activations.py), with 256 MiB for
    the weights, their gradients and the allocator's rounding."""
    import importlib.util

    from megatrain_hf import MegaTrainConfig, attach
    from megatrain_hf.memory import activations

    if attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    seq, tile = 32768, 4096
    shape = {**SHAPE, "max_position_embeddings": seq}
    model = tiny_model("llama", **shape, attn_implementation=attention)
    engine = attach(model, MegaTrainConfig(sequence_tile_tokens=tile), device="cuda", bf16=True)
    ids = torch.randint(0, shape["vocab_size"], (1, seq), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    h, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    q_dim, kv_dim = h, h // heads * kv_heads
    layers, vocab = shape["num_hidden_layers"], shape["vocab_size"]
    planned = (activations.layer_working_set(seq, h, q_dim, kv_dim, shape["intermediate_size"], 2, tile)
               + activations.checkpoint_bytes(seq, h, layers)
               + min(seq, 2**26 // vocab) * vocab * 14 + 256 * 2**20)
    assert engine.stats.tiled_layer_calls == 2 * layers  # forward and recompute of every layer, tiled whole
    assert peak <= planned, f"GPU peak {peak / 2**20:.0f} MiB above the plan's {planned / 2**20:.0f} MiB"
    engine.detach()

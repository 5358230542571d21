"""Issue 34: a streamed decoder layer's measured CPU peak stays within the plan's per-layer working set.

torch's memory profiler (``bench/cpu_memory.streamed_layer_peak``) on one fp32 training step of a
small GQA Llama attached with megatrain on the CPU, every per-token op of each layer tiled; the plan's
``memory/activations.layer_working_set`` and ``long_context_working_set`` for the same shape, length and
tile. The curve at 4K-64K: ``scripts/longctx_memory.py``, docs/long-context.md.
"""

from __future__ import annotations

import pytest
import torch

from megatrain_hf import MegaTrainConfig, attach
from megatrain_hf.bench.cpu_memory import streamed_layer_peak
from megatrain_hf.memory import activations
from tests.helpers import tiny_model

SHAPE = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, attention_dropout=0.0)


def _measure(seq: int, tile: int | None, owned: bool = True) -> tuple[int, int]:
    """(layer peak, tiled layer calls); ``owned=False``: as when a hook may hold the incoming gradient
    (``runtime/grad_ownership.py``), the layers never write into it."""
    model = tiny_model("llama", **SHAPE, max_position_embeddings=seq)
    engine = attach(model, MegaTrainConfig(sequence_tile_tokens=tile, chunked_loss=True), device="cpu")
    engine.runner.ownership.enabled = owned
    ids = torch.randint(0, SHAPE["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids[:, :512], labels=ids[:, :512]).loss.backward()  # first-call state
    model.zero_grad()
    calls = engine.stats.tiled_layer_calls
    _, layer_peak, _ = streamed_layer_peak(lambda: model(input_ids=ids, labels=ids).loss.backward(),
                                           SHAPE["num_hidden_layers"], seq, SHAPE["hidden_size"])
    tiled = engine.stats.tiled_layer_calls - calls
    engine.detach()
    return layer_peak, tiled


@pytest.mark.slow
@pytest.mark.parametrize("seq", [2048])
def test_tiled_layer_peak_within_the_plan(seq):
    tile = 512
    h, heads, kv_heads = SHAPE["hidden_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    q_dim, kv_dim, inter = h, h // heads * kv_heads, SHAPE["intermediate_size"]
    measured, tiled = _measure(seq, tile)
    assert tiled == 2 * SHAPE["num_hidden_layers"]  # forward and recompute of each layer tiled whole
    plan = activations.layer_working_set(seq, h, q_dim, kv_dim, inter, 4, tile)
    joint = activations.long_context_working_set(seq, h, q_dim, kv_dim, inter, 4, tile)
    assert measured <= plan, f"layer peak {measured} B above the plan's {plan} B"
    assert measured + seq * h * 4 <= joint, f"layer peak + input {measured + seq * h * 4} B above {joint} B"
    # and without the plan's fp32 dq accumulator (``4 q`` per token, FlashAttention's backward on the GPU), which
    # the CPU kernel does not allocate: 0.88 here (against the plan of their time: 0.89 while the output's storage
    # took the input's gradient, 0.96 while each tiled piece had its own input-gradient buffer)
    assert measured + seq * h * 4 <= joint - seq * 4 * q_dim, (measured + seq * h * 4, joint - seq * 4 * q_dim)
    # the incoming gradient taking the input's gradient (the recomputed output freed) saves one fp32 tokens x h;
    # where it cannot (a hook may hold the gradient) the CPU peak stays within both plans, on the dq slack (0.74,
    # 0.89; 0.96 of the joint plan less the dq accumulator: on a GPU, one fp32 tokens x h over it)
    unowned, _ = _measure(seq, tile, owned=False)
    assert unowned - measured == seq * h * 4, (unowned, measured)
    assert unowned <= plan and unowned + seq * h * 4 <= joint
    # the measurement sees what the tiling saves: untiled, the MLP's tokens x intermediate tensors
    # of every token take the layer past the tiled plan
    untiled, _ = _measure(seq, None)
    assert untiled > plan, (untiled, plan)
    assert untiled <= activations.layer_working_set(seq, h, q_dim, kv_dim, inter, 4, None)

"""core/layout.py on its own: the flat layout, the wire dtype rule, the loss chunk; and the host tiers of a layout
(memory/host_tiers.py)."""

from __future__ import annotations

import pytest
import torch

from megatrain_hf.core.layout import (
    ALIGN_ELEMS,
    LOSS_CHUNK_ELEMENTS,
    TensorSpec,
    UnitSizes,
    aligned,
    lay_out,
    loss_chunk_tokens,
    wire_dtype,
)
from megatrain_hf.memory.host_tiers import host_tiers

BF16, FP32 = torch.bfloat16, torch.float32


def _ranges_disjoint(specs: list[TensorSpec]) -> bool:
    spans = sorted((s.offset, s.offset + s.numel) for s in specs)
    return all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_aligned_rounds_up_to_16_elements():
    assert ALIGN_ELEMS == 16
    assert [aligned(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 16, 16, 16, 32, 32, 48]


def test_staged_tensors_come_first_then_fp32_each_aligned():
    specs = [
        TensorSpec(5, True, FP32),  # a norm weight: fp32 wire
        TensorSpec(40, True, BF16),  # a matrix: compute-dtype wire
        TensorSpec(17, True, FP32),
        TensorSpec(16, True, BF16),
    ]
    sizes = lay_out(specs)
    # staged ones first, in their order: 40 -> 48, then 16
    assert specs[1].offset == 0 and specs[3].offset == 48
    assert sizes.n_staged == 64
    # then the fp32 ones, in their order
    assert specs[0].offset == 64 and specs[2].offset == 80
    assert sizes.n_train == 80 + 32
    assert all(s.offset % ALIGN_ELEMS == 0 for s in specs)
    assert _ranges_disjoint(specs)
    assert sizes.frozen == {}


def test_frozen_tensors_get_one_flat_per_wire_dtype():
    specs = [
        TensorSpec(10, False, BF16),
        TensorSpec(3, True, FP32),
        TensorSpec(20, False, FP32),
        TensorSpec(33, False, BF16),
        TensorSpec(4, False, torch.int64),
    ]
    sizes = lay_out(specs)
    assert sizes.frozen == {BF16: 16 + 48, FP32: 32, torch.int64: 16}
    assert specs[0].offset == 0 and specs[3].offset == 16  # bf16 flat, in order
    assert specs[2].offset == 0  # its own fp32 frozen flat, not after the trainable one
    assert specs[4].offset == 0
    # the trainable flat holds only the trainable tensor
    assert specs[1].offset == 0 and sizes.n_train == 16 and sizes.n_staged == 0


def test_empty_unit_has_empty_flats():
    sizes = lay_out([])
    assert (sizes.n_train, sizes.n_staged, sizes.frozen) == (0, 0, {})


@pytest.mark.parametrize("compute", [BF16, torch.float16, FP32])
def test_wire_dtype_rule(compute):
    # matrices: the compute dtype
    assert wire_dtype(FP32, 2, compute, embedding=False, name="mlp.up_proj.weight") == compute
    assert wire_dtype(FP32, 4, compute, embedding=False, name="conv.weight") == compute
    # vectors (norms, biases), embedding tables, LoRA matrices: fp32
    assert wire_dtype(FP32, 1, compute, embedding=False, name="input_layernorm.weight") == FP32
    assert wire_dtype(FP32, 0, compute, embedding=False, name="scale") == FP32
    assert wire_dtype(FP32, 2, compute, embedding=True, name="weight") == FP32
    assert wire_dtype(FP32, 2, compute, embedding=False, name="q_proj.lora_A.default.weight") == FP32
    assert wire_dtype(FP32, 2, compute, embedding=False, name="lora_B.default.weight") == FP32
    # a name that merely contains "lora" is a matrix like any other
    assert wire_dtype(FP32, 2, compute, embedding=False, name="flora_proj.weight") == compute
    # a bf16 vector is sent in fp32 too (it is computed with in fp32)
    assert wire_dtype(BF16, 1, compute, embedding=False, name="bias") == FP32


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_wire_dtype_keeps_integer_tensors(dtype):
    for ndim in (0, 1, 2):
        for embedding in (False, True):
            assert wire_dtype(dtype, ndim, BF16, embedding=embedding, name="ids") == dtype


def test_host_tiers_counts_every_flat():
    units = [
        UnitSizes(n_train=64, n_staged=48, frozen={BF16: 32}),
        UnitSizes(n_train=16, n_staged=0, frozen={FP32: 16, torch.int64: 16}),
    ]
    tiers = host_tiers(units, BF16, staging=True)
    assert tiers == {
        "master": 4 * 80,
        "grad": 4 * 80,
        "exp_avg": 4 * 80,
        "exp_avg_sq": 4 * 80,
        "staging": 2 * 48,
        "frozen": 2 * 32 + 4 * 16 + 8 * 16,
    }
    assert host_tiers(units, BF16, staging=False)["staging"] == 0
    assert host_tiers(units, FP32, staging=True)["staging"] == 0  # fp32 compute never stages
    assert host_tiers(units, torch.float16, staging=True)["staging"] == 2 * 48
    no_state = host_tiers(units, BF16, staging=True, optimizer_state=False)
    assert no_state["exp_avg"] == no_state["exp_avg_sq"] == 0 and no_state["master"] == 320


def test_host_tiers_match_lay_out_of_real_specs():
    """The planner's count from specs equals the bytes of flats of exactly those sizes."""
    specs = [TensorSpec(100, True, BF16), TensorSpec(7, True, FP32), TensorSpec(9, False, BF16)]
    sizes = lay_out(specs)
    tiers = host_tiers([sizes], BF16, staging=True)
    master = torch.empty(sizes.n_train, dtype=FP32)
    staging = torch.empty(sizes.n_staged, dtype=BF16)
    frozen = torch.empty(sizes.frozen[BF16], dtype=BF16)
    assert tiers["master"] == master.numel() * master.element_size()
    assert tiers["staging"] == staging.numel() * staging.element_size()
    assert tiers["frozen"] == frozen.numel() * frozen.element_size()


def test_loss_chunk_tokens():
    assert loss_chunk_tokens(123, vocab=50_000) == 123  # configured wins
    assert loss_chunk_tokens(None, vocab=1 << 16) == LOSS_CHUNK_ELEMENTS >> 16
    assert loss_chunk_tokens(None, vocab=151_936) == LOSS_CHUNK_ELEMENTS // 151_936
    # about LOSS_CHUNK_ELEMENTS logits per chunk
    t = loss_chunk_tokens(None, vocab=32_000)
    assert t * 32_000 <= LOSS_CHUNK_ELEMENTS < (t + 1) * 32_000
    # never zero tokens, whatever the vocabulary
    assert loss_chunk_tokens(None, vocab=LOSS_CHUNK_ELEMENTS * 4) == 1
    assert loss_chunk_tokens(None, vocab=0) == LOSS_CHUNK_ELEMENTS

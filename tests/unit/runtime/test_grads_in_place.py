"""Gradients computed in their host accumulators on the CPU path (``runtime/grads_in_place.py``)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers import tiny_model
from torch.profiler import ProfilerActivity, profile

from megatrain_hf import MegaTrainConfig, attach
from megatrain_hf.runtime import grads_in_place as landing, streamed_call


def _ids(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (2, 16), generator=g)  # few distinct tokens: rows summed many times
    ids[:, ::5] = 0  # the padding token (pad_token_id=0: the padding row gets no gradient)
    ids[0, 3] = vocab - 1
    return ids


def _config(chunk: int | None) -> MegaTrainConfig:
    """chunk 0: HF's own loss from full logits; else the chunked loss, None: in one chunk."""
    if chunk == 0:
        return MegaTrainConfig(chunked_loss=False)
    return MegaTrainConfig(chunked_loss=True, loss_chunk_tokens=chunk)


def _grads(monkeypatch, *, land: bool, bf16: bool, tied: bool, chunk: int | None = None,
           microbatches: int = 2) -> dict[str, torch.Tensor]:
    if not land:
        monkeypatch.setattr(streamed_call, "landing_regions", lambda *a: {})
    model = tiny_model("llama", tie_word_embeddings=tied)
    model.model.embed_tokens.padding_idx = 0  # as nn.Embedding(..., padding_idx=0) has it
    engine = attach(model, _config(chunk), device="cpu", bf16=bf16)
    for i in range(microbatches):  # the second finds .grad set: autograd's temporary, added
        ids = _ids(model.config.vocab_size, i)
        model(input_ids=ids, labels=ids).loss.backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine.detach()
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [0, None, 5])  # full logits; the chunked loss in one chunk, in chunks of 5 tokens
def test_gradients_computed_in_place_are_autograds_bit_for_bit(monkeypatch, bf16, tied, chunk):
    with_landing = _grads(monkeypatch, land=True, bf16=bf16, tied=tied, chunk=chunk)
    without = _grads(monkeypatch, land=False, bf16=bf16, tied=tied, chunk=chunk)
    assert with_landing.keys() == without.keys()
    for name, g in with_landing.items():
        assert torch.equal(g, without[name]), name
    assert with_landing["model.embed_tokens.weight"][0].eq(0).all() or tied  # the padding row


def test_the_embedding_gradient_is_computed_like_embedding_dense_backward():
    torch.manual_seed(0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for pad in (-1, 0, 3):
            ids = torch.randint(0, 9, (3, 200))
            grad = torch.randn(3, 200, 33) * torch.logspace(-3, 3, 200)[None, :, None]
            weight = torch.randn(50, 33, requires_grad=True)
            region = torch.full((50, 33), float("nan"))  # whatever the accumulator held before
            with landing.embeddings_into({"weight": weight}, {"weight": region}):
                out = torch.nn.functional.embedding(ids, weight, None if pad < 0 else pad)
            (g,) = torch.autograd.grad(out, [weight], grad)
            assert g.data_ptr() == region.data_ptr()  # the region itself is the gradient
            assert torch.equal(g, torch.ops.aten.embedding_dense_backward(grad, ids, 50, pad, False))
    torch.set_num_threads(1)


@pytest.mark.parametrize("bf16", [False, True])
def test_no_temporary_of_the_tables_size_on_the_cpu_path(bf16):
    """The embedding's gradient and the head's sum are computed in the accumulators (fp32: the head's
    product itself; bf16: its bf16 gradient, half the fp32 bytes, copied in), so no allocation of
    backward reaches the size of a table's fp32 gradient."""
    vocab, hidden = 4096, 64
    model = tiny_model("llama", vocab_size=vocab, tie_word_embeddings=False)
    engine = attach(model, _config(None), device="cpu", bf16=bf16)
    ids = _ids(vocab, 0)
    loss = model(input_ids=ids, labels=ids).loss
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    table = vocab * hidden * 4
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert 0 < largest < table, (largest, table)
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    assert head.grad.abs().sum() > 0 and embed.grad.abs().sum() > 0
    assert head.grad.data_ptr() == engine.store.accumulators.region(engine.store.home_of(head)[1]).data_ptr()
    engine.detach()

"""The chunked head + cross-entropy (megatrain_hf/loss.py) against HF's full-logits loss (CPU, fp32).

One chunk performs HF's operations exactly (bitwise); several chunks add the per-chunk sums in
another order (loss within ~1e-6, gradients within ~1e-7). Under plain Trainer it is on by
default; a Trainer subclass keeps HF's loss (it may read the logits).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    FAMILY_CONFIGS,
    RandomTokens,
    assert_close_losses,
    assert_close_params,
    state_of,
    tiny_model,
    train,
    training_args,
)
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, attach, engine_of
from megatrain_hf.models.families import FAMILIES
from megatrain_hf.errors import MegatrainConfigError
from transformers import Trainer


def _batch(n: int = 4) -> dict:
    data = RandomTokens(n=n)
    batch = {k: torch.stack([data[i][k] for i in range(n)]) for k in data[0]}
    batch["labels"][0, :5] = -100  # a prompt that is not trained on
    return batch


CHUNKED = sorted(f for f in FAMILY_CONFIGS if FAMILIES[f].chunked_loss)
UNCHUNKED = sorted(f for f in FAMILY_CONFIGS if not FAMILIES[f].chunked_loss)


@pytest.mark.parametrize("family", CHUNKED)
@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("num_items", [None, 40])
def test_matches_hf_loss_and_gradients(family, chunk, num_items):
    batch = _batch()
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    ref = tiny_model(family, attention_dropout=0.0)
    ref_loss = ref(**batch, **extra).loss
    ref_loss.backward()
    model = tiny_model(family, attention_dropout=0.0)
    engine = attach(model, MegaTrainConfig(chunked_loss=True, loss_chunk_tokens=chunk), device="cpu")
    out = model(**batch, **extra)
    assert out.logits is None  # never materialised
    out.loss.backward()
    engine.synchronize()
    pairs = list(zip(ref.named_parameters(), model.named_parameters()))
    if chunk is None:  # one chunk: HF's operations exactly
        assert torch.equal(ref_loss, out.loss)
        for (name, p), (_, q) in pairs:
            assert torch.equal(p.grad, q.grad), name
    else:  # 64 tokens in chunks of 7
        assert abs(ref_loss.item() - out.loss.item()) < 2e-6
        for (name, p), (_, q) in pairs:
            torch.testing.assert_close(q.grad, p.grad, atol=1e-7, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family", UNCHUNKED)
def test_families_with_other_logits_keep_hf_loss(family, caplog):
    """Scaled logits (Granite, Cohere) and the MoE auxiliary loss are not the chunked loss's
    arithmetic: asked for it, the engine says so and HF computes the loss, exactly."""
    batch = _batch()
    ref = tiny_model(family, attention_dropout=0.0)
    ref_loss = ref(**batch).loss
    model = tiny_model(family, attention_dropout=0.0)
    with caplog.at_level("WARNING", logger="megatrain_hf"):
        engine = attach(model, MegaTrainConfig(chunked_loss=True), device="cpu")
    assert "is not known to compute its logits as lm_head(hidden)" in caplog.text
    assert not engine.chunked_loss_installed
    out = model(**batch)
    assert out.logits is not None and torch.equal(out.loss, ref_loss)


def test_eval_generate_and_unlabelled_forwards_keep_logits():
    batch = _batch()
    model = tiny_model("llama")
    attach(model, MegaTrainConfig(chunked_loss=True), device="cpu")
    assert model(input_ids=batch["input_ids"]).logits.shape == (4, 16, 128)  # no labels
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    assert out.logits is not None and out.loss is not None
    model.train()
    with torch.no_grad():
        assert model(**batch).logits is not None  # no gradients: HF's own forward


def test_all_labels_ignored_gives_nan_like_hf():
    batch = _batch()
    batch["labels"][:] = -100
    ref = tiny_model("llama")
    model = tiny_model("llama")
    attach(model, MegaTrainConfig(chunked_loss=True), device="cpu")
    assert torch.isnan(ref(**batch).loss) and torch.isnan(model(**batch).loss)


@pytest.mark.parametrize("chunk", [None, 5])
def test_trainer_parity_with_layer_major(tmp_path, chunk):
    args = dict(gradient_accumulation_steps=3)
    ref_model = tiny_model("gemma2", attention_dropout=0.0)
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref", **args))
    model = tiny_model("gemma2", attention_dropout=0.0)
    trainer, losses = train(model, training_args(tmp_path / "mt", **args),
                            callbacks=[MegaTrainPlugin(loss_chunk_tokens=chunk)])
    assert engine_of(model).chunked_loss_active  # plain Trainer: on by default
    assert_close_losses(ref_losses, losses, 2e-6)
    assert_close_params(state_of(ref_model), state_of(model), 5e-6)


class _Subclass(Trainer):
    pass


def test_off_for_trainer_subclasses_and_when_disabled(tmp_path):
    model = tiny_model("llama")
    _Subclass(model=model, args=training_args(tmp_path / "a"), train_dataset=RandomTokens(),
              callbacks=[MegaTrainPlugin()])
    assert not engine_of(model).chunked_loss_active  # a subclass may read outputs.logits
    model = tiny_model("llama")
    Trainer(model=model, args=training_args(tmp_path / "b"), train_dataset=RandomTokens(),
            callbacks=[MegaTrainPlugin(chunked_loss=False)])
    assert not engine_of(model).chunked_loss_active
    assert "forward" not in vars(model)  # not even installed


def test_lora_on_the_head_keeps_hf_loss(caplog):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with caplog.at_level("WARNING", logger="megatrain_hf.engine"):
        engine = attach(model, MegaTrainConfig(chunked_loss=True), device="cpu")
    assert "not an nn.Linear" in caplog.text and not engine.chunked_loss_active
    batch = _batch()
    assert model(**batch).logits is not None


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_config_rejects_bad_chunk(bad):
    with pytest.raises(MegatrainConfigError, match=r"loss_chunk_tokens=.*None \(automatic\) or an int >= 1"):
        MegaTrainConfig(loss_chunk_tokens=bad)
    with pytest.raises(MegatrainConfigError, match=r"chunked_loss='yes'; allowed: True, False or 'auto'"):
        MegaTrainConfig(chunked_loss="yes")


def test_unknown_logit_post_processing_keeps_hf_loss(monkeypatch, caplog):
    """A family not known to compute logits as lm_head(hidden) [+ soft-capping] keeps HF's loss
    (register_family(..., chunked_loss=False) is the default for new families)."""
    import dataclasses

    from megatrain_hf.models import families

    monkeypatch.setitem(families.FAMILIES, "llama", dataclasses.replace(families.FAMILIES["llama"], chunked_loss=False))
    model = tiny_model("llama")
    with caplog.at_level("WARNING", logger="megatrain_hf.engine"):
        engine = attach(model, MegaTrainConfig(chunked_loss=True), device="cpu")
    assert not engine.chunked_loss_active and "not known to compute its logits" in caplog.text
    assert model(**_batch()).logits is not None


def test_chunked_loss_peak_is_bounded_by_the_chunk():
    """Forward + backward of the head kernel: the CPU tensor peak (torch's memory profiler) stays
    within a few chunks' logits whatever the token count, far below the full logits, which one
    chunk of every token does reach."""
    from megatrain_hf.bench.cpu_memory import peak_tensor_bytes
    from megatrain_hf.models.chunked_loss import ChunkedLMLoss

    hidden, vocab, chunk = 32, 4096, 256
    weight = (torch.randn(vocab, hidden) * 0.05).requires_grad_()

    def peak(tokens: int, chunk_tokens: int) -> int:
        x = torch.randn(tokens, hidden, requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,))
        kernel = ChunkedLMLoss(labels=labels, denominator=None, ignore_index=-100, softcap=None,
                               chunk_tokens=chunk_tokens)

        def step():
            with torch.no_grad():
                kernel.forward(x, {"weight": weight})
            kernel.backward(x, {"weight": weight}, ["weight"], torch.ones(()))

        return peak_tensor_bytes(step)

    chunk_logits = chunk * vocab * 4
    fixed = 2 * 8192 * hidden * 4 + 2 * vocab * hidden * 4  # grad of the hidden states, the weight's sum
    short, long = peak(2048, chunk), peak(8192, chunk)
    assert long <= fixed + 4 * chunk_logits, (long, chunk_logits)
    assert long - short <= 3 * 8192 * hidden * 4  # grows with the hidden states only, not the logits
    assert peak(8192, 8192) >= 8192 * vocab * 4  # unchunked: the full fp32 logits exist

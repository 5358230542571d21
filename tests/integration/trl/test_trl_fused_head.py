"""TRL's fused LM head (trl >= 1) served in the engine's head unit (``integrations/trl.py``), CPU, fp32.

Against the same model with TRL's own fused forward: per-token outputs and every gradient equal
bitwise, also when a loss uses the entropy (GRPO's entropy term) and when the head is frozen;
``generate`` still sees the forward's signature; forms megatrain does not know are refused.
The Trainer-level test (SFTTrainer, the update slowed down) is in ``test_layer_major.py``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.helpers import RandomTokens, tiny_model
from megatrain_hf import MegaTrainConfig, attach

utils = pytest.importorskip("trl.trainer.utils")
if not hasattr(utils, "add_fused_lm_head"):
    pytest.skip("this trl has no fused LM head", allow_module_level=True)
from megatrain_hf.integrations.trl import adopt_fused_lm_head  # noqa: E402
from megatrain_hf.errors import DependencyError, IncompatibleOptionsError

OUTPUTS = ("log_probs", "entropy", "is_top1")


def _batch():
    data = RandomTokens(n=2)
    batch = {k: torch.stack([data[i][k] for i in range(2)]) for k in data[0]}
    batch["labels"][0, :5] = -100  # unlabelled positions, as a completion-only loss has
    return batch


def _pair(family="llama", frozen_head=False):
    ref, model = tiny_model(family, attention_dropout=0.0), tiny_model(family, attention_dropout=0.0)
    for m in (ref, model):
        utils.add_fused_lm_head(m, outputs=OUTPUTS)
        if frozen_head:
            m.lm_head.weight.requires_grad_(False)
    engine = attach(model, MegaTrainConfig(), device="cpu")
    assert adopt_fused_lm_head(engine, model)
    assert not adopt_fused_lm_head(engine, model)  # adopted once
    return ref, model, engine


@pytest.mark.parametrize("entropy_coef", [0.0, 0.1])
@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: final logit soft-capping
def test_fused_head_outputs_and_gradients_equal_trl(family, entropy_coef):
    ref, model, engine = _pair(family)
    batch = _batch()
    outs = []
    for m in (ref, model):
        out = m(**batch, fused_lm_head=True, num_items_in_batch=torch.tensor(20.0))
        loss = out.loss - entropy_coef * (out.entropy * out.label_mask).sum()
        loss.backward()
        outs.append(out)
    engine.synchronize()
    for field in ("loss", "log_probs", "entropy", "is_top1", "label_mask"):
        assert torch.equal(getattr(outs[0], field), getattr(outs[1], field)), field
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(p_ref.grad, p.grad), name


def test_frozen_head_gets_no_weight_gradient():
    ref, model, engine = _pair(frozen_head=True)
    batch = _batch()
    for m in (ref, model):
        m(**batch, fused_lm_head=True).loss.backward()
    engine.synchronize()
    assert model.lm_head.weight.grad is None
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        if p_ref.requires_grad:
            assert torch.equal(p_ref.grad, p.grad), name


def test_adopted_forward_keeps_the_signature_generate_reads():
    ref, model, engine = _pair()
    assert inspect.signature(model.forward) == inspect.signature(ref.forward)
    assert "logits_to_keep" in inspect.signature(model.forward).parameters
    ids = _batch()["input_ids"][:, :6]
    model.eval()
    ref.eval()
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(ref.generate(ids, **kw), model.generate(ids, **kw))
    engine.detach()
    assert model.__dict__["forward"].__func__.__code__.co_name == "_fused_forward"  # TRL's again


def test_unknown_forms_are_refused():
    model = tiny_model("llama")
    engine = attach(model, MegaTrainConfig(), device="cpu")

    def forward(self, *args, fused_lm_head=False, **kwargs):  # takes the flag, is not TRL's
        return None

    model.forward = forward.__get__(model)
    with pytest.raises(DependencyError, match="takes fused_lm_head but is not"):
        adopt_fused_lm_head(engine, model)


def test_wrapped_head_is_refused_with_the_fix():
    peft = pytest.importorskip("peft")
    base = tiny_model("llama")
    utils.add_fused_lm_head(base, outputs=OUTPUTS)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    engine = attach(model, MegaTrainConfig(), device="cpu")
    with pytest.raises(IncompatibleOptionsError, match="modules_to_save"):
        adopt_fused_lm_head(engine, model.get_base_model())


def test_trl_outside_the_tested_range_is_refused(monkeypatch):
    import trl

    from megatrain_hf.integrations import trl as megatrain_trl

    monkeypatch.setattr(trl, "__version__", "1.20.0")
    with pytest.raises(DependencyError, match=r"trl 1.20.0 is outside the range .*>= 1.15, < 1.17.*pip install"):
        megatrain_trl.check_trl_version()
    monkeypatch.setattr(trl, "__version__", "1.15.0")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "triton" else object())
    with pytest.raises(DependencyError, match=r"trl 1.15.0's fused LM head always runs its Triton kernel"):
        megatrain_trl.check_trl_version()

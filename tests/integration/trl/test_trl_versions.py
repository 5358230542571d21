"""Every trl that installs beside megatrain trains exactly or is refused (``integrations/trl.py``).

The version is checked when any TRL trainer is built with megatrain, before anything is attached; and
any per-instance ``forward`` of the model that holds a streamed module or parameter -- trl 1.14's
chunked loss (``_patch_chunked_ce_lm_head``) closes over ``lm_head`` and reads its host master -- is
refused when training starts, whatever its version. A forward that only wraps the model's own
(accelerate's autocast wrapper) is left alone. The tested range itself: ``.ci/trl_versions.sh``.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatrain_hf import MegaTrainPlugin, attach, engine_of
from megatrain_hf.errors import UnsupportedTrlError
from megatrain_hf.integrations.trl import SUPPORTED_TRL, check_model_forward
from tests.helpers import RandomTokens, tiny_model, training_args
from tests.integration.trl.test_trl_trainers import _tokenizer

trl = pytest.importorskip("trl")


@pytest.mark.parametrize("version", ["1.14.1", "1.17.0", "0.24.0"])
def test_a_trl_trainer_of_an_untested_version_is_refused_before_attaching(tmp_path, monkeypatch, version):
    monkeypatch.setattr(trl, "__version__", version)
    model = tiny_model("llama")
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, max_length=16)
    from datasets import Dataset

    data = Dataset.from_dict({"input_ids": [list(range(3, 19))] * 4})
    with pytest.raises(UnsupportedTrlError, match=rf"trl {version} is outside the range megatrain trains exactly"):
        trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=_tokenizer(),
                       callbacks=[MegaTrainPlugin()])
    assert engine_of(model) is None  # refused before anything was attached


def test_the_installed_trl_is_in_the_range():
    parts = tuple(int(p) for p in trl.__version__.split(".")[:2])
    assert SUPPORTED_TRL[0] <= parts < SUPPORTED_TRL[1]


def _chunked_forward_like_trl_1_14(model):
    """trl 1.14's ``_patch_chunked_ce_lm_head``: the model's forward replaced by a method that closes over
    the output embedding and reads its weight."""
    original_forward = model.forward
    lm_head = model.get_output_embeddings()

    def _chunked_ce_forward(self, input_ids=None, labels=None, **kwargs):
        if labels is None:
            return original_forward(input_ids=input_ids, **kwargs)
        hidden = self.base_model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = hidden @ lm_head.weight.t()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return types.SimpleNamespace(loss=loss, logits=None)

    _chunked_ce_forward.__module__ = "trl.trainer.sft_trainer"
    model.forward = types.MethodType(_chunked_ce_forward, model)


def test_a_forward_that_reads_the_head_directly_is_refused_when_training_starts(tmp_path):
    model = tiny_model("llama")
    _chunked_forward_like_trl_1_14(model)
    from transformers import Trainer

    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=1), train_dataset=RandomTokens(n=4),
                      callbacks=[MegaTrainPlugin()])
    with pytest.raises(UnsupportedTrlError, match=r"trl\.trainer\.sft_trainer.*closure cell 'lm_head' -> "
                                                   r"module Linear of the model.*loss_type='nll'"):
        trainer.train()


def test_forwards_that_only_wrap_the_model_are_left_alone():
    model = tiny_model("llama")
    engine = attach(model)
    inner = model.forward

    def autocast_forward(*args, **kwargs):  # accelerate's convert_outputs_to_fp32 / autocast wrapper form
        with torch.autocast("cpu", enabled=False):
            return inner(*args, **kwargs)

    model.forward = autocast_forward
    check_model_forward(engine, model)
    model.forward = types.MethodType(lambda self, **kw: self.model(**kw), model)
    check_model_forward(engine, model)
    weight = model.lm_head.weight
    model.forward = lambda input_ids: model.model(input_ids).last_hidden_state @ weight.t()
    with pytest.raises(UnsupportedTrlError, match="a streamed parameter of shape"):
        check_model_forward(engine, model)
    engine.detach()

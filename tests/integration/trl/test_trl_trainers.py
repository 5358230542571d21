"""Preference and RL fine-tuning through TRL, each trainer with vs without megatrain (CPU, fp32, same
seed, 6 steps): every logged loss / reward and every final parameter within 1e-6.

GRPO and RLOO pick their buffered generation slice by a counter that ``training_step`` advances:
layer-major stays off for them (their ``training_step`` keeps state across calls). DPO's
``sync_ref_model`` reads the policy's weights at step end: the update is waited for. TRL's reference
(DPO, KTO) and reward models are attached frozen and streamed like the policy instead of being
moved whole to the device.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close_params, state_of, tiny_model
from megatrain_hf import MegaTrainPlugin, engine_of

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

ATOL = 1e-6
WORDS = [f"w{i}" for i in range(120)]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")
    tok.chat_template = None
    return tok


def _text(rng: torch.Generator, n: int) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=rng))


def _saved_model(tmp_path, family="llama", cls=None, **overrides):
    """A tiny model saved and loaded back: TRL rebuilds the default reference from its path."""
    path = tmp_path / f"base-{family}-{cls.__name__ if cls else 'lm'}"
    if not path.exists():
        model = tiny_model(family, attention_dropout=0.0, pad_token_id=0, eos_token_id=1, **overrides)
        if cls is not None:
            seq = cls.from_config(model.config)
            seq.model.load_state_dict(model.model.state_dict())
            model = seq
        model.save_pretrained(path)
    loader = cls or __import__("transformers").AutoModelForCausalLM
    return loader.from_pretrained(path, dtype=torch.float32)


def _common(out, **overrides):
    values = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=2, learning_rate=5e-3, report_to=[],
                  logging_steps=1, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0, use_cpu=True)
    return {**values, **overrides}


def _compare(tmp_path, run, keys=("loss",)):
    results = []
    for name, plugin in (("ref", []), ("mt", [MegaTrainPlugin()])):
        torch.manual_seed(0)
        trainer, model = run(tmp_path / name, plugin)
        logs = [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]
        results.append((logs, state_of(model), trainer))
    (ref_logs, ref_state, _), (logs, state, trainer) = results
    assert len(ref_logs) == len(logs) == 6
    for a, b in zip(ref_logs, logs):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=ATOL), (k, ref_logs, logs)
    assert_close_params(ref_state, state, ATOL)
    return trainer


def _preference_data(n=24, seed=0):
    rng = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_dict({
        "prompt": [_text(rng, 4) for _ in range(n)],
        "chosen": [_text(rng, 5) for _ in range(n)],
        "rejected": [_text(rng, 5) for _ in range(n)],
    })


@pytest.mark.parametrize("sync", [False, True], ids=["default-reference", "sync_ref_model"])
def test_dpo_equals_plain_trl(tmp_path, sync):
    def run(out, plugin):
        args = trl.DPOConfig(**_common(out, gradient_accumulation_steps=2, sync_ref_model=sync, ref_model_sync_steps=2,
                                       ref_model_mixup_alpha=0.5, max_length=24))
        trainer = trl.DPOTrainer(model=_saved_model(tmp_path), args=args, train_dataset=_preference_data(),
                                 processing_class=_tokenizer(), callbacks=plugin)
        trainer.train()
        return trainer, trainer.model

    trainer = _compare(tmp_path, run, keys=("loss", "rewards/chosen", "rewards/rejected"))
    reference = engine_of(trainer.ref_model)
    assert reference is not None and reference.store.trainable_numel() == 0  # frozen, streamed
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())


def test_kto_equals_plain_trl(tmp_path):
    rng = torch.Generator().manual_seed(1)
    data = datasets.Dataset.from_dict({
        "prompt": [_text(rng, 4) for _ in range(24)],
        "completion": [_text(rng, 5) for _ in range(24)],
        "label": [bool(i % 2) for i in range(24)],
    })

    def run(out, plugin):
        args = trl.KTOConfig(**_common(out, max_length=24))
        trainer = trl.KTOTrainer(model=_saved_model(tmp_path), args=args, train_dataset=data,
                                 processing_class=_tokenizer(), callbacks=plugin)
        trainer.train()
        return trainer, trainer.model

    trainer = _compare(tmp_path, run)
    assert engine_of(trainer.ref_model) is not None


def _reward(completions, **kwargs):
    """Deterministic reward: how many distinct words a completion uses."""
    return [float(len(set(c.split()))) for c in completions]


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("name", ["GRPO", "RLOO"])
def test_grpo_and_rloo_equal_plain_trl(tmp_path, name, accumulation):
    rng = torch.Generator().manual_seed(2)
    data = datasets.Dataset.from_dict({"prompt": [_text(rng, 4) for _ in range(24)]})
    config_cls, trainer_cls = getattr(trl, f"{name}Config"), getattr(trl, f"{name}Trainer")

    def run(out, plugin):
        args = config_cls(**_common(out, gradient_accumulation_steps=accumulation, num_generations=2,
                                    max_completion_length=6, per_device_train_batch_size=4, generation_batch_size=4,
                                    beta=0.0))
        trainer = trainer_cls(model=_saved_model(tmp_path), reward_funcs=_reward, args=args, train_dataset=data,
                              processing_class=_tokenizer(), callbacks=plugin)
        trainer.train()
        return trainer, trainer.model

    _compare(tmp_path, run, keys=("loss", "reward"))


def test_reward_trainer_equals_plain_trl(tmp_path):
    from transformers import AutoModelForSequenceClassification

    rng = torch.Generator().manual_seed(3)
    data = datasets.Dataset.from_dict({"chosen": [_text(rng, 6) for _ in range(24)],
                                       "rejected": [_text(rng, 6) for _ in range(24)]})

    def run(out, plugin):
        model = _saved_model(tmp_path, cls=AutoModelForSequenceClassification, num_labels=1)
        args = trl.RewardConfig(**_common(out, max_length=16))
        trainer = trl.RewardTrainer(model=model, args=args, train_dataset=data, processing_class=_tokenizer(),
                                    callbacks=plugin)
        trainer.train()
        return trainer, trainer.model

    trainer = _compare(tmp_path, run)
    engine = engine_of(trainer.model)
    assert engine is not None and engine.units[-1].name.endswith("score")


def test_reference_model_host_bytes_and_device_residency(tmp_path):
    """A frozen reference keeps one copy of its weights in the wire dtype (DPOConfig trains in bf16:
    2 B per matrix parameter, 4 for the fp32 embedding and vectors; no master, gradient or optimizer
    state), and never holds more than the unit computing and the one prefetched on the compute
    device (the streamer's residency)."""
    from megatrain_hf.memory import host_breakdown_for_units

    policy = _saved_model(tmp_path)
    reference = _saved_model(tmp_path)
    args = trl.DPOConfig(**_common(tmp_path / "out", max_length=24, max_steps=2))
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=_preference_data(),
                             processing_class=_tokenizer(), callbacks=[MegaTrainPlugin()])
    engine = engine_of(reference)
    assert engine is not None
    params = sum(p.numel() for p in reference.parameters())
    assert args.bf16 and engine.compute_dtype == torch.bfloat16
    units = [(u.name, u.module) for u in engine.units]
    plan = host_breakdown_for_units(units, compute_dtype=torch.bfloat16, embedding_units=engine.family.locate(
        reference).embedding_units)
    assert engine.store.host_bytes() == plan["frozen"] == sum(plan.values())
    matrices = sum(p.numel() for n, p in reference.named_parameters() if p.ndim == 2 and "embed" not in n)
    assert engine.store.host_bytes() < 2 * matrices + 4 * (params - matrices) + 64 * len(list(reference.parameters()))
    seen = []
    fetch = engine.streamer.fetch

    def watched(u):
        seen.append(len(engine.streamer.device_units()))
        return fetch(u)

    engine.streamer.fetch = watched
    trainer.train()
    assert seen and max(seen) <= 2

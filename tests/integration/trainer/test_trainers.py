"""Where plain Trainer works, megatrain works: one model through several Trainers, ``model_init`` and
hyperparameter search, and a checkpointed ``trainer_state.json`` free of megatrain's timings.
Each against plain Trainer doing the same (CPU, fp32, within 1e-6)."""

from __future__ import annotations

import json

import pytest
from transformers import Trainer

from tests.helpers import (
    LossRecorder,
    RandomTokens,
    assert_close_losses,
    assert_close_params,
    state_of,
    tiny_model,
    training_args,
)
from megatrain_hf import MegaTrainPlugin, engine_of

ATOL = 1e-6


def _sequence(tmp_path, name: str, plugin: bool, second: str) -> tuple[list[float], dict, dict]:
    """Train a model with one Trainer, then ``second`` ("train" or "evaluate") with a fresh Trainer."""
    model = tiny_model("llama")
    recorder = LossRecorder(model)
    callbacks = lambda: [MegaTrainPlugin()] if plugin else []  # noqa: E731 -- a new plugin per Trainer
    Trainer(model=model, args=training_args(tmp_path / f"{name}-1"), train_dataset=RandomTokens(),
            callbacks=callbacks()).train()
    trainer = Trainer(model=model, args=training_args(tmp_path / f"{name}-2", learning_rate=1e-3),
                      train_dataset=RandomTokens(seed=4), eval_dataset=RandomTokens(n=8, seed=6),
                      callbacks=callbacks())
    metrics = trainer.train().metrics if second == "train" else trainer.evaluate()
    return recorder.losses, state_of(model), metrics


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
@pytest.mark.parametrize("second", ["train", "evaluate"])
def test_two_trainers_in_sequence_on_one_model(tmp_path, second):
    ref_losses, ref_state, ref_metrics = _sequence(tmp_path, "ref", False, second)
    losses, state, metrics = _sequence(tmp_path, "mt", True, second)
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_params(ref_state, state, ATOL)
    if second == "evaluate":
        assert metrics["eval_loss"] == pytest.approx(ref_metrics["eval_loss"], abs=ATOL)


def test_a_second_trainer_with_other_options_attaches_again(tmp_path, caplog):
    model = tiny_model("llama")
    Trainer(model=model, args=training_args(tmp_path / "a", max_steps=1), train_dataset=RandomTokens(),
            callbacks=[MegaTrainPlugin()]).train()
    first = engine_of(model)
    with caplog.at_level("INFO", logger="megatrain_hf"):
        Trainer(model=model, args=training_args(tmp_path / "b", max_steps=1), train_dataset=RandomTokens(),
                callbacks=[MegaTrainPlugin(layer_major=False)]).train()
    second = engine_of(model)
    assert second is not first and "attached with other options" in caplog.text
    with caplog.at_level("INFO", logger="megatrain_hf"):
        Trainer(model=model, args=training_args(tmp_path / "c", max_steps=1), train_dataset=RandomTokens(),
                callbacks=[MegaTrainPlugin(layer_major=False)])
    assert engine_of(model) is second and "engine is reused" in caplog.text


def _trial_losses(tmp_path, plugin: bool) -> list[list[float]]:
    optuna = pytest.importorskip("optuna")
    losses: list[list[float]] = []

    def model_init(trial=None):
        model = tiny_model("llama")
        losses.append(LossRecorder(model).losses)
        return model

    trainer = Trainer(model_init=model_init, args=training_args(tmp_path, max_steps=3), train_dataset=RandomTokens(),
                      eval_dataset=RandomTokens(n=8, seed=6), callbacks=[MegaTrainPlugin()] if plugin else [])
    trainer.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)},
        backend="optuna", n_trials=2, direction="minimize",
        compute_objective=lambda metrics: metrics["eval_loss"], sampler=optuna.samplers.RandomSampler(seed=0),
    )
    return [trial for trial in losses if trial]


@pytest.mark.slow  # ~10 s: optuna trials: in `make test`, not in `make test-fast`
def test_hyperparameter_search_trials_equal_plain_trials(tmp_path):
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ref = _trial_losses(tmp_path / "ref", False)
    got = _trial_losses(tmp_path / "mt", True)
    assert len(ref) == len(got) == 2
    for ref_trial, got_trial in zip(ref, got):
        assert_close_losses(ref_trial, got_trial, ATOL)


def _state_at(run_dir) -> dict:
    return json.loads((run_dir / "checkpoint-6" / "trainer_state.json").read_text())


def _resumed_state(tmp_path, name: str, plugin: bool) -> tuple[dict, dict]:
    args = dict(save_strategy="steps", save_steps=3)
    callbacks = lambda: [MegaTrainPlugin()] if plugin else []  # noqa: E731
    Trainer(model=tiny_model("llama"), args=training_args(tmp_path / f"{name}-full", **args),
            train_dataset=RandomTokens(), callbacks=callbacks()).train()
    Trainer(model=tiny_model("llama"), args=training_args(tmp_path / f"{name}-resumed", **args),
            train_dataset=RandomTokens(), callbacks=callbacks()).train()  # the same run, stopped below
    # resume the second run from its step-3 checkpoint into a fresh process state
    resumed = tiny_model("llama", seed=9)
    Trainer(model=resumed, args=training_args(tmp_path / f"{name}-resumed", **args), train_dataset=RandomTokens(),
            callbacks=callbacks()).train(resume_from_checkpoint=str(tmp_path / f"{name}-resumed" / "checkpoint-3"))
    return _state_at(tmp_path / f"{name}-full"), _state_at(tmp_path / f"{name}-resumed")


@pytest.mark.slow  # ~8 s: four training runs: in `make test`, not in `make test-fast`
def test_resumed_trainer_state_equals_the_uninterrupted_runs(tmp_path):
    """Every field of trainer_state.json that plain Trainer keeps equal between a resumed and an
    uninterrupted run is equal under megatrain too: its metrics are not in the checkpointed state."""
    plain_full, plain_resumed = _resumed_state(tmp_path, "ref", False)
    full, resumed = _resumed_state(tmp_path, "mt", True)
    kept_equal = [k for k in plain_full if plain_full[k] == plain_resumed[k]]
    assert "log_history" in kept_equal
    for key in kept_equal:
        assert full[key] == resumed[key], key
    assert not any(k.startswith("megatrain/") for entry in full["log_history"] for k in entry)

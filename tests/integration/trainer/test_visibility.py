"""What a user of a tool sees: the banner when megatrain attaches (whatever the logging configuration),
the checkpoint's final folder in the log (not megatrain's staging folder), no deprecation warning from
megatrain's own calls, and the record in each checkpoint (``megatrain_optimizer/``)."""

from __future__ import annotations

import logging
import warnings

import pytest

from megatrain_hf import MegaTrainPlugin
from tests.helpers import tiny_model, train, training_args

BANNER = "trains LlamaForCausalLM with megatrain"


@pytest.fixture
def restore_logging():
    root, ours = logging.getLogger(), logging.getLogger("megatrain_hf")
    saved = (root.level, list(root.handlers), ours.level, ours.disabled, ours.propagate)
    yield
    import megatrain_hf.integrations.trainer.plugin as plugin

    plugin.logger.disabled = False
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    ours.setLevel(saved[2])
    ours.disabled, ours.propagate = saved[3], saved[4]


@pytest.mark.parametrize("config", ["default", "root_error", "disabled"])
def test_the_banner_shows_under_any_logging_configuration(tmp_path, capsys, caplog, restore_logging, config):
    """Once: as a WARNING record where a handler shows it (here pytest's), else printed to stderr."""
    ours = logging.getLogger("megatrain_hf")
    if config == "root_error":  # a tool that shows errors only
        logging.getLogger().setLevel(logging.ERROR)
        ours.setLevel(logging.NOTSET)
    elif config == "disabled":  # dictConfig(disable_existing_loggers=True) after megatrain was imported
        import megatrain_hf.integrations.trainer.plugin as plugin

        for log in (ours, plugin.logger):
            log.disabled = True
    train(tiny_model("llama"), training_args(tmp_path, max_steps=1), callbacks=[MegaTrainPlugin()])
    err = capsys.readouterr().err
    logged = [r for r in caplog.records if BANNER in r.getMessage() and r.levelno == logging.WARNING]
    assert err.count(BANNER) + len(logged) == 1, err[-2000:]
    assert (len(logged) == 1) == (config == "default")  # hidden records are printed instead


def test_the_staging_folder_is_not_logged_as_the_checkpoint(tmp_path):
    import io

    import transformers

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)  # a handler of the tool's (transformers' own writes to stderr)
    hf_logger = logging.getLogger("transformers")
    before = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_info()
    hf_logger.addHandler(handler)
    try:
        train(tiny_model("llama"), training_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2),
              callbacks=[MegaTrainPlugin()])
    finally:
        hf_logger.removeHandler(handler)
        transformers.logging.set_verbosity(before)
    assert (tmp_path / "checkpoint-2" / "megatrain_optimizer").is_dir()  # the record that megatrain trained it
    text = stream.getvalue()
    assert f"Saving model checkpoint to {tmp_path / 'checkpoint-2'}" in text, text[-3000:]
    assert ".tmp-" not in text, [line for line in text.splitlines() if ".tmp-" in line]


def _warnings_of(tmp_path, callbacks) -> set[str]:
    model = tiny_model("llama")
    # enabled on the model before the Trainer, as TRL and axolotl do: megatrain turns it off at attach
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, training_args(tmp_path, max_steps=1, gradient_checkpointing=True), callbacks=callbacks)
    return {str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))}


def test_megatrain_adds_no_deprecation_warning(tmp_path):
    plain = _warnings_of(tmp_path / "plain", None)
    megatrain = _warnings_of(tmp_path / "mt", [MegaTrainPlugin()])
    assert megatrain <= plain, megatrain - plain

"""megatrain_hf.init() and megatrain_hf.Trainer: the seed's two names over MegaTrainConfig and the plugin.

mt.Trainer trains like plain Trainer (fp32 CPU parity, 1e-6) with megatrain attached and HostAdamW;
init() enables the config for every Trainer, maps max_vram_gb to max_gpu_memory, refuses unknown
options, maps optimizer_compression to optimizer_state and offload_dir to the disk tier (refusing one that does
not exist); `import megatrain_hf`
loads neither transformers nor the Trainer integration.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import transformers

import megatrain_hf as mt
from tests.helpers import RandomTokens, assert_close_losses, assert_close_params, state_of, tiny_model, train, training_args
from megatrain_hf import HostAdamW, MegaTrainConfig, MegaTrainPlugin, engine_of
from megatrain_hf.integrations.trainer import is_enabled
from megatrain_hf.errors import MegatrainConfigError
from tests.helpers import REPO_ROOT

ATOL_FP32 = 1e-6
ROOT = REPO_ROOT


@pytest.fixture(autouse=True)
def _disabled():
    yield
    mt.disable()


def _run(trainer_cls, model, path, **kwargs):
    from tests.helpers import LossRecorder

    recorder = LossRecorder(model)
    trainer = trainer_cls(model=model, args=training_args(path), train_dataset=RandomTokens(), **kwargs)
    trainer.train()
    return trainer, recorder.losses


def test_mt_trainer_trains_with_megatrain_like_plain_trainer(tmp_path):
    ref_model = tiny_model("qwen2")
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref"))
    model = tiny_model("qwen2")
    trainer, losses = _run(mt.Trainer, model, tmp_path / "mt")
    assert isinstance(trainer, transformers.Trainer) and not is_enabled()
    assert engine_of(model) is not None and isinstance(trainer.optimizer.optimizer, HostAdamW)
    assert_close_losses(ref_losses, losses, ATOL_FP32)
    assert_close_params(state_of(ref_model), state_of(model), ATOL_FP32)


def test_init_enables_its_config_for_every_trainer(tmp_path):
    config = mt.init(max_vram_gb=24, layer_major=False)
    assert is_enabled() and config.max_gpu_memory == 24 * 10**9 and config.layer_major is False
    assert config == MegaTrainConfig(max_gpu_memory=24 * 10**9, layer_major=False)
    for cls in (mt.Trainer, transformers.Trainer):
        model = tiny_model("llama")
        trainer = cls(model=model, args=training_args(tmp_path / cls.__module__, max_steps=1),
                      train_dataset=RandomTokens())
        plugins = [c for c in trainer.callback_handler.callbacks if isinstance(c, MegaTrainPlugin)]
        assert len(plugins) == 1 and plugins[0].config is config and engine_of(model).config is config
    mt.disable()
    model = tiny_model("llama")
    transformers.Trainer(model=model, args=training_args(tmp_path / "plain"), train_dataset=RandomTokens())
    assert engine_of(model) is None


def test_mt_trainer_keeps_a_plugin_it_is_given(tmp_path):
    plugin = MegaTrainPlugin(layer_major=False)
    for kwargs in ({"callbacks": [plugin]}, {"plugins": [plugin]}):
        model = tiny_model("llama")
        trainer = mt.Trainer(model=model, args=training_args(tmp_path / "a"), train_dataset=RandomTokens(), **kwargs)
        plugins = [c for c in trainer.callback_handler.callbacks if isinstance(c, MegaTrainPlugin)]
        assert plugins == [plugin] and engine_of(model).config.layer_major is False


def test_the_seed_example_runs_from_a_deferred_model(tmp_path):
    """mt.init(), mt.from_pretrained, mt.Trainer: the weights are read when the Trainer attaches."""
    tiny_model("llama").save_pretrained(tmp_path / "ckpt")
    mt.init(max_vram_gb=80)
    model = mt.from_pretrained(tmp_path / "ckpt")
    trainer, losses = _run(mt.Trainer, model, tmp_path / "mt")
    assert engine_of(model) is not None and len(losses) == 12 and all(loss == loss for loss in losses)


@pytest.mark.parametrize("kwargs,match", [
    ({"offload_dir": "/mnt/nvme/cache-missing"}, r"offload_dir='/mnt/nvme/cache-missing' does not exist. Fix"),
    ({"optimizer_compression": "2bit"}, r"optimizer_compression='2bit'\): allowed: True .* '4bit'"),
    ({"optimizer_compression": True, "optimizer_state": "4bit"}, "set the same thing; pass one"),
    ({"max_vram_gb": 0}, r"max_vram_gb=0\): must be a number of GB > 0"),
    ({"max_vram_gb": "80"}, r"max_vram_gb='80'\): must be a number"),
    ({"max_vram_gb": True}, r"max_vram_gb=True\): must be a number"),
    ({"max_vram_gb": 80, "max_gpu_memory": "24GiB"}, "set the same budget; pass one"),
    ({"max_vram": 80}, r"unknown option\(s\) \['max_vram'\]; allowed: \['offload_dir', 'max_vram_gb'"),
    ({"compute_dtype": "fp16"}, r"MegaTrainConfig.compute_dtype='fp16'"),
])
def test_init_refuses_what_it_cannot_do(kwargs, match):
    with pytest.raises(MegatrainConfigError, match=match):
        mt.init(**kwargs)
    assert not is_enabled()


@pytest.mark.parametrize("value,state", [(True, "8bit"), (False, "fp32"), ("bf16", "bf16"), ("4bit", "4bit")])
def test_init_optimizer_compression_sets_optimizer_state(value, state):
    try:
        assert mt.init(optimizer_compression=value).optimizer_state == state
    finally:
        mt.disable()


@pytest.mark.slow  # ~15 s: fresh interpreters: in `make test`, not in `make test-fast`
def test_import_loads_neither_transformers_nor_the_trainer_integration():
    code = ("import sys, megatrain_hf; assert 'transformers' not in sys.modules, 'transformers'; "
            "assert 'megatrain_hf.integrations.trainer' not in sys.modules; "
            "assert callable(megatrain_hf.init) and 'transformers' in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})

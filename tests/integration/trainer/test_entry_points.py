"""Every entry point end to end: plugins=/callbacks= (see test_parity), enable()/disable(),
MegaTrainAccelerator in a hand-written loop, `python -m megatrain_hf.run`, `megatrain launch`
and `accelerate launch -m megatrain_hf.run` (subprocesses on an unchanged user script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import RandomTokens, assert_close_losses, assert_close_params, state_of, tiny_model, train, training_args
import megatrain_hf
import megatrain_hf.cli.launch
from megatrain_hf import MegaTrainConfig, engine_of
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
SCRIPT = ROOT / "tests" / "tools" / "train_tiny.py"
ATOL = 1e-6


@pytest.mark.slow
def test_enable_disable(tmp_path):
    ref = tiny_model("mistral")
    _, ref_losses = train(ref, training_args(tmp_path / "ref"))
    megatrain_hf.enable(MegaTrainConfig(device="cpu"))
    try:
        model = tiny_model("mistral")
        _, losses = train(model, training_args(tmp_path / "mt"))
        assert engine_of(model) is not None
    finally:
        megatrain_hf.disable()
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_params(state_of(ref), state_of(model), ATOL)
    after = tiny_model("mistral")
    train(after, training_args(tmp_path / "after", max_steps=1))
    assert engine_of(after) is None


def _accelerate_loop(model, accelerator_cls, **kwargs):
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    accelerator = accelerator_cls(cpu=True, gradient_accumulation_steps=2, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, fused=True)
    loader = DataLoader(RandomTokens(n=16), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            losses.append(loss.item())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    return losses


def test_megatrain_accelerator_loop():
    from accelerate import Accelerator

    from megatrain_hf import MegaTrainAccelerator

    ref = tiny_model("qwen2")
    ref_losses = _accelerate_loop(ref, Accelerator)
    model = tiny_model("qwen2")
    losses = _accelerate_loop(model, MegaTrainAccelerator, megatrain_config=MegaTrainConfig(device="cpu"))
    assert engine_of(model) is not None
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_params(state_of(ref), state_of(model), ATOL)


def _run(cmd, tmp_path, env_extra=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _script_result(tmp_path, name):
    return json.loads((tmp_path / name).read_text())


@pytest.fixture(scope="module")
def plain_script_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("plain")
    _run([sys.executable, str(SCRIPT), "--out", "plain.json", "--output_dir", "o"], tmp_path)
    result = _script_result(tmp_path, "plain.json")
    assert result["engine"] is False
    return result


@pytest.mark.slow
def test_run_module(tmp_path, plain_script_run):
    _run([sys.executable, "-m", "megatrain_hf.run", str(SCRIPT), "--out", "r.json", "--output_dir", "o"], tmp_path)
    result = _script_result(tmp_path, "r.json")
    assert result["engine"] is True
    assert_close_losses(plain_script_run["losses"], result["losses"], ATOL)


def _cpu_configs() -> list[Path]:
    """The shipped configs a CPU machine can launch (``use_cpu: true``): each is launched below; the
    others go through the launcher with --dry_run in test_cli.py."""
    import yaml

    return [p for p in sorted((ROOT / "configs").glob("*.yaml")) if yaml.safe_load(p.read_text()).get("use_cpu")]


def test_a_cpu_config_is_shipped():  # and so test_megatrain_launch launches at least one
    assert "megatrain_cpu.yaml" in [p.name for p in _cpu_configs()]


@pytest.mark.slow
@pytest.mark.parametrize("config", _cpu_configs(), ids=lambda p: p.name)
def test_megatrain_launch(tmp_path, plain_script_run, config):
    cmd = [sys.executable, "-m", "megatrain_hf.cli", "launch", "--config_file", str(config)]
    _run(cmd + [str(SCRIPT), "--out", "l.json", "--output_dir", "o"], tmp_path)
    result = _script_result(tmp_path, "l.json")
    assert result["engine"] is True
    assert_close_losses(plain_script_run["losses"], result["losses"], ATOL)


@pytest.mark.slow
def test_accelerate_launch_module(tmp_path, plain_script_run):
    config = tmp_path / "accelerate_cpu.yaml"
    import yaml

    keys, _ = megatrain_hf.cli.launch.load_launch_config(str(ROOT / "configs" / "megatrain_cpu.yaml"))
    config.write_text(yaml.safe_dump(keys))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "-m", "megatrain_hf.run"]
    _run(cmd + [str(SCRIPT), "--out", "a.json", "--output_dir", "o"], tmp_path, {"MEGATRAIN_CONFIG": '{"device": "cpu"}'})
    result = _script_result(tmp_path, "a.json")
    assert result["engine"] is True
    assert_close_losses(plain_script_run["losses"], result["losses"], ATOL)

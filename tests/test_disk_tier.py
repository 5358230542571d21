"""The disk tier (``offload_dir``): the AdamW moments in files, paged through a RAM window.

Through Trainer + the plugin the run with the moments on disk must equal the in-RAM run bitwise
(every logged loss and every final parameter): plain, with gradient accumulation, LoRA, resume.
"""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from helpers import RandomTokens, state_of, tiny_model, train, training_args
from megatrain_hf import HostAdamW, MegaTrainConfig, MegaTrainPlugin
from megatrain_hf.core.disk_io import RUN_DIR_PREFIX


def _run(tmp_path, name, offload_dir=None, model=None, **args):
    config = MegaTrainConfig(offload_dir=None if offload_dir is None else str(offload_dir),
                             offload_state="moments")
    model = model if model is not None else tiny_model("llama")
    trainer, losses = train(model, training_args(tmp_path / name, **args), callbacks=[MegaTrainPlugin(config)])
    return trainer, model, losses


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("accumulation", [1, 2])
def test_moments_on_disk_equal_the_in_ram_run(tmp_path, accumulation):
    disk = tmp_path / "disk"
    disk.mkdir()
    _, ref, ref_losses = _run(tmp_path, "ram", gradient_accumulation_steps=accumulation)
    trainer, got, losses = _run(tmp_path, "disk", disk, gradient_accumulation_steps=accumulation)
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, HostAdamW) and optimizer._pager is not None
    assert optimizer._exp_avg == {}  # no moment lives in RAM outside the window
    assert optimizer._pager.bytes_written >= 6 * optimizer._pager.disk_bytes()  # every unit, every step
    assert losses == ref_losses
    _assert_equal(state_of(ref), state_of(got))
    run_dir = optimizer._pager.run_dir
    assert os.path.basename(run_dir).startswith(RUN_DIR_PREFIX) and (os.stat(run_dir).st_mode & 0o777) == 0o700
    optimizer.close()
    assert not os.path.exists(run_dir) and os.listdir(disk) == []

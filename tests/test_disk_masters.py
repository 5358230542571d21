"""The fp32 masters on disk (``offload_state="all"``): the matrices' masters in each unit's state file
next to its moments, paged with them; the parameters alias a mapping of the file.

Through Trainer + the plugin, bf16 compute on the CPU: every logged loss and every final parameter
equal the in-RAM run's bitwise (plain, gradient accumulation, resume, 8-bit moments), the saved model
and checkpoints too; the plan's disk bytes are the files'; impossible combinations are refused.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin
from megatrain_hf.optim import native

NO_NATIVE = pytest.mark.skipif(native.host_adamw() is None, reason="no C++ compiler")


def _run(tmp_path, name, offload_state=None, options=None, resume=None, model=None, **args):
    disk = tmp_path / "disk"
    disk.mkdir(exist_ok=True)
    config = MegaTrainConfig(**({} if offload_state is None else dict(offload_dir=str(disk),
                                                                      offload_state=offload_state)),
                             **(options or {}))
    model = model if model is not None else tiny_model("llama")
    trainer, losses = train(model, training_args(tmp_path / name, bf16=True, **args),
                            callbacks=[MegaTrainPlugin(config)], resume=resume)
    return trainer, model, losses


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


def _paged(trainer):
    optimizer = trainer.optimizer.optimizer
    store = optimizer.store
    return optimizer, store, [u for u in optimizer.master_units]


@pytest.mark.parametrize("kernel,accumulation", [("torch", 1), ("torch", 2), pytest.param("native", 2, marks=NO_NATIVE)])
def test_masters_on_disk_equal_the_in_ram_run(tmp_path, kernel, accumulation):
    options = dict(host_adamw_kernel=kernel)
    _, ref, ref_losses = _run(tmp_path, "ram", options=options, gradient_accumulation_steps=accumulation)
    trainer, got, losses = _run(tmp_path, "all", "all", options=options, gradient_accumulation_steps=accumulation)
    optimizer, store, units = _paged(trainer)
    assert units and all(store.buffers[u].master_host is None for u in units)  # no staged master in RAM
    # every decoder layer and the head: their matrices' parameters alias the file's mapping
    engine = got._megatrain_engine
    assert engine.state_tier.masters == tuple(units)
    for u in units:
        mapped = store.buffers[u].master_paged
        assert mapped.numel() == store.buffers[u].n_staged
        for e in store.owned_trainable(u):
            inside = mapped.data_ptr() <= e.tensor.data_ptr() < mapped.data_ptr() + 4 * mapped.numel()
            assert inside == (e.offset < store.buffers[u].n_staged), e.name
    # the plan's disk bytes are the files' (masters included), one read and one write per unit per step
    assert engine.state_tier.disk_bytes == optimizer._pager.disk_bytes()
    assert optimizer._pager.bytes_written >= 6 * optimizer._pager.disk_bytes()
    assert losses == ref_losses
    _assert_equal(state_of(ref), state_of(got))
    run_dir = optimizer._pager.run_dir
    optimizer.close()
    assert not os.path.exists(run_dir)
    _assert_equal(state_of(ref), state_of(got))  # still readable after the files are removed


def test_eight_bit_moments_and_masters_on_disk_equal_the_in_ram_run(tmp_path):
    options = dict(optimizer_state="8bit")
    _, ref, ref_losses = _run(tmp_path, "ram", options=options)
    trainer, got, losses = _run(tmp_path, "all", "all", options=options)
    optimizer, _, units = _paged(trainer)
    assert units and optimizer.moments.nbytes() == 0
    assert got._megatrain_engine.state_tier.disk_bytes == optimizer._pager.disk_bytes()
    assert losses == ref_losses
    _assert_equal(state_of(ref), state_of(got))

"""The disk tier's I/O engines (``disk_io``): DeepSpeed's async I/O op against the thread pool.

With DeepSpeed's op (``disk_io="deepspeed"``) training must equal the thread pool's run bitwise
(every logged loss and every final parameter), and a failed request must raise in the training
thread with the file and the bytes. Those tests need deepspeed, libaio and a directory that takes
O_DIRECT; where one is missing they skip, naming it. The refusal and the fallback run everywhere.
"""

from __future__ import annotations

import logging
import os
import re
import sys

import pytest
import torch

from tests.helpers import state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin
from megatrain_hf.core.disk_io import DiskIO
from megatrain_hf.optim import disk_engines
from megatrain_hf.optim.paged_state import PagedState
from megatrain_hf.errors import BackgroundWorkerError, DependencyError, DiskIOError, MegatrainConfigError

SPECS = {0: {"a": (5000, torch.float32)}, 1: {"a": (3000, torch.float32), "b": (1030, torch.int8)},
         2: {"a": (7, torch.float32)}}


def _needs_deepspeed(directory) -> None:
    reason = disk_engines.deepspeed_unavailable(str(directory), 2**20)
    if reason is not None:
        pytest.skip(f"DeepSpeed's async I/O op cannot run here: {reason}")


def _run(tmp_path, name, disk_io, callbacks=(), **args):
    (tmp_path / f"{name}-disk").mkdir()
    config = MegaTrainConfig(offload_dir=str(tmp_path / f"{name}-disk"), offload_state="moments", disk_io=disk_io)
    model = tiny_model("llama")
    trainer, losses = train(model, training_args(tmp_path / name, **args),
                            callbacks=[MegaTrainPlugin(config), *callbacks])
    return trainer.optimizer.optimizer, model, losses


@pytest.mark.parametrize("accumulation", [1, 2])
def test_deepspeed_engine_trains_bitwise_like_the_thread_pool(tmp_path, accumulation):
    _needs_deepspeed(tmp_path)
    opt_ref, ref, ref_losses = _run(tmp_path, "threads", "threads", gradient_accumulation_steps=accumulation)
    opt, got, losses = _run(tmp_path, "deepspeed", "deepspeed", gradient_accumulation_steps=accumulation)
    assert type(opt_ref.disk_tier.io) is DiskIO and type(opt.disk_tier.io) is disk_engines.DeepSpeedIO
    assert opt.disk_tier.bytes_written == opt_ref.disk_tier.bytes_written > 0
    assert opt.disk_tier.bytes_read > 0 and opt_ref.disk_tier.bytes_read > 0  # how many depends on timing (window hits)
    assert losses == ref_losses
    a, b = state_of(ref), state_of(got)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    for o in (opt_ref, opt):
        o.close()


def test_a_failed_deepspeed_read_raises_in_the_training_thread(tmp_path):
    """A read DeepSpeed's op would get wrong (a unit file cut short: its op asserts, aborting the process, on a
    read past the end) stops training with an OSError naming the file and the bytes, raised in the training
    thread from the next wait for the update."""
    from transformers import TrainerCallback

    _needs_deepspeed(tmp_path)

    class CutAFile(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            if state.global_step == 2:
                optimizer.optimizer.synchronize()
                pager = optimizer.optimizer.disk_tier
                u = min(u for u in pager.units if pager._slot_of(u) is None)  # read again in step 3
                cut.append(os.path.join(pager.run_dir, pager._files[u].name))
                os.truncate(cut[0], 4096)

    cut: list[str] = []
    with pytest.raises((DiskIOError, BackgroundWorkerError)) as info:
        _run(tmp_path, "run", "deepspeed", callbacks=[CutAFile()])
    text = str(info.value) + str(info.value.__cause__)
    assert re.search(rf"reading \d+ bytes at offset 0 of {re.escape(cut[0])} failed: the file holds 4096 bytes",
                     text), text


def test_a_failed_deepspeed_write_raises_with_the_file_and_the_bytes(tmp_path):
    """A write-back DeepSpeed's op cannot do (here: the unit's file replaced by a directory, which it cannot
    open) raises from flush() and from every later acquire, naming the file and the bytes."""
    _needs_deepspeed(tmp_path)
    pager = PagedState(str(tmp_path), SPECS, window=2, disk_io="deepspeed")
    f = pager._files[0]
    path = os.path.join(pager.run_dir, f.name)
    try:
        with pager.resident(0, write=True) as flats:
            flats["a"].fill_(2.5)
            os.unlink(path)
            os.mkdir(path)
        message = rf"writing {f.nbytes} bytes at offset 0 of {re.escape(path)} failed: DeepSpeed's aio_handle returned -1"
        with pytest.raises(DiskIOError, match=message):
            pager.flush()
        with pytest.raises(DiskIOError, match=message):
            pager.acquire(1)
    finally:
        os.rmdir(path)
        pager.close()
    assert not os.path.exists(pager.run_dir)


def test_deepspeed_reads_back_what_it_wrote_and_checks_a_short_file(tmp_path):
    """Three units through two slots: each comes back from its file as written; a file cut short raises
    (DeepSpeed's op would abort the process on its assert)."""
    _needs_deepspeed(tmp_path)
    pager = PagedState(str(tmp_path), SPECS, window=2, disk_io="deepspeed")
    try:
        assert pager.io.direct and all(pager.io.direct.values())
        for u in (0, 1, 2):  # unit 2 takes unit 0's slot
            with pager.resident(u, write=True) as flats:
                assert torch.count_nonzero(flats["a"]) == 0  # a fresh file reads as zeros
                flats["a"].fill_(u + 0.5)
        read = pager.bytes_read
        with pager.resident(0, write=False) as flats:
            assert torch.equal(flats["a"], torch.full((5000,), 0.5))
        assert pager.bytes_read == read + pager._files[0].nbytes
        f = pager._files[1]
        pager.prefetch([0, 2])  # unit 2 comes back into unit 1's slot (unit 0's is kept)
        with pager.resident(2, write=False) as flats:
            assert torch.equal(flats["a"], torch.full((7,), 2.5))
        assert pager._slot_of(1) is None
        os.truncate(os.path.join(pager.run_dir, f.name), 4096)
        with pytest.raises(DiskIOError, match=rf"reading {f.nbytes} bytes at offset 0 of .*{f.name} failed: "
                                          "the file holds 4096 bytes"):
            pager.acquire(1)
    finally:
        pager.close()


def test_deepspeed_requested_where_it_cannot_run_is_refused_and_auto_falls_back(tmp_path, monkeypatch, caplog):
    """Without deepspeed (simulated: its import fails), disk_io='deepspeed' is refused naming the reason and the
    fix, leaving nothing behind; 'auto' takes the thread pool, logged; 'threads' never imports deepspeed."""
    for name in ["deepspeed", *(n for n in sys.modules if n.startswith("deepspeed."))]:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import deepspeed...` raise ImportError
    monkeypatch.setattr(disk_engines, "_op", None)
    monkeypatch.setattr(disk_engines, "_op_error", None)
    with pytest.raises(DependencyError, match=r"disk_io='deepspeed' cannot be used: deepspeed is not importable "
                                           r"\((ModuleNotFound|Import)Error.*pip install 'megatrain_hf\[aio\]'.*disk_io='threads'"):
        PagedState(str(tmp_path), SPECS, window=2, disk_io="deepspeed")
    assert os.listdir(tmp_path) == []
    with caplog.at_level(logging.INFO, logger="megatrain_hf.optim.disk_engines"):
        pager = PagedState(str(tmp_path), SPECS, window=2, disk_io="auto")
    assert type(pager.io) is DiskIO and "disk_io='auto' uses the thread pool: deepspeed is not importable" in caplog.text
    pager.close()
    with pytest.raises(MegatrainConfigError, match=r"disk_io='libaio'; allowed: 'threads', 'auto', 'deepspeed'"):
        PagedState(str(tmp_path), SPECS, window=2, disk_io="libaio")
    assert os.listdir(tmp_path) == []
    with pytest.raises(MegatrainConfigError, match="disk_io"):
        MegaTrainConfig(disk_io="libaio")

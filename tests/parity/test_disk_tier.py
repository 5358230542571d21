"""The disk tier (``offload_dir``): the AdamW moments in files, paged through a RAM window.

Through Trainer + the plugin the run with the moments on disk must equal the in-RAM run bitwise
(every logged loss and every final parameter): plain, with gradient accumulation, LoRA, resume;
fp32 moments and the compressed ones (``optimizer_state`` "bf16" / "8bit" / "4bit"), both kernels.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess

import pytest
import torch
from tests.helpers import (REPO_ROOT, LogRecorder, RandomTokens, assert_same_state, optimizer_files, state_of, tiny_model, train,
                     training_args)

from megatrain_hf import HostAdamW, MegaTrainConfig, MegaTrainPlugin
from megatrain_hf.core.disk_io import RUN_DIR_PREFIX
from megatrain_hf.optim import native
from megatrain_hf.errors import (BackgroundWorkerError, DiskIOError, DiskSpaceError, IncompatibleOptionsError,
                                  MegatrainConfigError)

KERNELS = ["torch", pytest.param("native", marks=pytest.mark.skipif(native.host_adamw() is None,
                                                                       reason="no C++ compiler"))]


def _run(tmp_path, name, offload_dir=None, model=None, options=None, **args):
    config = MegaTrainConfig(offload_dir=None if offload_dir is None else str(offload_dir),
                             offload_state="moments", **(options or {}))
    model = model if model is not None else tiny_model("llama")
    trainer, losses = train(model, training_args(tmp_path / name, **args), callbacks=[MegaTrainPlugin(config)])
    return trainer, model, losses


@pytest.mark.parametrize("accumulation", [1, 2])
def test_moments_on_disk_equal_the_in_ram_run(tmp_path, accumulation):
    disk = tmp_path / "disk"
    disk.mkdir()
    _, ref, ref_losses = _run(tmp_path, "ram", gradient_accumulation_steps=accumulation)
    trainer, got, losses = _run(tmp_path, "disk", disk, gradient_accumulation_steps=accumulation)
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, HostAdamW) and optimizer.disk_tier is not None
    assert optimizer.moments.in_ram == {}  # no moment lives in RAM outside the window
    assert optimizer.disk_tier.bytes_written >= 6 * optimizer.disk_tier.disk_bytes()  # every unit, every step
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(got))
    run_dir = optimizer.disk_tier.run_dir
    assert os.path.basename(run_dir).startswith(RUN_DIR_PREFIX) and (os.stat(run_dir).st_mode & 0o777) == 0o700
    optimizer.close()
    assert not os.path.exists(run_dir) and os.listdir(disk) == []


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode,accumulation", [("8bit", 1), ("8bit", 2), ("4bit", 1), ("4bit", 2), ("bf16", 1)])
def test_compressed_moments_on_disk_equal_the_in_ram_run(tmp_path, mode, accumulation, kernel):
    """The codes and scales page as bytes: the same mode in RAM and on disk give the same run bitwise."""
    (tmp_path / "disk").mkdir()
    options = dict(optimizer_state=mode, host_adamw_kernel=kernel)
    ram, ref, ref_losses = _run(tmp_path, "ram", options=options, gradient_accumulation_steps=accumulation)
    trainer, got, losses = _run(tmp_path, "disk", tmp_path / "disk", options=options,
                                gradient_accumulation_steps=accumulation)
    optimizer = trainer.optimizer.optimizer
    assert optimizer.kernel == kernel and optimizer.moments.format.mode != "fp32" and optimizer.disk_tier is not None
    assert optimizer.moments.in_ram == {} and optimizer.moments.nbytes() == 0  # no moment in RAM outside the window
    # the plan's bytes of the tier are the files' (one rule: memory/host_tiers.moment_parts, aligned)
    assert got._megatrain_engine.state_tier.disk_bytes == optimizer.disk_tier.disk_bytes()
    assert optimizer.disk_tier.bytes_written >= 6 * optimizer.disk_tier.disk_bytes()  # every unit, every step
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(got))
    # state_dict() expands the paged codes as it expands those in RAM
    a, b = ram.optimizer.optimizer.state_dict()["state"], optimizer.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in a:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[i][key], b[i][key]), (i, key)


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_lora_with_moments_on_disk_equals_the_in_ram_run(tmp_path):
    peft = pytest.importorskip("peft")

    def lora():
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(tiny_model("llama"), config)

    (tmp_path / "disk").mkdir()
    _, ref, ref_losses = _run(tmp_path, "ram", model=lora())
    trainer, got, losses = _run(tmp_path, "disk", tmp_path / "disk", model=lora())
    assert trainer.optimizer.optimizer.disk_tier is not None
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(got))


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
@pytest.mark.parametrize("mode", ["fp32", "8bit", "4bit"])
def test_resume_with_moments_on_disk_equals_the_uninterrupted_in_ram_run(tmp_path, mode):
    """Checkpoints are written from the tier (the same bytes as the in-RAM run's, compressed or not); a fresh
    model resumed from one with the moments on disk ends where the uninterrupted in-RAM run ends."""
    (tmp_path / "disk").mkdir()
    args, options = dict(save_strategy="steps", save_steps=3), dict(optimizer_state=mode)
    _, ref, ref_losses = _run(tmp_path, "ram", options=options, **args)
    _, _, losses = _run(tmp_path, "disk", tmp_path / "disk", options=options, **args)
    assert losses == ref_losses
    shards = optimizer_files(tmp_path / "disk" / "checkpoint-3")
    assert optimizer_files(tmp_path / "ram" / "checkpoint-3") == shards
    assert {meta["optimizer_state"] for meta, _ in shards.values()} == {mode}
    resumed = tiny_model("llama", seed=9)
    config = MegaTrainConfig(offload_dir=str(tmp_path / "disk"), offload_state="moments", **options)
    trainer, resumed_losses = train(resumed, training_args(tmp_path / "disk", **args),
                                    callbacks=[MegaTrainPlugin(config)],
                                    resume=str(tmp_path / "disk" / "checkpoint-3"))
    assert trainer.optimizer.optimizer.disk_tier is not None
    assert resumed_losses == ref_losses[len(ref_losses) // 2:]
    assert_same_state(state_of(ref), state_of(resumed))
    assert optimizer_files(tmp_path / "ram" / "checkpoint-6") == optimizer_files(tmp_path / "disk" / "checkpoint-6")


@pytest.mark.parametrize("mode", ["fp32", "4bit"])
def test_state_dict_and_load_state_dict_go_through_the_tier(tmp_path, mode):
    from megatrain_hf import attach

    def run(offload_dir, steps=2):
        model = tiny_model("llama")
        engine = attach(model, MegaTrainConfig())
        opt = HostAdamW(model.parameters(), engine.store, lr=1e-2, offload_dir=offload_dir, state=mode)
        for seed in range(steps):
            ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    def assert_same(a, b, keys=("step", "exp_avg", "exp_avg_sq")):
        assert a["state"].keys() == b["state"].keys()
        for i in a["state"]:
            for key in keys:
                assert torch.equal(a["state"][i][key], b["state"][i][key]), (i, key)

    (tmp_path / "d").mkdir()
    _, ram = run(None)
    _, disk = run(str(tmp_path / "d"))
    a, b = ram.state_dict(), disk.state_dict()
    assert_same(a, b)
    # a fresh optimizer loads it into the tier (compressed: from the fp32 values, as one in RAM does)
    _, fresh = run(str(tmp_path / "d"), steps=0)
    _, fresh_ram = run(None, steps=0)
    fresh.load_state_dict(a)
    fresh_ram.load_state_dict(a)
    assert_same(fresh_ram.state_dict(), fresh.state_dict())
    if mode == "fp32":
        assert_same(a, fresh.state_dict(), keys=("exp_avg_sq",))
    for opt in (ram, disk, fresh, fresh_ram):
        opt.close()
    assert os.listdir(tmp_path / "d") == []


# ---------------------------------------------------------------------------------- bad inputs
def test_offload_dir_missing_or_a_file_is_refused(tmp_path):
    with pytest.raises(MegatrainConfigError, match=r"offload_dir='.*nope' does not exist\. Fix: create it"):
        MegaTrainConfig(offload_dir=str(tmp_path / "nope"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(MegatrainConfigError, match=r"offload_dir='.*f' is a file, not a directory"):
        MegaTrainConfig(offload_dir=str(tmp_path / "f"))
    with pytest.raises(MegatrainConfigError, match=r"offload_state='masters'; allowed: 'auto', 'moments' or 'all'"):
        MegaTrainConfig(offload_state="masters")
    for bad in (1, 0, True, "4"):
        with pytest.raises(MegatrainConfigError, match=rf"offload_window={bad!r}; allowed: an int >= 2"):
            MegaTrainConfig(offload_window=bad)


def test_offload_dir_with_an_optimizer_that_is_not_adamw_is_refused(tmp_path):
    """The tier pages HostAdamW's moments: with SGD (its own state, in RAM) offload_dir would do nothing."""
    with pytest.raises(IncompatibleOptionsError, match=r"offload_dir='.*' applies to megatrain's HostAdamW, but "
                                         r"the optimizer is SGD\. Fix: train with AdamW"):
        train(tiny_model("llama"), training_args(tmp_path / "sgd", optim="sgd", max_steps=1),
              callbacks=[MegaTrainPlugin(offload_dir=str(tmp_path))])


def test_read_only_offload_dir_is_refused(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() != 0:
        target.chmod(0o500)
    elif subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(target)],
                        capture_output=True).returncode != 0:
        pytest.skip("running as root without permission to mount a read-only filesystem")
    try:
        with pytest.raises(MegatrainConfigError, match=r"offload_dir='.*ro' is not writable by this process "
                                             r"\((no write permission|Read-only file system)\)\. Fix"):
            MegaTrainConfig(offload_dir=str(target))
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(target)], check=True)
        target.chmod(0o700)


def test_a_disk_too_small_is_refused_before_allocating(tmp_path, monkeypatch):
    from megatrain_hf import attach
    from megatrain_hf.memory import disk

    (tmp_path / "d").mkdir()
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**40, 2**40 - 2**29, 2**29))
    model = tiny_model("llama")
    # sizes in the unit that shows them (a tiny model's state is KiB or MiB, not "0.00 GiB")
    with pytest.raises(DiskSpaceError, match=r"disk tier needs [\d.]+ [KM]iB in offload_dir=.* \(\+ 1\.00 GiB headroom\) "
                                             r"but its filesystem has 512\.00 MiB free(.|\n)*short by +5\d\d\.\d\d MiB"):
        attach(model, MegaTrainConfig(offload_dir=str(tmp_path / "d"), offload_state="moments"))
    assert not hasattr(model, "_megatrain_engine") and os.listdir(tmp_path / "d") == []


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
@pytest.mark.parametrize("mode", ["fp32", "8bit"])
def test_auto_puts_the_fewest_units_on_disk_when_ram_is_short(tmp_path, monkeypatch, mode):
    """offload_state='auto': all moments in RAM when they fit; one byte short, the last units' moments go to
    disk (not all of them), and the run still equals the in-RAM run bitwise (the split counts the moments
    in their format: 8-bit ones are a quarter of fp32's)."""
    from megatrain_hf import attach
    from megatrain_hf.memory import host

    (tmp_path / "d").mkdir()
    config = MegaTrainConfig(offload_dir=str(tmp_path / "d"), optimizer_state=mode)
    layers = dict(num_hidden_layers=8)
    assert attach(tiny_model("llama", **layers), config).state_tier.on_disk is False  # RAM is plenty
    model = tiny_model("llama", **layers)
    units = [(n, m) for n, m in zip(*_located(model))]
    needed = sum(host.host_breakdown_for_units(units, compute_dtype=torch.float32, staging=False,
                                               optimizer_state=mode).values())
    current = sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setattr(host, "available_host_bytes", lambda: host.DEFAULT_HEADROOM_BYTES + needed - 1 - current)
    trainer, losses = train(model, training_args(tmp_path / "auto"), callbacks=[MegaTrainPlugin(config)])
    tier = trainer.optimizer.optimizer.disk_tier
    assert 0 < len(tier.units) < len(units) - 1 and max(tier.units) == len(units) - 1  # the last units
    moments = trainer.optimizer.optimizer.moments
    # the other units' moments (fp32 flats, or codes and scales) are in RAM, the paged ones' are not
    assert moments.in_ram and set(moments.in_ram).isdisjoint(tier.units)
    monkeypatch.undo()
    _, ref, ref_losses = _run(tmp_path, "ram", model=tiny_model("llama", **layers), options=dict(optimizer_state=mode))
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(model))


def _located(model):
    from megatrain_hf.models.families import family_of

    located = family_of(model).locate(model)
    return located.names, located.modules


@pytest.mark.parametrize("call,code,what", [("pwritev", errno.ENOSPC, "writing"), ("preadv", errno.EIO, "reading")])
def test_an_io_error_mid_run_raises_in_the_training_thread(tmp_path, monkeypatch, call, code, what):
    """A full disk or an I/O error mid-run (from pwritev / preadv in a pool thread) stops training promptly,
    naming the file and the bytes; the pool thread does not swallow it and nothing hangs."""
    from transformers import TrainerCallback

    from megatrain_hf.core import disk_io

    real = getattr(os, call)
    full = {"on": False}

    def failing(fd, buffers, offset):
        if full["on"]:
            raise OSError(code, os.strerror(code))
        return real(fd, buffers, offset)

    class FillTheDisk(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            full["on"] = state.global_step >= 2

    monkeypatch.setattr(disk_io.os, call, failing)
    (tmp_path / "d").mkdir()
    config = MegaTrainConfig(offload_dir=str(tmp_path / "d"), offload_state="moments")
    with pytest.raises((DiskIOError, BackgroundWorkerError)) as info:
        train(tiny_model("llama"), training_args(tmp_path / "run"), callbacks=[MegaTrainPlugin(config), FillTheDisk()])
    text = str(info.value) + str(info.value.__cause__)
    reason = r"No space left on device \(the disk is full" if code == errno.ENOSPC else "Input/output error"
    assert re.search(rf"{what} \d+ bytes at offset \d+ of .*/megatrain-state-[^/]+/unit-\d{{5}}\.state failed: "
                     + reason, text), text


_KILLED_CHILD = """
import os, signal, sys
sys.path.insert(0, {root!r})
from transformers import TrainerCallback
from tests.helpers import tiny_model, train, training_args
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin
from megatrain_hf.core import disk_io

real, armed = os.pwritev, []
def pwritev(fd, buffers, offset):  # SIGKILL in the middle of step 5's write-back (after its first piece)
    if armed and len(armed) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    armed and armed.append(1)
    return real(fd, buffers, offset)
disk_io.os.pwritev = pwritev

class Arm(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 4:
            armed.append(1)

config = MegaTrainConfig(offload_dir={disk!r}, offload_state="moments")
train(tiny_model("llama"), training_args({out!r}, save_strategy="steps", save_steps=2),
      callbacks=[MegaTrainPlugin(config), Arm()])
"""


@pytest.mark.slow  # ~20 s: a child process trains until it is killed
def test_sigkill_during_write_back_then_resume_equals_the_uninterrupted_run(tmp_path):
    import sys

    disk, out = tmp_path / "disk", tmp_path / "run"
    disk.mkdir()
    code = _KILLED_CHILD.format(root=str(REPO_ROOT), disk=str(disk), out=str(out))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]
    _, ref, ref_losses = _run(tmp_path, "ram")
    resumed = tiny_model("llama", seed=9)
    config = MegaTrainConfig(offload_dir=str(disk), offload_state="moments")
    _, losses = train(resumed, training_args(out, save_strategy="steps", save_steps=2),
                      callbacks=[MegaTrainPlugin(config)], resume=str(out / "checkpoint-4"))
    assert losses == ref_losses[8:]
    assert_same_state(state_of(ref), state_of(resumed))
    # the killed run's directory was removed by the next run's start (its process is gone): only this
    # process's (the resumed run's, removed when its optimizer goes) is left
    assert [name.split("-")[2] for name in os.listdir(disk)] == [str(os.getpid())]


def test_the_run_directory_is_removed_on_ctrl_c(tmp_path):
    import sys

    code = ("import torch\nfrom megatrain_hf.optim.paged_state import PagedState\n"
            f"p = PagedState({str(tmp_path)!r}, {{0: {{'exp_avg': (1000, torch.float32)}}}})\n"
            "import os; assert os.listdir(p.run_dir) == ['unit-00000.state']\n"
            "raise KeyboardInterrupt\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "KeyboardInterrupt" in child.stderr and child.returncode != 0
    assert os.listdir(tmp_path) == []


def test_init_offload_dir_trains_with_the_moments_on_disk(tmp_path):
    import megatrain_hf as mt

    (tmp_path / "d").mkdir()
    config = mt.init(offload_dir=str(tmp_path / "d"), offload_state="moments")
    try:
        assert config.offload_dir == str(tmp_path / "d")
        logs = LogRecorder()
        trainer = mt.Trainer(model=tiny_model("llama"), args=training_args(tmp_path / "run", max_steps=2),
                             train_dataset=RandomTokens(), callbacks=[logs])
        trainer.train()
        tier = trainer.optimizer.optimizer.disk_tier
        assert tier is not None
        steps = [log for log in logs.logs if "loss" in log]
        # the logs count the bytes moved so far (the update runs behind them); with what is left: all of it.
        # Each step writes every unit back once; it reads those not still in a slot
        logged = sum(round(log["megatrain/disk_GB"] * 1e9) for log in steps)
        assert logged + sum(tier.take_io_stats()) == tier.bytes_read + tier.bytes_written
        assert tier.bytes_written == 2 * tier.disk_bytes() and 0 < tier.bytes_read <= tier.bytes_written
        assert len(steps) == 2 and all("megatrain/disk_GBps" in log for log in steps)
    finally:
        mt.disable()


def test_estimate_prints_the_disk_tier(tmp_path, capsys):
    import json

    from megatrain_hf.cli.estimate import estimate_main
    from megatrain_hf.memory.plan import plan_memory
    from megatrain_hf.memory.shapes import PRESETS

    assert estimate_main(["--model", "llama-7b", "--offload-dir", str(tmp_path), "--disk-gib", "60",
                          "--host-gib", "80", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["disk_tier"]
    plan = plan_memory(PRESETS["llama-7b"], seq_len=4096, micro_batch=1, grad_accum=1)
    moments = plan.host_exp_avg + plan.host_exp_avg_sq
    assert moments <= d["disk_bytes"] < moments + 2 * 4096 * (PRESETS["llama-7b"].layers + 3)
    assert d["read_per_step_bytes"] == d["written_per_step_bytes"] == d["disk_bytes"]
    assert d["host_ram_bytes"] == plan.host_total - moments + d["ram_window_bytes"]
    assert d["fits"] is True and d["disk_free_bytes"] == 60 * 2**30
    # the largest depth: one more layer would overflow RAM or disk
    assert estimate_main(["--model", "llama-7b", "--disk-gib", "20", "--host-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "-> does NOT fit" in out and "TB written per 1000 steps" in out
    layers = int(re.search(r"largest depth that fits RAM \+ disk: (\d+) layers", out).group(1))
    assert 0 < layers < 32
    assert estimate_main(["--model", "llama-7b", "--offload-dir", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # offload_window: the RAM window is that many slots of the largest unit's state
    assert estimate_main(["--model", "llama-7b", "--offload-dir", str(tmp_path), "--disk-gib", "60",
                          "--host-gib", "80", "--offload-window", "2", "--json"]) == 0
    two = json.loads(capsys.readouterr().out)["disk_tier"]
    assert two["window_slots"] == 2 and d["window_slots"] == 4 and 2 * two["ram_window_bytes"] == d["ram_window_bytes"]
    assert two["host_ram_bytes"] == d["host_ram_bytes"] - two["ram_window_bytes"]
    assert estimate_main(["--model", "llama-7b", "--offload-dir", str(tmp_path), "--offload-window", "1"]) == 2
    assert "--offload-window 1" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_estimate_prints_the_compressed_disk_tier(tmp_path, capsys, mode):
    """With --optimizer-state the tier holds the compressed moments: their bytes (codes and scales, each
    tensor aligned), not fp32's; and the deepest model that fits RAM + disk grows."""
    import json

    from megatrain_hf.cli.estimate import estimate_main
    from megatrain_hf.memory.plan import plan_memory
    from megatrain_hf.memory.shapes import PRESETS

    argv = ["--model", "llama-7b", "--offload-dir", str(tmp_path), "--disk-gib", "20", "--host-gib", "80"]
    assert estimate_main(argv + ["--json", "--optimizer-state", mode]) == 0
    d = json.loads(capsys.readouterr().out)["disk_tier"]
    plan = plan_memory(PRESETS["llama-7b"], seq_len=4096, micro_batch=1, grad_accum=1, optimizer_state=mode)
    moments = plan.host_exp_avg + plan.host_exp_avg_sq
    assert d["optimizer_state"] == mode and moments < 2.1 / 8 * PRESETS["llama-7b"].params() * 8
    assert moments <= d["disk_bytes"] < moments + 4 * 4096 * (PRESETS["llama-7b"].layers + 3)
    assert d["read_per_step_bytes"] == d["written_per_step_bytes"] == d["disk_bytes"]
    assert d["host_ram_bytes"] == plan.host_total - moments + d["ram_window_bytes"]
    assert d["fits"] is True  # 20 GiB of disk: too small for fp32's 50 GiB of moments
    assert estimate_main(argv) == 0
    fp32 = capsys.readouterr().out
    assert estimate_main(argv + ["--optimizer-state", mode]) == 0
    out = capsys.readouterr().out
    assert f"disk: AdamW moments (exp_avg + exp_avg_sq, {mode})" in out and "exp_avg_sq, fp32)" in fp32
    deepest = [int(re.search(r"largest depth that fits RAM \+ disk: (\d+) layers", o).group(1)) for o in (fp32, out)]
    assert deepest[0] < deepest[1]


def test_the_engine_falls_back_to_buffered_io_where_o_direct_is_refused(tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT (older tmpfs kernels; simulated: open() with the flag fails
    with EINVAL) gets buffered I/O, with the same results; one that takes it gets O_DIRECT."""
    from megatrain_hf.core import disk_io
    from megatrain_hf.optim.paged_state import PagedState

    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    for refuse in (False, True):
        if refuse:
            monkeypatch.setattr(disk_io.os, "open", refusing_open)
        specs = {0: {"a": (5000, torch.float32)}, 1: {"a": (3, torch.float32)}, 2: {"a": (7, torch.float32)}}
        pager = PagedState(str(tmp_path), specs, window=2)
        try:
            assert set(pager.io.direct.values()) == {not refuse}
            for u in (0, 1, 2):  # unit 2 takes unit 0's slot (2 slots)
                with pager.resident(u, write=True) as flats:
                    assert torch.count_nonzero(flats["a"]) == 0  # a fresh file reads as zeros
                    flats["a"].fill_(u + 1.5)
            read = pager.bytes_read
            with pager.resident(0, write=False) as flats:  # read back from its file
                assert torch.equal(flats["a"], torch.full((5000,), 1.5))
            assert pager.bytes_read == read + 20480
        finally:
            pager.close()
        assert not os.path.exists(pager.run_dir)


def test_stale_run_directories_are_removed_only_when_their_process_is_gone(tmp_path):
    from megatrain_hf.core.disk_io import remove_stale_run_dirs

    child = subprocess.Popen(["sleep", "0"])
    child.wait()  # a pid that no longer runs
    dead = tmp_path / f"{RUN_DIR_PREFIX}{child.pid}-abc"
    alive = tmp_path / f"{RUN_DIR_PREFIX}{os.getpid()}-def"
    foreign = tmp_path / f"{RUN_DIR_PREFIX}{child.pid}-ghi"  # holds a file the tier never writes
    for d in (dead, alive, foreign):
        d.mkdir()
        (d / "unit-00000.state").write_bytes(b"x")
    (foreign / "notes.txt").write_text("mine")
    assert remove_stale_run_dirs(str(tmp_path)) == [str(dead)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, foreign.name])


def test_the_disk_check_counts_the_space_of_stale_run_directories_as_free(tmp_path, monkeypatch):
    """A run killed without its exit handlers (SIGKILL, os._exit) leaves its files; the next run's plan measures the
    free space after removing them, so they do not make it refuse."""
    from megatrain_hf.memory import disk

    child = subprocess.Popen(["sleep", "0"])
    child.wait()
    dead = tmp_path / f"{RUN_DIR_PREFIX}{child.pid}-abc"
    dead.mkdir()
    (dead / "unit-00000.state").write_bytes(b"x" * 4096)
    seen = []
    monkeypatch.setattr(disk, "disk_free_bytes", lambda path: seen.append(os.listdir(path)) or 10 * 2**30)
    disk.check_disk(str(tmp_path), 2**30)
    assert seen == [[]] and not dead.exists()

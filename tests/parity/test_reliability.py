"""Reliability: sharded optimizer checkpoints, atomic saves (SIGKILL mid-save), non-finite gradients,
failures of the background update thread, crafted pickles, and a CPU soak (memory, threads).

CPU, fp32: resumed runs must continue exactly like uninterrupted ones (1e-6, as the parity tests).
"""

from __future__ import annotations

from tests.helpers import REPO_ROOT
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tests.helpers import (
    LogRecorder,
    RandomTokens,
    assert_close_losses,
    assert_close_params,
    state_of,
    tiny_model,
    train,
    training_args,
)
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from megatrain_hf import HostAdamW, MegaTrainPlugin, attach, engine_of
from megatrain_hf.optim.state_files import OPTIMIZER_DIR, to_torch_state_dict
from megatrain_hf.errors import BackgroundWorkerError, UnreadableCheckpointError

ATOL = 1e-6
ROOT = REPO_ROOT


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (TimeoutError) instead of hanging the test session."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: something hangs")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _staging_dirs(run_dir) -> list[str]:
    return sorted(n for n in os.listdir(run_dir) if n.startswith(".checkpoint-"))


# ---------------------------------------------------------------------------------- sharded checkpoints
def test_sharded_optimizer_checkpoint_and_save_total_limit(tmp_path):
    args = dict(save_strategy="steps", save_steps=2, save_total_limit=2)
    full = tiny_model("llama")
    trainer, full_losses = train(full, training_args(tmp_path / "run", **args), callbacks=[MegaTrainPlugin()])

    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4", "checkpoint-6"]  # rotation, no leftovers
    ckpt = run / "checkpoint-6"
    assert not (ckpt / "optimizer.pt").exists()
    optimizer = trainer.optimizer.optimizer
    shards = sorted(p.name for p in (ckpt / OPTIMIZER_DIR).iterdir())
    assert shards == [f"unit-{u:05d}.safetensors" for u in optimizer.units]
    from safetensors import safe_open

    with safe_open(str(ckpt / OPTIMIZER_DIR / shards[1]), framework="pt") as f:
        assert set(f.keys()) == {"exp_avg", "exp_avg_sq"}
        meta = f.metadata()
        assert meta["format"] == "megatrain-hostadamw-v1"
        steps = json.loads(meta["steps"])  # one count per parameter of each group
        assert set(steps) == {"0", "1"} and all(v == 6.0 for counts in steps.values() for v in counts)
        assert json.loads(meta["param_groups"])[0]["weight_decay"] == 0.1
    # the torch AdamW layout can be rebuilt from the shards (export for plain Trainer)
    expected = optimizer.state_dict()
    converted = to_torch_state_dict(str(ckpt / OPTIMIZER_DIR))
    assert converted["param_groups"] == expected["param_groups"]
    assert converted["state"].keys() == expected["state"].keys()
    for i, s in expected["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s[key], converted["state"][i][key]), (i, key)

    resumed = tiny_model("llama", seed=123)  # everything must come from the checkpoint
    _, resumed_losses = train(
        resumed, training_args(run, **args), callbacks=[MegaTrainPlugin()], resume=str(run / "checkpoint-4")
    )
    assert_close_losses(full_losses[8:], resumed_losses, ATOL)
    assert_close_params(state_of(full), state_of(resumed), ATOL)


def test_sharded_checkpoint_with_lora(tmp_path):
    """Under PEFT only some units hold trainable parameters (adapters): the shards cover those."""
    peft = pytest.importorskip("peft")

    def lora(model):
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(model, config)

    args = dict(save_strategy="steps", save_steps=3)
    full = lora(tiny_model("llama"))
    trainer, full_losses = train(full, training_args(tmp_path / "run", **args), callbacks=[MegaTrainPlugin()])
    folder = tmp_path / "run" / "checkpoint-6" / OPTIMIZER_DIR
    optimizer = trainer.optimizer.optimizer
    assert sorted(p.name for p in folder.iterdir()) == [f"unit-{u:05d}.safetensors" for u in optimizer.units]
    assert 0 not in optimizer.units  # the embedding is frozen
    expected, converted = optimizer.state_dict(), to_torch_state_dict(str(folder))
    assert converted["param_groups"] == expected["param_groups"]
    for i, s in expected["state"].items():
        assert all(torch.equal(s[k], converted["state"][i][k]) for k in ("step", "exp_avg", "exp_avg_sq")), i

    resumed = lora(tiny_model("llama"))
    _, losses = train(
        resumed, training_args(tmp_path / "run", **args), callbacks=[MegaTrainPlugin()],
        resume=str(tmp_path / "run" / "checkpoint-3"),
    )
    assert_close_losses(full_losses[6:], losses, ATOL)
    assert_close_params(state_of(full), state_of(resumed), ATOL)


def test_single_file_optimizer_checkpoints_in_both_directions(tmp_path):
    """A plain Trainer checkpoint (optimizer.pt) resumes under megatrain, and a converted megatrain
    checkpoint resumes under plain Trainer; both continue exactly like the uninterrupted plain run."""
    args = dict(save_strategy="steps", save_steps=3)
    ref = tiny_model("llama")
    _, ref_losses = train(ref, training_args(tmp_path / "plain", **args))
    assert (tmp_path / "plain" / "checkpoint-3" / "optimizer.pt").is_file()

    resumed = tiny_model("llama", seed=5)
    _, losses = train(
        resumed,
        training_args(tmp_path / "plain", **args),
        callbacks=[MegaTrainPlugin()],
        resume=str(tmp_path / "plain" / "checkpoint-3"),
    )
    assert_close_losses(ref_losses[6:], losses, ATOL)
    assert_close_params(state_of(ref), state_of(resumed), ATOL)

    mt = tiny_model("llama")
    train(mt, training_args(tmp_path / "mt", **args), callbacks=[MegaTrainPlugin()])
    ckpt = tmp_path / "mt" / "checkpoint-3"
    torch.save(to_torch_state_dict(str(ckpt / OPTIMIZER_DIR)), ckpt / "optimizer.pt")
    plain = tiny_model("llama", seed=5)
    _, plain_losses = train(plain, training_args(tmp_path / "mt", **args), resume=str(ckpt))
    assert_close_losses(ref_losses[6:], plain_losses, ATOL)
    assert_close_params(state_of(ref), state_of(plain), ATOL)


def test_load_best_model_at_end(tmp_path):
    args = dict(
        max_steps=8,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,  # "best" = highest eval loss: an early checkpoint, so loading it matters
    )
    eval_ds = RandomTokens(n=8, seed=7)
    ref = tiny_model("llama")
    ref_trainer, _ = train(ref, training_args(tmp_path / "ref", **args), eval_dataset=eval_ds)
    model = tiny_model("llama")
    trainer, _ = train(
        model, training_args(tmp_path / "mt", **args), eval_dataset=eval_ds, callbacks=[MegaTrainPlugin()]
    )

    best = Path(trainer.state.best_model_checkpoint)
    assert best.parent == tmp_path / "mt" and best.is_dir()
    assert best.name == Path(ref_trainer.state.best_model_checkpoint).name != "checkpoint-8"
    assert sorted(p.name for p in (tmp_path / "mt").iterdir()) == sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert_close_params(state_of(ref), state_of(model), ATOL)
    saved = json.loads((best / "trainer_state.json").read_text())
    assert saved["best_model_checkpoint"] == str(best)  # the real path, not the staging folder's


# ---------------------------------------------------------------------------------- atomic saves
@pytest.mark.parametrize("stage", ["model", "optimizer", "trainer_state"])
def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch, stage):
    import safetensors.torch
    from transformers import TrainerState

    run = tmp_path / "run"
    model = tiny_model("llama")
    trainer = Trainer(
        model=model,
        args=training_args(run, max_steps=4, save_strategy="steps", save_steps=1),
        train_dataset=RandomTokens(),
        callbacks=[MegaTrainPlugin()],
    )

    def fail_at_step_3(original, after=False):
        def wrapper(*args, **kwargs):
            if trainer.state.global_step == 3 and not after:
                raise OSError(f"disk full while saving the {stage}")
            result = original(*args, **kwargs)
            if trainer.state.global_step == 3:
                raise OSError(f"disk full after saving the {stage}")
            return result

        return wrapper

    if stage == "model":  # the weights are written, nothing else yet
        trainer.save_model = fail_at_step_3(trainer.save_model, after=True)
    elif stage == "optimizer":  # the second unit's shard
        save_file = safetensors.torch.save_file
        failing = fail_at_step_3(save_file)
        monkeypatch.setattr(
            safetensors.torch,
            "save_file",
            lambda t, path, **kw: (failing if "unit-00001" in path else save_file)(t, path, **kw),
        )
    else:
        monkeypatch.setattr(TrainerState, "save_to_json", fail_at_step_3(TrainerState.save_to_json))
    with pytest.raises(OSError, match="disk full"):
        trainer.train()
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-2")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "checkpoint-2"]  # no partial folder
    monkeypatch.undo()
    resumed = tiny_model("llama", seed=9)
    trainer, _ = train(
        resumed, training_args(run, max_steps=4, save_strategy="steps", save_steps=1), callbacks=[MegaTrainPlugin()],
        resume=True,
    )
    assert trainer.state.global_step == 4 and (run / "checkpoint-4").is_dir()


_KILL_SCRIPT = r'''
import os, sys, time
import safetensors.torch
import torch
from tests.helpers import state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainPlugin

out, mode = sys.argv[1], sys.argv[2]
slow_step = int(os.environ.get("SLOW_SAVE_AT_STEP", "0"))
trainer_ref = []
save_file = safetensors.torch.save_file

def slow_save_file(tensors, path, **kwargs):
    save_file(tensors, path, **kwargs)
    # the test's hook: stall in the middle of the optimizer shards of one checkpoint (model saved already)
    if slow_step and "unit-00001" in path and trainer_ref and trainer_ref[0].state.global_step == slow_step:
        print("STALLED IN SAVE", flush=True)
        time.sleep(300)

safetensors.torch.save_file = slow_save_file

from transformers import Trainer
init = Trainer.__init__
def grab_init(self, *a, **k):
    init(self, *a, **k)
    trainer_ref.append(self)
Trainer.__init__ = grab_init

model = tiny_model("llama", seed=0 if mode == "fresh" else 77)
args = training_args(out, max_steps=6, save_strategy="steps", save_steps=1)
_, losses = train(model, args, callbacks=[MegaTrainPlugin()], resume=True if mode == "resume" else None)
torch.save({"losses": losses, "params": state_of(model)}, os.path.join(out, f"result-{mode}.pt"))
print("DONE", flush=True)
'''


@pytest.mark.slow
def test_sigkill_during_save_keeps_previous_checkpoint_resumable(tmp_path):
    script = tmp_path / "train_and_save.py"
    script.write_text(_KILL_SCRIPT)
    run = tmp_path / "run"
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, PYTHONPATH=path, SLOW_SAVE_AT_STEP="4")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run), "fresh"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    try:
        with deadline(180):
            for line in proc.stdout:
                lines.append(line)
                if "STALLED IN SAVE" in line:
                    break
        assert "STALLED IN SAVE" in "".join(lines), "".join(lines[-40:])
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    # checkpoint-4 was being written: it must not look like a checkpoint; checkpoint-3 is intact
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-3")
    assert not (run / "checkpoint-4").exists()
    assert _staging_dirs(run) == [f".checkpoint-4.tmp-{proc.pid}"]

    env.pop("SLOW_SAVE_AT_STEP")
    resumed = subprocess.run(
        [sys.executable, str(script), str(run), "resume"], capture_output=True, text=True, env=env, timeout=300,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    got = torch.load(run / "result-resume.pt", weights_only=True)
    assert _staging_dirs(run) == []  # the killed process's leftover was cleaned up by the next save
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-6")

    full = tiny_model("llama")
    _, full_losses = train(full, training_args(tmp_path / "full", max_steps=6), callbacks=[MegaTrainPlugin()])
    assert_close_losses(full_losses[6:], got["losses"], ATOL)  # steps 4-6, two micro-batches each
    assert_close_params(state_of(full), got["params"], ATOL)


# ---------------------------------------------------------------------------------- non-finite gradients
class _NanAtCall:
    """Multiplies the loss of the model's ``index``-th training forward by nan."""

    def __init__(self, model, index: int) -> None:
        self.calls, self.index = 0, index
        model.register_forward_hook(self)

    def __call__(self, module, args, output):
        if module.training:
            self.calls += 1
            if self.calls == self.index:
                output["loss"] = output["loss"] * float("nan")
        return output


class _Snapshots(TrainerCallback):
    def __init__(self, model) -> None:
        self.model, self.params = model, {}

    def on_step_end(self, args, state, control, **kwargs):
        engine_of(self.model).synchronize()  # HostAdamW updates in the background
        self.params[state.global_step] = state_of(self.model)


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0])  # 0.0: Trainer measures the norm without clipping
def test_nan_gradient_skips_the_step(tmp_path, caplog, max_grad_norm):
    nan_call = 5  # first micro-batch of optimizer step 3 (two micro-batches per step)
    model = tiny_model("llama")
    _NanAtCall(model, nan_call)
    snaps, logs = _Snapshots(model), LogRecorder()
    with caplog.at_level("WARNING", logger="megatrain_hf"):
        trainer, _ = train(model, training_args(tmp_path / "mt", max_grad_norm=max_grad_norm),
                           callbacks=[MegaTrainPlugin(metrics="all"), snaps, logs])
    assert trainer.state.global_step == 6
    for name, before in snaps.params[2].items():
        assert torch.equal(before, snaps.params[3][name]), name  # step 3 skipped: untouched
    assert any(not torch.equal(snaps.params[3][n], snaps.params[4][n]) for n in snaps.params[3])  # trains on
    assert all(torch.isfinite(p).all() for p in snaps.params[6].values())
    assert "non-finite gradient norm (nan) at optimizer step 3" in caplog.text
    optimizer = trainer.optimizer.optimizer
    assert optimizer.skipped_steps == 1
    assert {float(optimizer.state[p]["step"]) for g in optimizer.param_groups for p in g["params"]} == {5.0}  # 6 steps, one skipped
    logged = [h["megatrain/skipped_steps"] for h in logs.logs if "megatrain/skipped_steps" in h]
    assert logged[:2] == [0.0, 0.0] and logged[2:] == [1.0] * 4

    # what plain Trainer + torch AdamW do with the same batch: the weights become nan
    ref = tiny_model("llama")
    _NanAtCall(ref, nan_call)
    train(ref, training_args(tmp_path / "ref", max_grad_norm=max_grad_norm))
    assert all(torch.isnan(p).all() for p in ref.parameters())


# ---------------------------------------------------------------------------------- background failures
def _failing_adamw(monkeypatch, after_calls: int, message: str = "injected AdamW failure"):
    """Make torch._fused_adamw_ raise from its ``after_calls``-th call on (HostAdamW's worker thread)."""
    original = torch._fused_adamw_
    calls = [0]

    def fused(*args, **kwargs):
        calls[0] += 1
        if calls[0] > after_calls:
            raise RuntimeError(message)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", fused)
    return calls


def test_update_thread_error_surfaces_in_training(tmp_path, monkeypatch):
    model = tiny_model("llama")
    trainer = Trainer(
        model=model, args=training_args(tmp_path), train_dataset=RandomTokens(), callbacks=[MegaTrainPlugin()]
    )
    calls = _failing_adamw(monkeypatch, after_calls=8)  # fails inside the second optimizer step
    started = time.perf_counter()
    with deadline(60), pytest.raises(BackgroundWorkerError, match="background update failed.*injected AdamW failure"):
        trainer.train()
    assert calls[0] > 8
    assert trainer.state.global_step == 2  # raised at the next forward, not steps later
    assert time.perf_counter() - started < 30


def _attached_step(monkeypatch, fail: bool):
    model = tiny_model("llama")
    engine = attach(model, device="cpu")
    optimizer = HostAdamW(model.parameters(), engine.store, lr=1e-3)
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    if fail:
        _failing_adamw(monkeypatch, after_calls=0, message="injected store error")
    return model, engine, optimizer, ids


def test_engine_synchronize_raises_update_error(monkeypatch):
    model, engine, optimizer, ids = _attached_step(monkeypatch, fail=True)
    optimizer.step()  # returns at once; the update fails in the background
    with deadline(10), pytest.raises(BackgroundWorkerError, match="background update failed.*injected store error"):
        engine.synchronize()
    monkeypatch.undo()
    engine.synchronize()  # reported once
    optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    engine.synchronize()
    optimizer.close()
    engine.detach()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_update_thread_does_not_hang(monkeypatch):
    model, engine, optimizer, ids = _attached_step(monkeypatch, fail=False)

    def die(job):
        raise SystemExit  # ends the worker thread without running the update or releasing the unit

    optimizer.scheduler._drain = die
    optimizer.step()
    with deadline(20):
        with pytest.raises(BackgroundWorkerError, match="ended before finishing its update"):
            engine.synchronize()
        with pytest.raises(BackgroundWorkerError, match="worker thread died"):
            optimizer.synchronize()
        optimizer.scheduler.board.pending = 0
        with pytest.raises(BackgroundWorkerError, match="worker thread is not running"):
            optimizer.step()
        with torch.no_grad():
            model(input_ids=ids)  # units were released: reading the weights does not block
    engine.detach()


def test_dead_gradient_worker_raises_instead_of_blocking():
    """A send waiting for room in the gradient queue raises when the worker died with units still
    queued, instead of blocking forever (the bound itself: tests/unit/core/test_grads.py)."""
    from megatrain_hf.core.grad_landing import MAX_PENDING_SENDS
    from megatrain_hf.core.streams import EmulatedStreams

    engine = attach(tiny_model("llama"), device="cpu", streams=EmulatedStreams())
    landing = engine.grads.landing  # the grad stream's landing: its worker thread lands the copies
    landing.close()
    landing._pending = MAX_PENDING_SENDS
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    landing._worker = dead  # the worker ended with units still queued
    with deadline(20), pytest.raises(BackgroundWorkerError, match="gradient worker died"):
        landing.wait(0)
    landing._worker, landing._pending = None, 0
    engine.detach()


# ---------------------------------------------------------------------------------- security
class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_pickles_in_a_checkpoint_are_refused(tmp_path):
    import shutil

    args = dict(max_steps=3, save_strategy="steps", save_steps=3)
    train(tiny_model("llama"), training_args(tmp_path / "run", **args), callbacks=[MegaTrainPlugin()])
    ckpt = tmp_path / "run" / "checkpoint-3"
    marker = tmp_path / "pwned"

    def resume():
        train(
            tiny_model("llama"), training_args(tmp_path / "run", **args), callbacks=[MegaTrainPlugin()],
            resume=str(ckpt),
        )

    scheduler = (ckpt / "scheduler.pt").read_bytes()
    torch.save(_Evil(marker), ckpt / "scheduler.pt")
    with pytest.raises(UnreadableCheckpointError,
                       match=r"refused to load scheduler\.pt of .*nothing from the file was"):
        resume()
    assert not marker.exists()

    (ckpt / "scheduler.pt").write_bytes(scheduler)
    shutil.rmtree(ckpt / OPTIMIZER_DIR)  # the older single-file format
    torch.save({"state": _Evil(marker), "param_groups": []}, ckpt / "optimizer.pt")
    with pytest.raises(UnreadableCheckpointError, match=r"refused to load optimizer\.pt .*nothing from the file was"):
        resume()
    assert not marker.exists()
    # the payload is live: an unsafe load would have run it
    torch.load(ckpt / "optimizer.pt", weights_only=False)
    assert marker.exists()


# ---------------------------------------------------------------------------------- soak
class _Sampler(TrainerCallback):
    def __init__(self, every: int) -> None:
        import psutil

        self.process, self.every, self.samples = psutil.Process(), every, {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self.samples[state.global_step] = (
                self.process.memory_info().rss,
                sorted(t.name for t in threading.enumerate()),
                self.process.num_fds(),
            )


@pytest.mark.slow
def test_soak_500_steps_memory_and_threads_flat(tmp_path):
    gc.collect()  # engines of earlier tests caught in reference cycles end their threads now
    time.sleep(0.5)
    before = sum(t.name == "megatrain-adamw" for t in threading.enumerate())
    sampler = _Sampler(every=50)
    model = tiny_model("llama")
    started = time.perf_counter()
    trainer, _ = train(
        model,
        training_args(
            tmp_path, max_steps=500, gradient_accumulation_steps=1, per_device_train_batch_size=1,
            logging_steps=50, warmup_steps=0, lr_scheduler_type="constant", learning_rate=1e-4,
            save_strategy="steps", save_steps=100, save_total_limit=1,
        ),
        callbacks=[MegaTrainPlugin(), sampler],
        dataset=RandomTokens(n=64),
    )
    elapsed = time.perf_counter() - started
    samples = sampler.samples
    assert sorted(samples) == list(range(50, 501, 50))
    growth = samples[500][0] - samples[100][0]
    mib = {s: round(v[0] / 2**20, 1) for s, v in samples.items()}
    assert growth < 20 * 2**20, f"host RSS grew by {growth / 2**20:.1f} MiB between steps 100 and 500: {mib}"
    # after warm-up (the first save at step 100 starts tqdm's monitor thread): no new threads, no new fds
    threads = {s: v[1] for s, v in samples.items()}
    assert all(threads[s] == threads[150] for s in range(150, 501, 50)), f"threads changed: {threads}"
    assert threads[150].count("megatrain-adamw") == before + 1
    assert samples[500][2] <= samples[150][2], f"open file descriptors grew: {samples}"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.optimizer.optimizer.skipped_steps == 0
    print(f"soak: 500 steps in {elapsed:.1f} s; RSS MiB by step {mib}")


@pytest.mark.slow
def test_soak_script_smoke(tmp_path):
    """scripts/gpu_soak.py (the H200 soak of the reliability issue) runs and judges flatness (CPU, tiny)."""
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "scripts/gpu_soak.py", "--model", "tiny", "--device", "cpu", "--dtype", "fp32",
         "--steps", "40", "--every", "10", "--from-step", "20", "--save-steps", "20", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["ok"] and sorted(map(int, result["samples"])) == [10, 20, 30, 40]
    assert set(result["checks"]) >= {"host_rss_flat", "threads_flat", "fds_flat", "finite_parameters"}

"""The fp32 masters on disk (``offload_state="all"``): the matrices' masters in each unit's state file
next to its moments, paged with them; the parameters alias a mapping of the file.

Through Trainer + the plugin, bf16 compute on the CPU: every logged loss and every final parameter
equal the in-RAM run's bitwise (plain, gradient accumulation, resume, 8-bit moments), the saved model
and checkpoints too; the plan's disk bytes are the files'; impossible combinations are refused.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from tests.helpers import assert_same_state, optimizer_files, state_of, tiny_model, train, training_args

from megatrain_hf import MegaTrainConfig, MegaTrainPlugin
from megatrain_hf.optim import native
from megatrain_hf.errors import IncompatibleOptionsError

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
    assert engine.state_tier.disk_bytes == optimizer.disk_tier.disk_bytes()
    assert optimizer.disk_tier.bytes_written >= 6 * optimizer.disk_tier.disk_bytes()
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(got))
    assert optimizer.disk_tier is store.tier_files.pager  # the files the engine made at attach, adopted
    run_dir = optimizer.disk_tier.run_dir
    optimizer.close()
    assert os.path.exists(run_dir)  # they hold the masters: the engine's until it detaches
    engine.detach()
    assert not os.path.exists(run_dir)
    assert_same_state(state_of(ref), state_of(got))  # still readable after the files are removed


def _step(model, opt, seed: int) -> float:
    """One optimizer step of a hand-written loop on random tokens drawn from ``seed``; its loss."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _hand_run(offload_dir, window=None, optimizers=1, steps=3):
    """A hand-written loop on an attached model: ``optimizers`` HostAdamW one after the other (each closed
    before the next is built: a fresh optimizer's moments are zero), ``steps`` steps each."""
    from megatrain_hf import HostAdamW, attach

    model = tiny_model("llama")
    config = MegaTrainConfig(offload_dir=offload_dir, offload_state="all", optimizer_state="8bit") if offload_dir \
        else MegaTrainConfig()
    engine = attach(model, config, bf16=True)
    losses, used = [], []
    for k in range(optimizers):
        opt = HostAdamW(model.parameters(), engine.store, lr=1e-2, state="8bit", offload_dir=offload_dir,
                        offload_masters=offload_dir is not None, offload_window=window)
        used.append(opt.disk_tier)
        losses += [_step(model, opt, seed + 10 * k) for seed in range(steps)]
        opt.close()
    return model, engine, losses, used


def test_masters_leave_ram_unit_by_unit_while_the_model_attaches(tmp_path, monkeypatch):
    """With the masters on disk the store's hook moves each unit's staged masters into its file as soon as the
    unit is filled: when unit u's flats are made, no earlier unit's staged masters are in RAM any more."""
    from megatrain_hf.optim.tier_files import TierFiles

    seen = []
    original = TierFiles.__call__

    def watch(self, store, u):
        seen.append([v for v, b in enumerate(store.buffers[:-1]) if b.master_host is not None and b.n_staged])
        original(self, store, u)
        assert store.buffers[u].master_host is None or not store.buffers[u].n_staged

    monkeypatch.setattr(TierFiles, "__call__", watch)
    (tmp_path / "d").mkdir()
    model, engine, _, used = _hand_run(str(tmp_path / "d"), steps=1)
    assert len(seen) == len(engine.store.buffers) and all(v == [] for v in seen)
    assert engine.state_tier.masters and used[0] is engine.store.tier_files.pager
    engine.detach()


def test_optimizers_on_the_attach_tier_equal_the_in_ram_run(tmp_path):
    """Two optimizers one after the other adopt the files made at attach (the second from zero moments); one
    with another window pages files of its own, the masters moved there from the mapping: all equal RAM."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ref, _, ref_losses, _ = _hand_run(None, optimizers=2)
    got, engine, losses, used = _hand_run(str(tmp_path / "a"), optimizers=2)
    assert used[0] is used[1] is engine.store.tier_files.pager and losses == ref_losses
    assert_same_state(state_of(ref), state_of(got))
    other, other_engine, other_losses, other_used = _hand_run(str(tmp_path / "b"), window=3)
    assert other_used[0] is not other_engine.store.tier_files.pager and other_losses == ref_losses[:3]
    engine.detach()
    other_engine.detach()
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == []


@pytest.mark.parametrize("kernel", ["torch", pytest.param("native", marks=NO_NATIVE)])
def test_eight_bit_moments_and_masters_on_disk_equal_the_in_ram_run(tmp_path, kernel):
    options = dict(optimizer_state="8bit", host_adamw_kernel=kernel)
    _, ref, ref_losses = _run(tmp_path, "ram", options=options)
    trainer, got, losses = _run(tmp_path, "all", "all", options=options)
    optimizer, store, units = _paged(trainer)
    assert units and optimizer.moments.nbytes() == 0
    assert optimizer.disk_tier is store.tier_files.pager  # the attach tier's files, laid out for 8-bit moments
    assert got._megatrain_engine.state_tier.disk_bytes == optimizer.disk_tier.disk_bytes()
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(got))


def _files(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))
            if name.endswith(".safetensors")}


def test_resume_and_saved_models_with_masters_on_disk_equal_the_in_ram_run(tmp_path):
    """Checkpoints read the masters through their mapping: the model files and the optimizer shards (moments
    only, as in RAM) are the in-RAM run's bytes; a fresh model resumed from one with the masters on disk ends
    where the uninterrupted in-RAM run ends; save_pretrained after training writes the same files."""
    args = dict(save_strategy="steps", save_steps=3)
    ram, ref, ref_losses = _run(tmp_path, "ram", **args)
    trainer, got, losses = _run(tmp_path, "all", "all", **args)
    assert losses == ref_losses
    for step in (3, 6):
        assert _files(tmp_path / "ram" / f"checkpoint-{step}") == _files(tmp_path / "all" / f"checkpoint-{step}")
        assert optimizer_files(tmp_path / "ram" / f"checkpoint-{step}") == optimizer_files(
            tmp_path / "all" / f"checkpoint-{step}")
    ram.save_model(str(tmp_path / "ram-final"))
    trainer.save_model(str(tmp_path / "all-final"))
    assert _files(tmp_path / "ram-final") == _files(tmp_path / "all-final")
    resumed = tiny_model("llama", seed=9)
    trainer, _, resumed_losses = _run(tmp_path, "all", "all", model=resumed, resume=str(tmp_path / "all" / "checkpoint-3"),
                                   **args)
    assert trainer.optimizer.optimizer.master_units
    assert resumed_losses == ref_losses[len(ref_losses) // 2:]
    assert_same_state(state_of(ref), state_of(resumed))


def test_writes_through_the_parameters_reach_the_update(tmp_path):
    """load_state_dict (and any in-place edit) between steps writes the mapped masters; the next update and
    the staging copy start from them, as in RAM (no slot keeps an older copy)."""
    from megatrain_hf import HostAdamW, attach

    def run(offload_dir):
        model = tiny_model("llama")
        engine = attach(model, MegaTrainConfig(), bf16=True)
        opt = HostAdamW(model.parameters(), engine.store, lr=1e-2, offload_dir=offload_dir,
                        offload_masters=offload_dir is not None)
        # staged from RAM before the masters left it: the first forward does not read the mapping
        assert all(engine.store.staging.fresh(u) for u in opt.master_units)
        losses = []
        for seed in range(4):
            if seed == 2:
                model.load_state_dict(tiny_model("llama", seed=5).state_dict())
            losses.append(_step(model, opt, seed))
        opt.synchronize()
        return model, opt, losses

    (tmp_path / "d").mkdir()
    ref, ram, ref_losses = run(None)
    got, disk, losses = run(str(tmp_path / "d"))
    assert disk.master_units and losses == ref_losses
    assert_same_state(state_of(ref), state_of(got))
    ram.close()
    disk.close()


# ---------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("options,why", [(dict(compute_dtype="fp32"), "compute is fp32"),
                                         (dict(host_staging=False), "host_staging=False")])
def test_masters_on_disk_without_a_staging_copy_are_refused(tmp_path, options, why):
    from megatrain_hf import attach

    (tmp_path / "d").mkdir()
    model = tiny_model("llama")
    config = MegaTrainConfig(offload_dir=str(tmp_path / "d"), offload_state="all", **options)
    with pytest.raises(IncompatibleOptionsError,
                       match=rf"offload_state='all' .* bf16 staging copy .*{why}(.|\n)*Fix: bf16"):
        attach(model, config, bf16=True)
    assert not hasattr(model, "_megatrain_engine") and os.listdir(tmp_path / "d") == []


def test_masters_on_disk_refused_by_hand_where_they_cannot_be(tmp_path):
    """HostAdamW(offload_masters=True) on a store without a staging copy, and the plan under data
    parallelism (masters broadcast from RAM), refuse with the fix."""
    from megatrain_hf import HostAdamW, attach
    from megatrain_hf.plan import Machine, Run, check

    (tmp_path / "d").mkdir()
    model = tiny_model("llama")
    engine = attach(model, MegaTrainConfig())  # fp32 compute: the device streams the masters
    with pytest.raises(IncompatibleOptionsError, match=r"need the bf16 staging copy(.|\n)*Fix: bf16 compute"):
        HostAdamW(model.parameters(), engine.store, offload_dir=str(tmp_path / "d"), offload_masters=True)
    assert os.listdir(tmp_path / "d") == []  # refused before creating anything
    config = MegaTrainConfig(offload_dir=str(tmp_path / "d"), offload_state="all")
    with pytest.raises(IncompatibleOptionsError,
                       match=r"data parallelism broadcasts the masters(.|\n)*offload_state='moments'"):
        check(config, Machine(torch.device("cpu"), world_size=2), Run(bf16=True))


def _located(model):
    from megatrain_hf.models.families import family_of

    located = family_of(model).locate(model)
    return located.names, located.modules


# ---------------------------------------------------------------------------------- the plan
def test_estimate_counts_the_masters_on_disk(tmp_path, capsys):
    """`megatrain estimate --offload-state all`: the matrices' fp32 masters (4 B per matrix element) move
    from RAM to disk; RAM keeps the embedding and the norms' masters, the gradients, the staging copy."""
    import json

    from megatrain_hf.cli.estimate import estimate_main
    from megatrain_hf.memory.plan import plan_memory
    from megatrain_hf.memory.shapes import PRESETS

    common = ["--model", "llama-7b", "--offload-dir", str(tmp_path), "--disk-gib", "200", "--host-gib", "80", "--json"]
    assert estimate_main(common) == 0
    moments_only = json.loads(capsys.readouterr().out)["disk_tier"]
    assert estimate_main(common + ["--offload-state", "all"]) == 0
    d = json.loads(capsys.readouterr().out)["disk_tier"]
    s = PRESETS["llama-7b"]
    matrices = s.layers * (2 * s.hidden * s.hidden + 2 * s.hidden * s.kv_heads * (s.hidden // s.heads)
                           + 3 * s.hidden * s.intermediate) + s.vocab * s.hidden  # + lm_head (untied)
    assert d["offload_state"] == "all" and d["masters_on_disk_bytes"] == 4 * matrices
    # page-aligned per unit, next to the moments
    assert 0 <= d["disk_bytes"] - moments_only["disk_bytes"] - 4 * matrices < 4096 * (s.layers + 3)
    plan = plan_memory(s, seq_len=4096, micro_batch=1, grad_accum=1)
    moments = plan.host_exp_avg + plan.host_exp_avg_sq
    assert d["host_ram_bytes"] == plan.host_total - moments - 4 * matrices + d["ram_window_bytes"]
    assert d["read_per_step_bytes"] == d["written_per_step_bytes"] == d["disk_bytes"]
    assert d["max_layers"] >= moments_only["max_layers"]
    assert estimate_main(common[:-1] + ["--offload-state", "all"]) == 0
    table = capsys.readouterr().out
    assert "AdamW moments, matrix masters on disk" in table and "disk: fp32 masters of the matrices" in table
    assert estimate_main(common + ["--offload-state", "all", "--dtype", "fp32"]) == 2
    assert "needs the bf16 staging copy" in capsys.readouterr().err


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_auto_puts_the_fewest_masters_on_disk_when_moments_on_disk_are_not_enough(tmp_path, monkeypatch):
    """offload_state='auto': every unit's moments on disk and RAM still one byte short: the last units'
    masters go too (not all of them), and the run equals the in-RAM run bitwise. (With host_staging="auto"
    dropping the staging copy comes first: 2 B/param, and the masters on disk would need it.)"""
    from megatrain_hf.memory import disk, host

    (tmp_path / "disk").mkdir()
    config = MegaTrainConfig(offload_dir=str(tmp_path / "disk"), host_staging=True)
    layers = dict(num_hidden_layers=8)
    model = tiny_model("llama", **layers)
    units = list(zip(*_located(model)))
    sizes = host.unit_sizes(units, compute_dtype=torch.bfloat16, embedding_units=frozenset({0}))
    every = disk.tier_bytes(sizes)  # every unit's moments on disk, masters in RAM
    needed = sum(host.host_breakdown_for_units(units, compute_dtype=torch.bfloat16, staging=True,
                                               optimizer_state=False).values()) + every.ram_bytes
    current = sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setattr(host, "available_host_bytes", lambda: host.DEFAULT_HEADROOM_BYTES + needed - 1 - current)
    trainer, losses = train(model, training_args(tmp_path / "auto", bf16=True), callbacks=[MegaTrainPlugin(config)])
    optimizer = trainer.optimizer.optimizer
    staged = [u for u, s in enumerate(sizes) if s.n_staged]
    assert len(optimizer.disk_tier.units) == len([s for s in sizes if s.n_train])  # every unit's moments
    assert 0 < len(optimizer.master_units) < len(staged) and optimizer.master_units[-1] == staged[-1]
    assert model._megatrain_engine.state_tier.disk_bytes == optimizer.disk_tier.disk_bytes()
    monkeypatch.undo()
    _, ref, ref_losses = _run(tmp_path, "ram", model=tiny_model("llama", **layers), options=dict(host_staging=True))
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(model))


def test_the_end_of_train_waits_for_the_masters_written_back(tmp_path, monkeypatch):
    """The update ends a unit's gate before its slot is written back to the file the parameters map: the end of
    ``train()`` (``engine.synchronize()``) waits for those writes too, so the parameters read right after it
    are the last update's, however slow the disk (here each write piece lands 0.3 s late)."""
    from megatrain_hf.core import disk_io

    _, ref, _ = _run(tmp_path, "ram", max_steps=2)
    write = disk_io._write_piece

    def late(*args):
        time.sleep(0.3)
        return write(*args)

    monkeypatch.setattr(disk_io, "_write_piece", late)
    _, got, _ = _run(tmp_path, "all", "all", max_steps=2)
    assert_same_state(state_of(ref), state_of(got))

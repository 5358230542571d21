"""HostAdamW's device_update: a second worker updates a share of a step's units on the compute
device while the host worker updates the rest, both in forward order; each then takes the
other's last units. On the CPU the "device" is the CPU (the same fused kernel on copies), so the
results are bitwise those of torch's AdamW."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import TrainerCallback

from tests.helpers import LogRecorder, assert_close_losses, state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainPlugin, attach, engine_of
from megatrain_hf.optim.device_update import DeviceShareAdamW, DeviceShareScheduler
from megatrain_hf.optim.kernels import UnitJob


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


@pytest.mark.parametrize("chunk", [None, 1024], ids=["whole", "in-pieces"])
def test_device_update_shares_the_units_and_matches_torch_fused_adamw(monkeypatch, chunk):
    """device_update: the units are shared between the host worker and a device worker, each taking
    its own in forward order (here the "device" is the CPU: the same fused kernel on copies). Every
    unit is updated once per step, bitwise like torch.optim.AdamW(fused=True), with its staging
    copy fresh."""
    import threading
    import time

    import megatrain_hf.optim.device_update as optimizer_module

    if chunk is not None:  # tensors of the tiny model go up in several pieces (a multiple of 16 elements)
        monkeypatch.setattr(optimizer_module, "DEVICE_UPDATE_CHUNK", chunk)

    models = [tiny_model("llama", hidden_size=96, intermediate_size=200), tiny_model("llama", hidden_size=96,
                                                                                       intermediate_size=200)]
    engine = attach(models[1], device="cpu", config=None, bf16=True)  # bf16: a staging copy exists
    ref_opt = torch.optim.AdamW(_groups(models[0]), lr=3e-3, betas=(0.9, 0.95), eps=1e-7, fused=True)
    opt = DeviceShareAdamW(_groups(models[1]), store=engine.store, lr=3e-3, betas=(0.9, 0.95), eps=1e-7,
                           kernel="torch")
    on_device, on_host = [], []
    scheduler = opt.scheduler
    run_on_device, run_job = scheduler._update_on_device, scheduler._run
    both_started = threading.Barrier(2, timeout=20)  # each end takes its first unit before either goes on

    def device(job, kept):
        on_device.append(job.unit)
        run_on_device(job, kept)

    def host_or_device(job, on_device=False):
        if not on_device:
            on_host.append(job.unit)
        if len(on_host if not on_device else on_device_seen) == (1 if not on_device else 0):
            both_started.wait()
        if on_device:
            on_device_seen.append(job.unit)
        time.sleep(0.01)
        run_job(job, on_device)

    on_device_seen = []

    assigned = []
    assign = scheduler._assign

    def record_assignment(jobs):
        device_jobs, host_jobs = assign(jobs)
        assigned.append(([j.unit for j in device_jobs], [j.unit for j in host_jobs]))
        return device_jobs, host_jobs

    monkeypatch.setattr(scheduler, "_update_on_device", device)
    monkeypatch.setattr(scheduler, "_run", host_or_device)
    monkeypatch.setattr(scheduler, "_assign", record_assignment)
    for step in range(4):
        torch.manual_seed(step)
        grads = {n: torch.randn_like(p) for n, p in models[0].named_parameters()}
        for model, optimizer in ((models[0], ref_opt), (models[1], opt)):
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
            if optimizer is ref_opt:
                torch._foreach_mul_([p.grad for p in model.parameters()], 0.37)
            else:
                optimizer.set_clip_coef(torch.tensor(0.37))
            optimizer.step()
            optimizer.zero_grad()
        opt.synchronize()
        units = len(opt.units)
        assert sorted(on_device + on_host) == sorted(opt.units) and on_device and on_host, (on_host, on_device)
        device_units, host_units = assigned.pop()
        assert device_units and host_units
        for seq, own, other in ((on_host, host_units, device_units), (on_device, device_units, host_units)):
            assert _own_then_others_last(seq, own, other), (seq, own, other)
        on_device.clear(), on_host.clear(), on_device_seen.clear()
        both_started.reset()
    assert units > 2
    ref, got = state_of(models[0]), state_of(models[1])
    for n in ref:
        assert torch.equal(ref[n], got[n]), n
    for p_ref, p in zip(models[0].parameters(), models[1].parameters()):
        st_ref, st = ref_opt.state[p_ref], opt.state[p]
        assert float(st_ref["step"]) == float(st["step"])
        assert torch.equal(st["exp_avg"], st_ref["exp_avg"]) and torch.equal(st["exp_avg_sq"], st_ref["exp_avg_sq"])
    for n, p in models[1].named_parameters():
        e = engine.store.home_of(p)[1]
        if e.wire == torch.bfloat16:
            staged = engine.store.buffers[e.owner].staging_host[e.offset : e.offset + e.numel]
            assert torch.equal(staged, p.detach().reshape(-1).to(torch.bfloat16)), n
    assert all(engine.store.staging.fresh(u) for u, b in enumerate(engine.store.buffers) if b.staging_host is not None)
    opt.close()
    assert not scheduler._device_worker.is_alive()



def _own_then_others_last(seq: list, own: list, other: list) -> bool:
    """``seq`` is a prefix of ``own`` followed by ``other``'s last units, last first."""
    a = 0
    while a < len(seq) and a < len(own) and seq[a] == own[a]:
        a += 1
    rest = seq[a:]
    return rest == list(reversed(other))[: len(rest)]


@pytest.mark.parametrize("rates, pattern", [((1.0, 1.0), "HDHDHD"), ((2.0, 1.0), "HHDHHD")])
def test_assignment_follows_the_measured_rates(rates, pattern):
    """Each unit, in forward order, goes to the worker that would finish it first at last step's
    rates (elements per second): equal rates alternate; a host twice as fast takes two in three."""
    model = tiny_model("llama")
    engine = attach(model, device="cpu")
    opt = DeviceShareAdamW(_groups(model), store=engine.store)
    try:
        host_rate, device_rate = rates
        opt.scheduler._rates = {"host": [int(host_rate * 1000), 1.0], "device": [int(device_rate * 1000), 1.0]}
        jobs = [UnitJob(u, [types.SimpleNamespace(numel=10)]) for u in range(6)]
        device_jobs, host_jobs = opt.scheduler._assign(jobs)
        got = "".join("D" if any(j.unit == u for j in device_jobs) else "H" for u in range(6))
        assert got == pattern
        assert [j.unit for j in host_jobs] == sorted(j.unit for j in host_jobs)  # both in forward order
        assert [j.unit for j in device_jobs] == sorted(j.unit for j in device_jobs)
    finally:
        opt.close()
        engine.detach()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_with_device_update_equals_plain_trainer(tmp_path, accumulation, monkeypatch):
    """The device's units read the gradients the sink kept on the device (from the second step on:
    the first step's split decides which units keep them); results bitwise plain Trainer's."""
    original = DeviceShareScheduler._assign

    def pinned(self, jobs):  # the split at its starting share: the measured rates of two workers on a shared
        self._rates = {"host": [0, 0.0], "device": [0, 0.0]}  # 2-core CPU can leave the device no unit at all
        return original(self, jobs)

    monkeypatch.setattr(DeviceShareScheduler, "_assign", pinned)
    args = dict(gradient_accumulation_steps=accumulation, max_grad_norm=0.05)  # clipping active
    ref_model = tiny_model("llama")
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref", **args))
    model = tiny_model("llama")
    logs = LogRecorder()
    trainer, losses = train(model, training_args(tmp_path / "mt", **args),
                            callbacks=[MegaTrainPlugin(device_update=True, metrics="all"), logs])
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, DeviceShareAdamW) and optimizer.kept_grad_units > 0
    assert any("megatrain/update_device_frac" in h for h in logs.logs)
    assert_close_losses(ref_losses, losses, 0.0)
    ref, got = state_of(ref_model), state_of(model)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    engine_of(model).detach()


class _HalveGradients(TrainerCallback):
    """Edits every gradient in place between clipping and the optimizer step."""

    def __init__(self):
        self.model = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)  # a power of two: exact, whatever the order of the multiplies


def test_device_update_reads_gradients_edited_after_backward(tmp_path):
    """A gradient changed in place after backward (a callback) makes the kept device copy stale: the
    device's units must read the edited host gradient instead (else the update would use twice it)."""
    args = dict(max_grad_norm=1e9, max_steps=4)  # no clipping: the halving is the only scale
    results = []
    for name, plugin in (("ref", []), ("mt", [MegaTrainPlugin(device_update=True)])):
        model, halve = tiny_model("llama"), _HalveGradients()
        halve.model = model
        trainer, losses = train(model, training_args(tmp_path / name, **args), callbacks=[*plugin, halve])
        results.append((losses, state_of(model)))
        if plugin:
            assert trainer.optimizer.optimizer.kept_grad_units == 0  # no kept copy was used ...
            assert engine_of(model).grad_keeper.stale_device_grads > 0  # ... because those kept were found stale
            engine_of(model).detach()
    (ref_losses, ref), (losses, got) = results
    assert_close_losses(ref_losses, losses, 0.0)
    assert all(torch.equal(ref[n], got[n]) for n in ref)

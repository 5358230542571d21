"""HostAdamW's public ``scheduler=`` hook: another schedule of the same per-unit update (``UnitUpdater``)
changes when units are updated, not what they become."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.helpers import state_of, tiny_model
from megatrain_hf import HostAdamW, attach
from megatrain_hf.optim.update_worker import JobBoard


class LastUnitFirst:
    """A scheduler that updates a step's units in the training thread, last unit first."""

    def __init__(self, updater, gates, threads: int) -> None:
        self.updater, self.board, self.order = updater, JobBoard(gates), []

    def dispatch(self, jobs) -> None:
        self.board.begin(jobs, threading.current_thread())
        for job in reversed(jobs):
            self.order.append(job.unit)
            self.board.account(job.numel, self.board.run(job, self.updater.update))

    def wait(self) -> None:
        self.board.wait(self.alive)

    def alive(self) -> bool:
        return True

    def skipped(self) -> None:
        pass

    def take_update_stats(self):
        return self.board.take_update_stats()

    def close(self) -> None:
        pass


@pytest.mark.parametrize("state", ["fp32", "8bit"])
def test_a_scheduler_through_the_hook_updates_as_the_host_worker(state):
    models = [tiny_model("llama") for _ in range(2)]
    engines = [attach(m, device="cpu", bf16=True) for m in models]
    opts = [HostAdamW(models[0].parameters(), engines[0].store, lr=1e-2, weight_decay=0.1, state=state),
            HostAdamW(models[1].parameters(), engines[1].store, lr=1e-2, weight_decay=0.1, state=state,
                      scheduler=LastUnitFirst)]
    for step in range(3):
        torch.manual_seed(step)
        grads = {n: torch.randn_like(p) for n, p in models[0].named_parameters()}
        for model, opt in zip(models, opts):
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
            opt.step()
            opt.zero_grad()
    for opt in opts:
        opt.synchronize()
    order = opts[1].scheduler.order
    assert order[: len(opts[1].units)] == list(reversed(opts[1].units))  # the hook decided the order
    ref, got = state_of(models[0]), state_of(models[1])
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    assert all(engines[1].store.staging.fresh(u) for u in opts[1].units if engines[1].store.buffers[u].staging_host
               is not None)
    sd = [o.state_dict()["state"] for o in opts]
    assert all(torch.equal(sd[0][i][k], sd[1][i][k]) for i in sd[0] for k in ("exp_avg", "exp_avg_sq"))
    seconds, numel = opts[1].take_update_stats()
    assert seconds > 0 and numel == 3 * sum(p.numel() for p in models[1].parameters())
    for opt, engine in zip(opts, engines):
        opt.close()
        engine.detach()

"""core/readiness.py on its own: UnitGates between an updating thread and readers, zero_grad_after.

Every wait runs in a daemon thread joined with a timeout, so a bug fails the test instead of hanging.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatrain_hf.core.readiness import UnitGates, zero_grad_after
from megatrain_hf.errors import BackgroundWorkerError

GUARD_S = 10.0  # far above any wait here (the dead-worker poll is 1 s)


class Waiter:
    """``fn()`` in a daemon thread; records when it returned and what it raised."""

    def __init__(self, fn) -> None:
        self.error: BaseException | None = None
        self.returned_at: float | None = None
        self._fn = fn
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:  # noqa: BLE001 -- examined by the test
            self.error = exc
        self.returned_at = time.perf_counter()

    def join(self) -> "Waiter":
        self.thread.join(GUARD_S)
        assert not self.thread.is_alive(), "the wait hung"
        return self

    def still_waiting_after(self, seconds: float) -> bool:
        self.thread.join(seconds)
        return self.thread.is_alive()


def _dead_thread() -> threading.Thread:
    t = threading.Thread(target=lambda: None, name="gone-worker")
    t.start()
    t.join()
    return t


def test_gates_start_open_at_generation_zero():
    gates = UnitGates(["a", "b"])
    assert gates.generation == [0, 0]
    Waiter(gates.synchronize).join()
    gates.wait_ready(1)  # no update: returns at once


def test_begin_update_bumps_the_generation_and_bump_too():
    gates = UnitGates(["a", "b", "c"])
    gates.begin_update(1)
    assert gates.generation == [0, 1, 0]
    gates.end_update(1)
    assert gates.generation == [0, 1, 0]  # ending does not change the masters again
    gates.bump(2)
    gates.bump(2)
    assert gates.generation == [0, 1, 2]
    gates.wait_ready(2)  # bump() does not close the gate


def test_wait_ready_blocks_until_end_update_from_another_thread():
    gates = UnitGates(["a", "b"])
    gates.begin_update(0)
    waiter = Waiter(lambda: gates.wait_ready(0))
    other = Waiter(lambda: gates.wait_ready(1))  # another unit is not held up
    other.join()
    assert other.error is None
    assert waiter.still_waiting_after(0.2)
    ended = time.perf_counter()
    threading.Thread(target=gates.end_update, args=(0,)).start()
    waiter.join()
    assert waiter.error is None and waiter.returned_at >= ended


def test_an_update_without_a_worker_is_waited_for_past_the_poll():
    """No worker recorded (the update runs on a thread not named): the wait polls, never raises."""
    gates = UnitGates(["a"])
    gates.begin_update(0)
    waiter = Waiter(lambda: gates.wait_ready(0))
    assert waiter.still_waiting_after(1.3)  # past one 1 s poll
    gates.end_update(0)
    assert waiter.join().error is None


def test_the_error_is_re_raised_once():
    gates = UnitGates(["a", "b"])
    first, second = ValueError("first failure"), ValueError("second failure")
    gates.begin_update(0)
    gates.begin_update(1)
    gates.end_update(0, error=first)
    gates.end_update(1, error=second)  # the first error is the one reported
    with pytest.raises(BackgroundWorkerError, match="background update failed.*first failure") as info:
        gates.wait_ready(1)
    assert info.value.__cause__ is first
    gates.wait_ready(0)  # reported already: not again
    gates.synchronize()


def test_synchronize_waits_for_every_unit_and_raises():
    gates = UnitGates(["a", "b"])
    gates.begin_update(0)
    gates.begin_update(1)
    waiter = Waiter(gates.synchronize)
    gates.end_update(0)
    assert waiter.still_waiting_after(0.1)
    gates.end_update(1, error=KeyError("boom"))
    waiter.join()
    assert isinstance(waiter.error, RuntimeError) and "boom" in str(waiter.error)


def test_a_dead_worker_releases_its_units_and_raises_instead_of_hanging():
    gates = UnitGates(["embed", "layer0", "layer1"])
    dead = _dead_thread()
    alive_until = threading.Event()
    alive = threading.Thread(target=alive_until.wait, args=(GUARD_S,), name="live-worker", daemon=True)
    alive.start()
    gates.begin_update(0, worker=dead)
    gates.begin_update(1, worker=dead)
    gates.begin_update(2, worker=alive)
    waiter = Waiter(lambda: gates.wait_ready(1)).join()
    assert isinstance(waiter.error, RuntimeError)
    msg = str(waiter.error)
    assert "unit 1 (layer0)" in msg and "'gone-worker'" in msg and "checkpoint" in msg
    # the dead thread's other unit is released too, once the error was reported
    assert Waiter(lambda: gates.wait_ready(0)).join().error is None
    # a unit held by a live worker is not released
    held = Waiter(lambda: gates.wait_ready(2))
    assert held.still_waiting_after(1.3)
    gates.end_update(2)
    assert held.join().error is None
    alive_until.set()


def test_claim_update_names_the_worker_that_runs_it():
    gates = UnitGates(["a"])
    gates.begin_update(0)  # queued on the training thread ...
    gates.claim_update(0, _dead_thread())  # ... and taken by a thread that then died
    waiter = Waiter(lambda: gates.wait_ready(0)).join()
    assert isinstance(waiter.error, RuntimeError) and "gone-worker" in str(waiter.error)


def test_zero_grad_after_waits_only_when_zeroing_in_place():
    calls = []
    zero_grad_after(lambda: calls.append("sync"), lambda set_to_none: calls.append(("zero", set_to_none)))
    assert calls == [("zero", True)]
    calls.clear()
    zero_grad_after(lambda: calls.append("sync"), lambda set_to_none: calls.append(("zero", set_to_none)), False)
    assert calls == ["sync", ("zero", False)]


def test_zero_grad_after_in_place_blocks_until_the_update_ended():
    gates = UnitGates(["a"])
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    model = torch.nn.ParameterList([p])
    gates.begin_update(0)
    read_during_update = []

    def update():
        time.sleep(0.2)
        read_during_update.append(p.grad.clone())  # the update still reads the gradients
        gates.end_update(0)

    threading.Thread(target=update, daemon=True).start()
    Waiter(lambda: zero_grad_after(gates.synchronize, model.zero_grad, set_to_none=False)).join()
    assert torch.equal(read_during_update[0], torch.ones(3))
    assert torch.equal(p.grad, torch.zeros(3))
    # set_to_none does not wait: the update reads the old tensor, which stays alive
    gates.begin_update(0)
    Waiter(lambda: zero_grad_after(gates.synchronize, model.zero_grad, set_to_none=True)).join()
    assert p.grad is None
    gates.end_update(0)

"""Layer-major gradient accumulation: every micro-batch of a step through a layer before the next.

A training loop runs forward + backward once per micro-batch, so with K micro-batches each
layer's weights would cross the link 2K times per optimizer step and its gradients K times
(102 GB per 64K-token step at 3.14B). Here the K *micro-batch steps* -- plain callables, e.g.
Trainer's own ``training_step`` -- run as coroutines on helper threads, strictly one at a time
and always in the same order (so anything they draw from the RNG is drawn in a fixed order):

* each coroutine runs its Python code (HF's model forward, the loss, Trainer's scaling) until it
  calls a streamed unit; the call is handed to the *driver* (the thread that called
  :func:`run`), which executes it. The r-th unit call of every micro-batch is the same unit, so
  the driver executes one *round* -- unit u for all K micro-batches -- back to back, with the
  weights uploaded once;
* a coroutine that reaches its backward (:meth:`Engine.backward`) waits; when all have, the
  driver runs one ``torch.autograd.backward`` over the K losses. Round tokens (:class:`Group`)
  make autograd finish unit u for every micro-batch before unit u-1, so the engine fetches each
  unit once more, sums its gradients on the device and downloads them once (``GradSink``);
* then the coroutines return (Trainer's ``loss.detach()``), and :func:`run` returns their results.

Nothing here knows about Trainer; the Trainer integration supplies the callables and routes
``accelerator.backward`` to :meth:`Engine.backward`. An exception in a coroutine, or in the
driver (Ctrl-C included), aborts the others and is raised in the caller; no thread is left
waiting.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import BackgroundWorkerError, IncompatibleOptionsError, UsageError
from .autocast import autocast_state

_local = threading.local()


@dataclass
class Group:
    """A layer-major accumulation group in progress: the round tokens that order its backward.

    Round r's unit calls (the r-th call of every micro-batch) take as their anchor the sum of round
    r-1's tokens (a zero scalar output of every call): autograd runs that sum's backward only after
    every round-r call's backward, and every round-(r-1) call waits for it, so unit u finishes for
    all micro-batches before unit u-1 starts (one upload, one gradient download per unit).
    """

    tokens: list = field(default_factory=list)  # round -> tokens of that round's unit calls
    anchors: dict = field(default_factory=dict)  # round -> anchor its calls take (previous round's tokens, summed)
    rounds: dict = field(default_factory=dict)  # coroutine index -> unit calls with a graph node so far
    current: Any = None  # the coroutine whose unit call the driver is executing
    backward_open: bool = False  # the group's one backward over all micro-batches is running

    def anchor_for_call(self, leaf: torch.Tensor) -> torch.Tensor:
        """The anchor of the current coroutine's next call (``leaf`` for its first round)."""
        r = self.rounds.get(self.current.index, 0) if self.current is not None else 0
        if r == 0:
            return leaf
        anchor = self.anchors.get(r)
        if anchor is None:
            tokens = self.tokens[r - 1]
            anchor = tokens[0] if len(tokens) == 1 else torch.stack(tokens).sum()
            self.anchors[r] = anchor
        return anchor

    def record(self, token: torch.Tensor) -> bool:
        """Record the current coroutine's call token; False outside a coroutine's call."""
        if self.current is None:
            return False
        r = self.rounds.get(self.current.index, 0)
        self.rounds[self.current.index] = r + 1
        while len(self.tokens) <= r:
            self.tokens.append([])
        self.tokens[r].append(token)
        return True

    def reset_rounds(self) -> None:
        """After the group's backward: later unit calls (a second forward in the step) start a fresh chain."""
        self.tokens, self.anchors, self.rounds = [], {}, {}


class _Abort(BaseException):
    """Unwinds a coroutine the driver gave up on (never escapes this module)."""


@dataclass
class _ThreadState:
    """The torch thread-local state a coroutine or a driver-side call must run under.

    Carried over: grad mode, the autocast state of the device type (enabled or not), and the
    default saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, e.g.
    ``save_on_cpu``). Not carried over: the current CUDA stream, torch function modes and
    inference mode (the streamed calls run on the driver's); see docs/architecture.md.
    """

    grad_enabled: bool
    autocast: tuple[bool, torch.dtype, bool]  # (enabled, dtype, cache_enabled) on the device type
    saved_hooks: tuple | None  # (pack, unpack) of the innermost saved_tensors_hooks, or None

    @classmethod
    def capture(cls, device_type: str) -> "_ThreadState":
        return cls(torch.is_grad_enabled(), autocast_state(device_type), _saved_tensor_hooks())

    def enter(self, device_type: str):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        enabled, dtype, cache = self.autocast
        stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
        if self.saved_hooks is not None and _saved_tensor_hooks() != self.saved_hooks:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.saved_hooks))
        return stack


def _saved_tensor_hooks() -> tuple | None:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class Coroutine:
    """One micro-batch step running on its own thread, resumed and paused by the driver."""

    def __init__(self, index: int, fn: Callable[[], Any], owner: object, device: torch.device) -> None:
        self.index = index
        self.owner = owner  # the engine whose unit calls this coroutine hands over
        self.message: tuple[str, Any] = ("new", None)
        self._fn = fn
        self._device = device
        self._state = _ThreadState.capture(device.type)
        self._to_thread: queue.SimpleQueue = queue.SimpleQueue()
        self._to_driver: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._main, name=f"megatrain-microbatch-{index}", daemon=True)

    # ------------------------------------------------------------------ coroutine side
    def _main(self) -> None:
        _local.coroutine = self
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            self._wait()
            with self._state.enter(self._device.type):
                result = self._fn()
            self._to_driver.put(("done", result))
        except _Abort:
            self._to_driver.put(("aborted", None))
        except BaseException as exc:  # handed to the driver, which raises it in the caller
            self._to_driver.put(("error", exc))
        finally:
            _local.coroutine = None

    def _wait(self) -> Any:
        kind, value = self._to_thread.get()
        if kind == "abort":
            raise _Abort
        if kind == "raise":
            raise value
        return value

    def pause(self, kind: str, payload: Any) -> Any:
        """From the coroutine: hand ``payload`` to the driver and wait until it resumes us."""
        self._to_driver.put((kind, payload))
        return self._wait()

    def call(self, u: int, args: tuple, kwargs: dict, kernel: Any = None) -> Any:
        """A streamed unit call, executed by the driver under this thread's grad/autocast state and in
        its context (``contextvars``: e.g. HF's output capture reads one)."""
        state = _ThreadState.capture(self._device.type)
        return self.pause("call", (u, args, kwargs, kernel, state, contextvars.copy_context()))

    # ------------------------------------------------------------------ driver side
    def start(self) -> None:
        self.thread.start()
        self.resume("value", None)

    def resume(self, kind: str, value: Any) -> None:
        """From the driver: continue the coroutine until it pauses again (``self.message``)."""
        self._to_thread.put((kind, value))
        while True:
            try:
                self.message = self._to_driver.get(timeout=1.0)
                return
            except queue.Empty:
                if not self.thread.is_alive():  # cannot happen short of interpreter teardown
                    raise BackgroundWorkerError(
                        f"megatrain: micro-batch thread {self.thread.name} ended without a result")

    def abort(self) -> None:
        if self.thread.ident is None:  # never started (interrupted while starting the others)
            return
        if self.thread.is_alive() and self.message[0] in ("call", "backward", "new"):
            self.resume("abort", None)
        self.thread.join(timeout=10)


def current(owner: object) -> Coroutine | None:
    """The coroutine running on this thread, if it belongs to ``owner``."""
    coroutine = getattr(_local, "coroutine", None)
    return coroutine if coroutine is not None and coroutine.owner is owner else None


def run(
    owner: object,
    device: torch.device,
    fns: list[Callable[[], Any]],
    execute: Callable[[Coroutine, int, tuple, dict, Any], Any],
    backward: Callable[[list[tuple[torch.Tensor, dict]]], None],
) -> list[Any]:
    """Run ``fns`` as interleaved coroutines; return their results in order.

    ``execute(coroutine, u, args, kwargs, kernel)`` runs a unit call on the driver; ``backward(items)``
    runs one backward over the ``(loss, kwargs)`` of every coroutine waiting in backward.
    """
    coroutines = [Coroutine(k, fn, owner, device) for k, fn in enumerate(fns)]
    try:
        for c in coroutines:
            c.start()
        while True:
            for c in coroutines:
                if c.message[0] == "error":
                    raise c.message[1]
            calls = [c for c in coroutines if c.message[0] == "call"]
            waiting = [c for c in coroutines if c.message[0] == "backward"]
            if calls:  # one round: run every pending unit call, then let each coroutine go on
                # Executed last micro-batch first: autograd runs ready nodes newest first, so the
                # round's backward then runs micro-batch 0 first and the device sums add the
                # gradients in the order plain accumulation adds them.
                outcomes = {}
                for c in reversed(calls):
                    u, args, kwargs, kernel, state, context = c.message[1]
                    try:
                        with state.enter(device.type):
                            outcomes[c.index] = ("value", context.run(execute, c, u, args, kwargs, kernel))
                    except Exception as exc:  # raised inside the coroutine, at its unit call
                        outcomes[c.index] = ("raise", exc)
                for c in calls:
                    c.resume(*outcomes[c.index])
            elif waiting:  # every live coroutine is in backward: one pass over all their losses
                try:
                    backward([c.message[1] for c in waiting])
                except Exception as exc:
                    for c in waiting:
                        c.resume("raise", exc)
                    continue
                for c in waiting:
                    c.resume("value", None)
            else:
                return [c.message[1] for c in coroutines]
    finally:
        # every coroutine is unwound even if one abort is interrupted (a second Ctrl-C); the
        # exception that ended the group is the one raised
        failure = None
        for c in coroutines:
            try:
                c.abort()
            except BaseException as exc:  # noqa: BLE001 -- keep aborting the others first
                failure = failure or exc
        for c in coroutines:  # an interrupted join: the thread is unwinding, wait for it once more
            if c.thread.ident is not None and c.thread.is_alive():
                try:
                    c.thread.join(timeout=10)
                except BaseException as exc:  # noqa: BLE001
                    failure = failure or exc
        if failure is not None and sys.exc_info()[0] is None:
            raise failure


class Driver:
    """An engine's layer-major schedule: micro-batch steps run through the engine's :class:`UnitRunner`
    as coroutines (:func:`run`), their unit calls in rounds and their backward as one.

    ``runner`` executes the unit calls and carries the :class:`Group` in progress; ``grads`` (the
    engine's gradient sink) sums a group's gradients on the device and names the parameters with
    tensor hooks, which a group's one backward would run once instead of once per micro-batch.
    """

    def __init__(self, runner, grads, device: torch.device) -> None:
        self.runner, self.grads, self.device = runner, grads, device

    def coroutine(self) -> Coroutine | None:
        """The micro-batch of a group running on this thread, if any."""
        return current(self)

    def run(self, fns: list[Callable[[], Any]]) -> list[Any]:
        """Run micro-batch steps layer-major; return their results (one step runs as it is)."""
        if self.runner.group is not None:
            raise UsageError("megatrain: run_layer_major() cannot be nested")
        if len(fns) == 1:
            return [fns[0]()]
        hooked = self.grads.hooked_parameters()
        if hooked:
            raise IncompatibleOptionsError(
                f"megatrain: layer-major accumulation sums the micro-batches' gradients before they reach the "
                f"parameters, but {hooked[:3]} have tensor hooks, which run once per backward. Fix: "
                "MegaTrainConfig(layer_major=False) (or 'auto'), or one backward per micro-batch in your loop."
            )
        self.runner.group = Group()
        self.grads.begin_group()
        try:
            return run(self, self.device, fns, self._execute_call, self._backward_all)
        finally:
            self.runner.group = None
            self.grads.end_group()

    def loss_step(self, loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One micro-batch step of :meth:`Engine.accumulate`: its loss, back-propagated, detached."""
        loss = loss_fn()
        self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor, retain_graph: bool | None = None) -> None:
        """``loss.backward()``; inside a group, deferred to the group's one backward."""
        coroutine = current(self)
        if coroutine is None:
            loss.backward(retain_graph=retain_graph)
        else:
            coroutine.pause("backward", (loss, {"retain_graph": retain_graph}))

    def _execute_call(self, coroutine: Coroutine, u: int, args: tuple, kwargs: dict, kernel: Any) -> Any:
        group = self.runner.group
        group.current = coroutine
        try:
            return self.runner.call(u, args, kwargs, kernel)
        finally:
            group.current = None

    def _backward_all(self, items: list[tuple[torch.Tensor, dict]]) -> None:
        group = self.runner.group
        group.backward_open = True
        try:
            retain = any(kwargs.get("retain_graph") for _, kwargs in items)
            torch.autograd.backward([loss for loss, _ in items], retain_graph=retain)
        finally:
            group.backward_open = False
            group.reset_rounds()

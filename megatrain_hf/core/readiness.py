"""Readiness of each unit's masters: a background update closes a unit's gate, readers wait on it.

The optimizer's workers update units while the training thread already runs the next forward;
the streamer waits on a unit's gate before reading its flats, so the forward of unit ``u`` waits
for unit ``u``'s update only. ``generation[u]`` changes whenever unit ``u``'s masters change (an
update begins, or someone marks them dirty): an upload issued before is stale.
"""

from __future__ import annotations

import threading

from ..errors import BackgroundWorkerError


class UnitGates:
    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._ready = [threading.Event() for _ in names]
        for event in self._ready:
            event.set()
        self._updaters: list[threading.Thread | None] = [None] * len(names)  # the thread running that update
        self.generation = [0] * len(names)
        self.error: BaseException | None = None  # first exception of a background update

    def bump(self, u: int) -> None:
        """Unit ``u``'s masters changed."""
        self.generation[u] += 1

    def begin_update(self, u: int, worker: threading.Thread | None = None) -> None:
        """A background update of unit ``u`` starts (run by ``worker``): readers must wait.

        Called on the training thread, so an upload issued after it sees the new generation.
        """
        self._updaters[u] = worker
        self._ready[u].clear()
        self.generation[u] += 1

    def claim_update(self, u: int, worker: threading.Thread) -> None:
        """The update of unit ``u`` is run by ``worker`` after all."""
        self._updaters[u] = worker

    def end_update(self, u: int, error: BaseException | None = None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self._updaters[u] = None
        self._ready[u].set()

    def wait_ready(self, u: int) -> None:
        """Block until unit ``u``'s masters are not being updated; re-raise a background failure."""
        self._wait(u)
        self.raise_error()

    def synchronize(self) -> None:
        for u in range(len(self._ready)):
            self._wait(u)
        self.raise_error()

    def _wait(self, u: int) -> None:
        """Wait for unit ``u``; raise instead of hanging if the thread that was to update it is gone."""
        event = self._ready[u]
        while not event.wait(timeout=1.0):
            worker = self._updaters[u]
            if worker is not None and not worker.is_alive() and not event.is_set():
                # Release every unit that thread still held: the error is reported once, as for a
                # failed update, and later reads do not block forever.
                for v, w in enumerate(self._updaters):
                    if w is worker:
                        self._updaters[v] = None
                        self._ready[v].set()
                raise BackgroundWorkerError(
                    f"megatrain: the thread updating unit {u} ({self.names[u]}), {worker.name!r}, ended "
                    "before finishing its update; the optimizer was closed or garbage-collected while an "
                    "update was pending. Restart from the last checkpoint."
                )

    def raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise BackgroundWorkerError(f"megatrain background update failed: {error!r}") from error


def zero_grad_after(synchronize, zero_grad, set_to_none: bool = True) -> None:
    """``zero_grad(set_to_none)``, first waiting for the background update when the gradient
    buffers are zeroed in place (the running update reads them)."""
    if not set_to_none:
        synchronize()
    zero_grad(set_to_none=set_to_none)

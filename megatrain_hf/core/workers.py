"""One background worker loop for the engine's host threads (gradient sink, HostAdamW update).

The thread holds only a weak reference to its owner, so an owner nobody uses any more is
garbage-collected (its ``__del__`` puts ``None`` in the queue and the thread ends); it runs
``owner.<method>(job)`` for each job with ``threads`` torch CPU threads.

At interpreter exit every live worker finishes the jobs it was given and ends before Python stops
its daemon threads: a daemon thread stopped inside native code is unwound by glibc, and a joinable
``std::thread`` on its stack (torch's or megatrain's kernel pool) ends the process with "terminate
called without an active exception" after a successful run.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref

import torch

logger = logging.getLogger(__name__)
_LIVE: dict[threading.Thread, queue.Queue] = {}
_EXIT_JOIN_S = 60.0


def _serve(jobs: queue.Queue, owner_ref: weakref.ref, method: str, threads: int) -> None:
    torch.set_num_threads(threads)
    while True:
        job = jobs.get()
        owner = owner_ref() if job is not None else None
        if owner is None:
            return
        getattr(owner, method)(job)
        del owner, job


def start_worker(owner: object, jobs: queue.Queue, method: str, threads: int, name: str) -> threading.Thread:
    """Start a daemon thread running ``owner.<method>(job)`` for every job put in ``jobs``."""
    thread = threading.Thread(
        target=_serve, args=(jobs, weakref.ref(owner), method, threads), name=name, daemon=True
    )
    thread.start()
    for ended in [t for t in _LIVE if not t.is_alive()]:
        del _LIVE[ended]
    _LIVE[thread] = jobs
    return thread


@atexit.register
def _end_workers_at_exit() -> None:
    for thread, jobs in list(_LIVE.items()):
        if thread.is_alive():
            jobs.put(None)
    for thread in list(_LIVE):
        thread.join(timeout=_EXIT_JOIN_S)
        if thread.is_alive():
            logger.warning("megatrain: background thread %s still running at exit after %.0f s", thread.name,
                           _EXIT_JOIN_S)
    _LIVE.clear()

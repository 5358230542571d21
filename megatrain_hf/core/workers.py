"""One background worker loop for the engine's host threads (gradient sink, HostAdamW update).

The thread holds only a weak reference to its owner, so an owner nobody uses any more is
garbage-collected (its ``__del__`` puts ``None`` in the queue and the thread ends); it runs
``owner.<method>(job)`` for each job with ``threads`` torch CPU threads.
"""

from __future__ import annotations

import queue
import threading
import weakref

import torch


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
    return thread

"""Gradient sink: a unit's device gradients into the fp32 host accumulators, off the critical path.

On CUDA, ``submit`` copies the unit's gradients into one of a few pinned *slabs* on the grad
stream (device -> host, overlapping the backward of the next unit) and hands the slab to a
worker thread, which waits for the copy, adds it into the unit's fp32 ``grad_host`` (bf16 is
converted on the fly) and, on the last micro-batch of an optimizer step, records the per-tensor
gradient norms so that the global norm is known when backward ends. A small slab pool bounds the
pinned memory and provides back-pressure. ``wait()`` is queued at the end of every backward pass,
so when ``loss.backward()`` returns, every ``param.grad`` is complete, as in plain PyTorch.

On the CPU the same work runs inline.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from .store import Entry, HostStore
from .workers import start_worker

logger = logging.getLogger(__name__)


@dataclass
class _Slab:
    lp_host: torch.Tensor | None  # gradients of matrices (sent as fp32, see _start_cuda)
    fp_host: torch.Tensor | None  # fp32 gradients of vectors / embeddings


class GradSink:
    def __init__(self, store: HostStore, device: torch.device, stats, num_slabs: int = 3, host_threads: int = 1) -> None:
        self.host_threads = host_threads
        self.store = store
        self.device = device
        self.stats = stats
        self.final_microbatch: Callable[[], bool] = lambda: True  # set by integrations (GA hint)
        self.norms: list[tuple | None] = [None] * len(store.entries)  # (grad key, per-tensor norms)
        self._foreign: dict[int, list] = {}  # owner unit -> tied-weight gradients waiting for it
        self._error: BaseException | None = None
        self._pending = 0
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        if device.type == "cuda":
            self._start_cuda(num_slabs)

    # ------------------------------------------------------------------ setup
    def _start_cuda(self, num_slabs: int) -> None:
        self.stream = torch.cuda.Stream(self.device)
        n_lp = max((b.n_lp for b in self.store.buffers if b.master_host is not None), default=0)
        n_fp = max(
            (b.master_host.numel() - b.n_lp for b in self.store.buffers if b.master_host is not None), default=0
        )
        self._free: queue.Queue[_Slab] = queue.Queue()
        for _ in range(num_slabs):
            self._free.put(
                _Slab(
                    # fp32 even for bf16 gradients: the cast runs on the GPU for free, and the
                    # host add is then fp32 += fp32 (measured on the H200 host: fp32 += bf16
                    # runs at 1.5 Gelem/s, a bottleneck; see docs/log.md)
                    self.store.allocate(n_lp, torch.float32) if n_lp else None,
                    self.store.allocate(n_fp, torch.float32) if n_fp else None,
                )
            )
        self._jobs: queue.Queue = queue.Queue()
        self._worker = start_worker(self, self._jobs, "_process", self.host_threads, "megatrain-grads")

    def close(self) -> None:
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=60)
            self._worker = None

    # ------------------------------------------------------------------ submit
    def submit(self, u: int, entries: list[Entry], grads: list[torch.Tensor | None]) -> None:
        """Accumulate unit ``u``'s weight gradients (aligned with ``entries``) into the host."""
        self.raise_error()
        want_norm = self.final_microbatch()
        local, foreign = [], []
        for e, g in zip(entries, grads):
            if g is not None:
                (local if e.owner == u else foreign).append((e, g))
        for e, g in foreign:
            # A tied weight held by another unit (lm_head -> embedding): keep this contribution on
            # the device and add it to the owner's own gradient when the owner's backward submits,
            # which is what autograd does for a shared parameter (one sum, then one accumulation).
            self._foreign.setdefault(e.owner, []).append((e, g))
        pending = self._foreign.pop(u, [])
        if pending:
            local = self._merge_foreign(local, pending)
        if self._worker is None:
            for e, g in local:
                self.store.accumulate_grad(e, g)
            self.norms[u] = self._unit_norms(u) if want_norm else None
            return
        slab = self._take_slab()
        n_lp = self.store.buffers[u].n_lp
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # grads are ready there
        with torch.cuda.stream(self.stream):
            for e, g in local:
                if e.wire == torch.float32:
                    dst = slab.fp_host[e.offset - n_lp : e.offset - n_lp + e.numel]
                else:
                    dst = slab.lp_host[e.offset : e.offset + e.numel]
                dst.copy_(g.reshape(-1).float(), non_blocking=True)
                self.stats.d2h_bytes += e.numel * 4
            done = torch.cuda.Event()
            done.record(self.stream)
        with self._cond:
            self._pending += 1
        self.norms[u] = None
        self._jobs.put((u, slab, done, local, want_norm))

    @staticmethod
    def _merge_foreign(local: list, pending: list) -> list:
        merged = list(local)
        for e, g in pending:
            for i, (le, lg) in enumerate(merged):
                if le.tensor is e.tensor:
                    merged[i] = (le, g.to(lg.dtype) + lg)
                    break
            else:
                merged.append((e, g))
        return merged

    def flush_foreign(self) -> None:
        """Accumulate tied-weight contributions whose owner did not run in this backward."""
        pending, self._foreign = self._foreign, {}
        for owner, items in pending.items():
            for e, g in items:
                self._count(g)
                self.store.accumulate_grad(e, g)
            self.norms[owner] = None

    def _count(self, g: torch.Tensor) -> None:
        if g.device.type != "cpu":
            self.stats.d2h_bytes += g.numel() * g.element_size()

    def _take_slab(self) -> _Slab:
        while True:
            try:
                return self._free.get(timeout=1.0)
            except queue.Empty:
                self.raise_error()
                if self._worker is None or not self._worker.is_alive():
                    raise RuntimeError("megatrain gradient worker is not running") from None

    def __del__(self) -> None:
        jobs = getattr(self, "_jobs", None)
        if jobs is not None:
            jobs.put(None)

    # ------------------------------------------------------------------ worker
    def _process(self, job) -> None:
        u, slab, done, local, want_norm = job
        try:
            done.synchronize()
            n_lp = self.store.buffers[u].n_lp
            for e, _ in local:
                if e.wire == torch.float32:
                    src = slab.fp_host[e.offset - n_lp : e.offset - n_lp + e.numel]
                else:
                    src = slab.lp_host[e.offset : e.offset + e.numel]
                self.store.accumulate_grad(e, src)
            if want_norm:
                self.norms[u] = self._unit_norms(u)
        except BaseException as exc:  # surfaced in the training thread by raise_error()
            logger.exception("gradient accumulation of unit %d failed", u)
            self._error = exc
        finally:
            self._free.put(slab)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    # ------------------------------------------------------------------ results
    def wait(self) -> None:
        """Block until every submitted gradient is in the host accumulators."""
        if self._foreign:
            self.flush_foreign()
        with self._cond:
            while self._pending:
                self._cond.wait(timeout=1.0)
                if self._worker is not None and not self._worker.is_alive():
                    raise RuntimeError("megatrain gradient worker died")
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"megatrain gradient accumulation failed: {error!r}") from error

    def _grad_key(self, u: int) -> tuple:
        """Identity and version of unit ``u``'s gradients: a cached norm is valid while it holds."""
        grads = [e.tensor.grad for e in self.store.entries[u] if e.owner == u and e.kind == "trainable"]
        return tuple((id(g), g._version) if g is not None else None for g in grads)

    def _unit_norms(self, u: int) -> tuple[tuple, list[torch.Tensor]]:
        grads = [e.tensor.grad for e in self.store.entries[u] if e.owner == u and e.kind == "trainable"]
        present = [g for g in grads if g is not None]
        return self._grad_key(u), (list(torch._foreach_norm(present)) if present else [])

    def global_norm(self) -> torch.Tensor:
        """L2 norm over all host gradients, like ``torch.nn.utils.clip_grad_norm_`` computes it."""
        self.wait()
        norms: list[torch.Tensor] = []
        for u in range(len(self.norms)):
            # recompute when the gradients changed since (a training_step override edited them)
            if self.norms[u] is None or self.norms[u][0] != self._grad_key(u):
                self.norms[u] = self._unit_norms(u)
            norms.extend(self.norms[u][1])
        if not norms:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def reset_norms(self) -> None:
        self.norms = [None] * len(self.norms)



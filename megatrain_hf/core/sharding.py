"""Unit sharding over ``torch.distributed`` ranks: who owns a unit, and the collectives per unit.

Data parallelism with host state sharded by unit: unit ``u`` has one *owner* rank,
``u % world_size`` (interleaved, so every rank's CPU has updates to run throughout a step). Only the
owner holds the unit's fp32 masters, gradient accumulator and optimizer state; other ranks lay the
unit's parameters into a small ring of receive slots (``HostStore``) and, for every fetch of the
unit, receive its masters by a broadcast from the owner. When a unit's backward has landed its
gradients on the host, they are summed into the owner's accumulator (``reduce`` to the owner, in
pieces of 8 MiB: no collective holds a whole tensor) and the other ranks drop theirs. The global
gradient norm is the all-reduced sum of the owners' squares.

The collectives run on the host flats over a gloo group (host RAM is where these tensors live, on
CPU and GPU runs alike). Every rank runs the same model code on the same number of batches, so the
calls line up: the order of fetches and gradient sends is the model's own order on each rank. Two
groups keep two threads apart: ``weights`` (fetches: the training thread) and ``grads`` (the
gradient worker on CUDA, the training thread on the CPU). A collective that waits longer than
``timeout`` raises on every rank (gloo's timeout), naming the unit.

A model call on some ranks only (``if trainer.is_world_process_zero(): model.generate(...)``) would wait
in its first weight broadcast for ranks that never come, then blame them. So every top-level model
call first agrees with the other ranks on it (:meth:`UnitSharding.agree_on_call`, through the process
group's key-value store, which a timeout leaves usable): the ranks publish the n-th call's kind and
wait for each other's. A call whose kind differs on another rank (a forward without gradients here, a
training forward there) raises at once on both; a call no other rank makes raises after
``LONE_CALL_WAIT_S`` (calls without gradients; training forwards wait ``timeout``), with the cause and
the fix (:class:`LoneRankCallError`).
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from ..errors import CollectiveError, LoneRankCallError
from . import host_pages

logger = logging.getLogger(__name__)

PIECE_NUMEL = 2 * 2**20  # elements of one gradient reduce on the host path (8 MiB of fp32)
LONE_CALL_WAIT_S = 30.0
"""Seconds a model call without gradients (generate, evaluation) waits for the other ranks to make it
too (at most ``collective_timeout_s``); then it is a call on this rank alone and raises."""


class UnitSharding:
    """Owner map and per-unit collectives of one data-parallel process group."""

    _made = 0  # UnitSharding objects made in this process: the same sequence on every rank

    def __init__(self, num_units: int, timeout_s: float = 300.0, rank: int | None = None,
                 world_size: int | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("megatrain: unit sharding needs torch.distributed initialised (torchrun / accelerate "
                               "launch); call torch.distributed.init_process_group first.")
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.num_units = num_units
        self._piece: torch.Tensor | None = None  # reduce_grad_pieces' scratch, allocated at first use
        timeout = datetime.timedelta(seconds=timeout_s)
        # gloo for host tensors, whatever the default backend is (NCCL on GPUs)
        self.weights = dist.new_group(backend="gloo", timeout=timeout)
        self.grads = dist.new_group(backend="gloo", timeout=timeout)
        self.scalars = dist.new_group(backend="gloo", timeout=timeout)
        self._needs_mean = False
        UnitSharding._made += 1
        self._index, self._timeout_s, self._calls, self._call_store = UnitSharding._made, timeout_s, 0, None
        logger.info("megatrain: data parallel over %d ranks (rank %d owns units %s)", self.world_size, self.rank,
                    self.owned_units())

    def owner(self, u: int) -> int:
        return u % self.world_size

    def owns(self, u: int) -> bool:
        return self.owner(u) == self.rank

    def owned_units(self) -> list[int]:
        return [u for u in range(self.num_units) if self.owns(u)]

    def _run(self, what: str, u: int, fn) -> None:
        try:
            fn()
        except Exception as exc:
            raise CollectiveError(
                f"megatrain rank {self.rank}/{self.world_size}: the {what} of unit {u} failed ({exc}). Another "
                "rank stopped or raised (its error is in its own output); every rank stops."
            ) from exc

    # ------------------------------------------------------------------ model calls
    def agree_on_call(self, kind: str, training: bool) -> None:
        """Wait until every rank makes its next model call too, of the same ``kind`` (see the module
        docstring); raise :class:`LoneRankCallError` otherwise."""
        if self._call_store is None:
            from torch.distributed.distributed_c10d import _get_default_store

            self._call_store = dist.PrefixStore(f"megatrain/calls/{self._index}/", _get_default_store())
        store, n = self._call_store, self._calls
        keys = [f"{n}/{r}" for r in range(self.world_size)]
        store.set(keys[self.rank], kind)
        wait_s = self._timeout_s if training else min(LONE_CALL_WAIT_S, self._timeout_s)
        try:
            store.wait(keys, datetime.timedelta(seconds=wait_s))
        except Exception as exc:  # the store's timeout (DistStoreError): a call made here only
            absent = [r for r, key in enumerate(keys) if not store.check([key])]
            if not absent:
                raise  # not a timeout
            store.delete_key(keys[self.rank])  # not made: the next call is the n-th again
            raise LoneRankCallError(
                f"megatrain rank {self.rank}/{self.world_size}: {kind} was made on this rank, and rank(s) {absent} "
                f"did not make a model call within {wait_s:g} s. Under data parallelism each rank holds only the "
                "units it owns and receives the others' weights from their owners in every forward, so every "
                "model call (forward, generate, evaluation) is collective; a call on one rank alone (`if "
                "trainer.is_world_process_zero(): model.generate(...)`) cannot run. Fix: make the call on every "
                "rank and use rank 0's result; or gather the weights first (megatrain_hf.gather_state_dict(model) "
                "on every rank, or trainer.save_model()) and generate on rank 0 from a plain model loaded with "
                "them; if the other ranks were only busy longer (writing a checkpoint), call "
                "torch.distributed.barrier() before the call."
            ) from exc
        kinds = {r: store.get(key).decode() for r, key in enumerate(keys)}
        if n:
            store.delete_key(f"{n - 1}/{self.rank}")  # every rank has read call n-1's kinds (it made call n)
        self._calls += 1
        if len(set(kinds.values())) > 1:
            raise LoneRankCallError(
                f"megatrain rank {self.rank}/{self.world_size}: model call {n} differs between the ranks ("
                + "; ".join(f"rank {r}: {k}" for r, k in kinds.items()) + "). Under data parallelism every model "
                "call is collective: each rank must make the same calls in the same order. Fix: make the call "
                "on every rank (e.g. generate on every rank and use rank 0's result), or gather the weights "
                "first (megatrain_hf.gather_state_dict(model) on every rank, or trainer.save_model()) and "
                "generate on rank 0 from a plain model loaded with them."
            )

    # ------------------------------------------------------------------ weights
    def broadcast_master(self, u: int, flat: torch.Tensor) -> None:
        """The owner's masters of unit ``u`` into ``flat`` on every rank (the owner's own flat is sent)."""
        self._run("weight broadcast", u, lambda: dist.broadcast(flat, src=self.owner(u), group=self.weights))

    # ------------------------------------------------------------------ gradients
    def reduce_grad(self, u: int, flat: torch.Tensor) -> None:
        """Sum every rank's gradient of unit ``u`` into the owner's ``flat``."""
        self._run("gradient reduce", u, lambda: dist.reduce(flat, dst=self.owner(u), op=dist.ReduceOp.SUM,
                                                            group=self.grads))
        self._needs_mean = True

    def reduce_grad_pieces(self, u: int, dst: torch.Tensor | None, src: torch.Tensor | None, numel: int) -> None:
        """Sum every rank's ``numel``-element gradient of a tensor of unit ``u`` into the owner's ``dst``
        (1-D fp32), in pieces of :data:`PIECE_NUMEL` elements, every rank cutting at the same offsets: a
        collective never holds more than a piece (gloo's receive buffers are a piece, not the tensor).

        The owner passes its accumulator's region (its own contribution in it already) as ``dst``; the
        other ranks pass the gradient as computed (``src``, 1-D, any float dtype; None: no contribution,
        zeros are sent), copied piece by piece into a small scratch buffer (a reduce may write into a
        non-root's buffer), so the sender's whole gradient is never copied."""
        root = self.owns(u)
        for first in range(0, numel, PIECE_NUMEL):
            n = min(PIECE_NUMEL, numel - first)
            if root:
                piece = dst[first : first + n]
            else:
                piece = self._scratch(n)
                if src is None:
                    piece.zero_()
                else:
                    piece.copy_(src[first : first + n])
            self.reduce_grad(u, piece)

    def _scratch(self, n: int) -> torch.Tensor:
        if self._piece is None:
            self._piece = torch.empty(PIECE_NUMEL, dtype=torch.float32)
        return self._piece[:n]

    def take_mean(self, grads: list[torch.Tensor]) -> None:
        """Once per optimizer step, before gradients are read: the owners' sums become means (DDP's average)."""
        if self._needs_mean:
            self._needs_mean = False
            if grads:
                torch._foreach_div_(grads, float(self.world_size))

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a float scalar) summed over the ranks."""
        out = value.detach().to(torch.float64).reshape(1).clone()
        self._run("scalar all-reduce", -1, lambda: dist.all_reduce(out, group=self.scalars))
        return out[0].to(value.dtype)

    def gather_to(self, u: int, flat: torch.Tensor, dst: int = 0) -> None:
        """The owner's ``flat`` of unit ``u`` into ``flat`` on rank ``dst`` (a point-to-point copy)."""
        owner = self.owner(u)
        if owner == dst:
            return
        if self.rank == owner:
            self._run("gather", u, lambda: dist.send(flat, dst=dst, group=self.weights))
        elif self.rank == dst:
            self._run("gather", u, lambda: dist.recv(flat, src=owner, group=self.weights))

    def rank0_pid(self) -> int:
        """Rank 0's process id, on every rank (names a folder all ranks write into)."""
        import os

        pid = torch.tensor([os.getpid()], dtype=torch.int64)
        self._run("pid broadcast", -1, lambda: dist.broadcast(pid, src=0, group=self.scalars))
        return int(pid[0])

    def barrier(self) -> None:
        self._run("barrier", -1, lambda: dist.barrier(group=self.scalars))


class ReceiveSlots:
    """The receive slots of the units another rank owns: a ring of master (and staging) slots, one
    for the unit computing and those being uploaded (``master_slots``), and a ring of gradient
    slots, one per gradient send still in flight (``grad_slots``). On the CPU one of each: the
    computation reads the slot directly and the gradients are reduced before the next unit's land.
    A unit is given the slot of its position among the remote units."""

    def __init__(self, store, remote: frozenset[int], master_slots: int, grad_slots: int) -> None:
        largest = max(store.n_train(u) for u in remote)
        staged = max(store.n_staged(u) for u in remote)
        self.masters = [store.allocate(largest, torch.float32) for _ in range(master_slots)]
        self.grads = [store.allocate(largest, torch.float32) for _ in range(grad_slots)]
        self.staging = ([store.allocate(staged, store.compute_dtype) for _ in range(master_slots)]
                        if store.staging.enabled and staged else [])
        self.order = {u: i for i, u in enumerate(sorted(remote))}
        self.idle = False  # True once released, until a remote unit's masters are received again

    def lay_out(self, u: int, bufs, sizes) -> None:
        i = self.order[u]
        bufs.set_masters(self.masters[i % len(self.masters)][: sizes.n_train])
        bufs.grad_host = self.grads[i % len(self.grads)][: sizes.n_train]
        if self.staging and sizes.n_staged:
            bufs.staging_host = self.staging[i % len(self.staging)][: sizes.n_staged]

    def reads_in_place(self, pinned: bool) -> bool:
        """One unpinned master slot: the CPU layout, where the computation reads the slot itself and is
        done with it once another unit is fetched (CUDA's ring is read by uploads still in flight)."""
        return not pinned and len(self.masters) == 1

    def release(self) -> None:
        """Give the master slots' pages back to the OS (their contents are dead: every fetch of a remote
        unit receives its masters again); unpinned (CPU) slots only. The gradient slots are written
        only on CUDA runs (on the CPU a remote unit's gradient is sent as computed)."""
        if not self.idle:
            for t in self.masters:
                host_pages.release(t)
            self.idle = True

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.masters, *self.grads, *self.staging))

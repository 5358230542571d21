"""Where a streamed node's input comes from in its backward: the activation checkpoints.

A unit's call keeps its input (the *checkpoint*) in a *home*: :class:`DeviceHome` (the autograd
node's saved tensor, on the compute device), :class:`HostHome` (pinned host memory,
``core/activation_offload.py``; with a disk pool, a checkpoint the RAM cannot take spills to the
disk tier, unit by unit) or :class:`DiskHome` (a file under ``offload_dir``, ``core/checkpoint_disk.py``).
Kept checkpoints are chained per micro-batch, whatever their home, so the one before comes back while
this one is back-propagated (its owner's ``prefetch``). ``checkpoint_dtype="bf16"`` keeps a floating
input rounded to bf16 in any home and widens it back in the backward (half the bytes; not exact). With ``checkpoint_interval=k`` only every k-th call of a micro-batch's
*chain* keeps it -- a chain is a run of calls each fed the very tensor the previous one returned,
unchanged -- and the backward of a call that kept none recomputes the inputs of its block from the
last kept one (each call's forward once more, without a graph, with its RNG and autocast state),
holding them for the block's other backwards (at most k-1 inputs at once).

:class:`ActivationInputs` is composed into the ``UnitRunner`` (``streamed_call.py``), which it asks
for a call's forward again (``runner.forward_again``) and for the micro-batch in progress.
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch

from ..core.activation_offload import Checkpoint, CheckpointOffload, stored_form
from ..core.checkpoint_disk import DiskCheckpoints
from ..errors import HostMemoryError

logger = logging.getLogger(__name__)


class DeviceHome:
    """Checkpoints stay on the compute device, saved by the autograd node (rounded to ``dtype`` if given)."""

    pool = None  # the pinned pool (HostHome) or the disk tier's (DiskHome)

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype  # checkpoint_dtype (None: the input's own)

    def keep(self, ctx, x: torch.Tensor, previous) -> Checkpoint | None:
        """Keep ``x`` for ``ctx``'s backward (``previous``: the micro-batch's last checkpoint kept here)."""
        stored = stored_form(x, self.dtype)
        if stored.dtype == x.dtype:
            ctx.save_for_backward(x)
            ctx.narrowed = None
        else:
            ctx.save_for_backward(stored)
            ctx.narrowed = (x.dtype, x.requires_grad)
        return None

    def load(self, ctx) -> torch.Tensor:
        x = ctx.saved_tensors[0]
        if getattr(ctx, "narrowed", None) is None:
            return x
        dtype, requires_grad = ctx.narrowed
        return x.to(dtype).requires_grad_(requires_grad)

    def _load_chained(self, ctx) -> torch.Tensor:
        """A checkpoint kept off the device: back from its pool, the micro-batch's previous one started."""
        ckpt = ctx.ckpt
        x = ckpt.owner.load(ckpt)
        if ckpt.prev is not None:
            ckpt.prev.owner.prefetch(ckpt.prev)
        ckpt.prev = None
        return x


class HostHome(DeviceHome):
    """Checkpoints in pinned host buffers (a pool reused across steps), back one call ahead; with ``spill``
    (the disk tier's pool), a checkpoint the RAM cannot take goes to disk instead."""

    def __init__(self, pool: CheckpointOffload, spill=None) -> None:
        super().__init__(pool.dtype)
        self.pool, self.spill = pool, spill

    def keep(self, ctx, x: torch.Tensor, previous) -> Checkpoint | None:
        if not x.is_floating_point():
            return super().keep(ctx, x, previous)
        if self.spill is None:
            return self.pool.save(x, previous)
        try:
            return self.pool.save(x, previous)
        except HostMemoryError:
            return self.spill().save(x, previous)

    def load(self, ctx) -> torch.Tensor:
        return super().load(ctx) if ctx.ckpt is None else self._load_chained(ctx)


class DiskHome(DeviceHome):
    """Checkpoints in the disk tier's file (``core/checkpoint_disk.py``), back one call ahead."""

    def __init__(self, pool) -> None:
        super().__init__(pool.dtype)
        self.pool = pool

    def keep(self, ctx, x: torch.Tensor, previous) -> Checkpoint | None:
        if not x.is_floating_point():
            return super().keep(ctx, x, previous)
        return self.pool.save(x, previous)

    def load(self, ctx) -> torch.Tensor:
        return super().load(ctx) if ctx.ckpt is None else self._load_chained(ctx)


class CheckpointHomes:
    """The engine's checkpoint homes, as the plan's ``ActivationPlan`` places them: the device
    (``offload_checkpoints=False``), pinned host (``True``, or turned on by the GPU budget under
    ``"auto"``: :meth:`start_offload`), or the disk tier's file (``"disk"``; with an ``offload_dir``
    also where the RAM cannot take a host checkpoint). The file is made on first use, closed at detach.

    ``store`` gives the pinned bytes (``allocate``/``free``); ``available_host()`` the RAM the pool may
    still take, less ``headroom``; ``pin`` whether the disk tier's staging is pinned.
    """

    def __init__(self, inputs: ActivationInputs, act, store, stats, streams, available_host, headroom: int,
                 pin: bool) -> None:
        self.inputs, self.act = inputs, act
        self._store, self._stats, self._streams = store, stats, streams
        self._available_host, self._headroom, self._pin = available_host, headroom, pin
        self.disk_file: DiskCheckpoints | None = None  # the disk tier's checkpoint file (made on first use)
        inputs.home = DeviceHome(act.checkpoint_dtype)
        if act.offload_checkpoints is True:
            self.start_offload()
        elif act.offload_checkpoints == "disk":
            inputs.home = DiskHome(self.disk())

    def start_offload(self) -> None:
        """Checkpoints go to pinned host memory from the next call on."""
        act = self.act
        pool = CheckpointOffload(self._store.allocate, self._store.free, self._available_host, self._headroom,
                                 self._stats, self._streams, act.checkpoint_dtype)
        self.inputs.home = HostHome(pool, self.disk if act.disk_dir is not None else None)

    def disk(self) -> DiskCheckpoints:
        """The disk tier's checkpoint file (made on first use: a spill, or ``offload_checkpoints="disk"``)."""
        if self.disk_file is None:
            act = self.act
            pin = (lambda n: self._store.allocate(n, torch.uint8)) if self._pin else None
            self.disk_file = DiskCheckpoints(act.disk_dir, self._stats, self._streams, pin, act.checkpoint_dtype)
            logger.info("megatrain: activation checkpoints on the disk tier in %s", self.disk_file.run_dir)
        return self.disk_file

    def close(self) -> None:
        if self.disk_file is not None:
            self.disk_file.close()


class ActivationInputs:
    """The checkpoints of one runner's calls (see module docstring)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.home: DeviceHome = DeviceHome()
        self.interval = 1  # keep the checkpoint of every k-th call of a chain (the engine sets it)
        # units whose checkpoint stays on the device whatever the home (the engine: the head, whose
        # backward comes first: its checkpoint would come back as soon as it went down)
        self.device_units: frozenset[int] = frozenset()
        self._chains: dict[int, weakref.ref] = {}  # micro-batch -> its last checkpoint kept in the home
        self._last_out: dict[int, tuple] = {}  # micro-batch -> (its last output, its version, chain position)

    @property
    def offload(self) -> CheckpointOffload | None:
        """The pinned pool of host-kept checkpoints (None: they stay on the device)."""
        return self.home.pool

    def microbatch_key(self) -> int:
        group = self.runner.group
        return group.current.index if group is not None and group.current is not None else 0

    # ------------------------------------------------------------------ forward
    def start_chain(self) -> None:
        """A micro-batch's forward starts (the first unit's call): a new chain."""
        key = self.microbatch_key()
        self._chains.pop(key, None)
        self._last_out.pop(key, None)

    def position(self, call, x: torch.Tensor) -> int:
        """This call's place in the micro-batch's chain of calls, each fed the very output of the one
        before (0: it keeps its checkpoint); sets ``call.parent`` when the input is not kept but
        recomputed from the previous call in the backward (``checkpoint_interval`` > 1)."""
        k = self.interval
        last = self._last_out.get(self.microbatch_key())
        if k <= 1 or last is None or not x.is_floating_point() or call.kernel is not None:
            return 0
        ref, version, position = last
        node = x.grad_fn
        if ref() is not x or x._version != version or node is None:
            return 0  # something between the units changed the tensor: keep this input
        position = (position + 1) % k
        if position:
            call.parent = node
        return position

    def produced(self, out: torch.Tensor, position: int) -> None:
        """The call at ``position`` of its chain returned ``out`` (the next call's input, maybe)."""
        if self.interval > 1:
            self._last_out[self.microbatch_key()] = (weakref.ref(out), out._version, position)

    def keep(self, ctx, x: torch.Tensor) -> None:
        """The node ``ctx`` keeps its input ``x`` in the home (its block's first call only)."""
        key = self.microbatch_key()
        last = self._chains.get(key)
        if ctx.call.unit in self.device_units:
            ctx.ckpt = DeviceHome.keep(self.home, ctx, x, None)
            ctx.chain_prev = last() if last is not None else None  # started when this one is used
            return
        ctx.ckpt = self.home.keep(ctx, x, last() if last is not None else None)
        if ctx.ckpt is not None:
            self._chains[key] = weakref.ref(ctx.ckpt)

    def clear(self) -> None:
        """A backward ends (or failed): no forward continues a chain across it."""
        self._last_out.clear()

    # ------------------------------------------------------------------ backward
    def input_of(self, ctx) -> torch.Tensor:
        """A streamed node's input in its backward: its checkpoint (from the home), or recomputed from
        the last kept one (``checkpoint_interval``), the block's other inputs held for their own backward."""
        if ctx.recomputed is not None:
            x, ctx.recomputed = ctx.recomputed, None
            return x
        if ctx.parent is None:
            x = self.home.load(ctx)
            prev = getattr(ctx, "chain_prev", None)
            if prev is not None:
                ctx.chain_prev = None
                prev.owner.prefetch(prev)
            return x
        chain, node = [ctx], ctx.parent
        while node.parent is not None and node.recomputed is None:
            chain.append(node)
            node = node.parent
        x = self.input_of(node)
        node.recomputed = x  # its own backward comes after the block's
        for child in reversed(chain):
            x = self.runner.forward_again(node.call, x)
            child.recomputed, node = x, child
        ctx.recomputed = None
        return x

    @contextlib.contextmanager
    def replayed_rng(self, call):
        """The RNG state the call's forward drew from (CPU, and the device's), restored afterwards;
        a call that drew nothing (``cpu_rng`` None) runs on the current state."""
        device = self.runner.device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=call.cpu_rng is not None, device_type=device.type):
            if call.cpu_rng is not None:
                torch.set_rng_state(call.cpu_rng)
                if call.dev_rng is not None:
                    torch.cuda.set_rng_state(call.dev_rng, device)
            yield

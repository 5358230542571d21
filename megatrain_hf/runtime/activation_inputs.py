"""Where a streamed node's input comes from in its backward: the activation checkpoints.

A unit's call keeps its input (the *checkpoint*) in a *home*: :class:`DeviceHome` (the autograd
node's saved tensor, on the compute device) or :class:`HostHome` (pinned host memory,
``core/activation_offload.py``, chained per micro-batch so the one before comes back while this
one is back-propagated). With ``checkpoint_interval=k`` only every k-th call of a micro-batch's
*chain* keeps it -- a chain is a run of calls each fed the very tensor the previous one returned,
unchanged -- and the backward of a call that kept none recomputes the inputs of its block from the
last kept one (each call's forward once more, without a graph, with its RNG and autocast state),
holding them for the block's other backwards (at most k-1 inputs at once).

:class:`ActivationInputs` is composed into the ``UnitRunner`` (``streamed_call.py``), which it asks
for a call's forward again (``runner.forward_again``) and for the micro-batch in progress.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from ..core.activation_offload import Checkpoint, CheckpointOffload


class DeviceHome:
    """Checkpoints stay on the compute device, saved by the autograd node."""

    pool = None  # the pinned pool (HostHome)

    def keep(self, ctx, x: torch.Tensor, previous) -> Checkpoint | None:
        """Keep ``x`` for ``ctx``'s backward (``previous``: the micro-batch's last checkpoint kept here)."""
        ctx.save_for_backward(x)
        return None

    def load(self, ctx) -> torch.Tensor:
        return ctx.saved_tensors[0]


class HostHome(DeviceHome):
    """Checkpoints in pinned host buffers (a pool reused across steps), back one call ahead."""

    def __init__(self, pool: CheckpointOffload) -> None:
        self.pool = pool

    def keep(self, ctx, x: torch.Tensor, previous) -> Checkpoint | None:
        if not x.is_floating_point():
            return super().keep(ctx, x, previous)
        return self.pool.save(x, previous)

    def load(self, ctx) -> torch.Tensor:
        if ctx.ckpt is None:
            return super().load(ctx)
        x = self.pool.load(ctx.ckpt)  # back from the host; the previous checkpoint starts up
        self.pool.prefetch(ctx.ckpt.prev)
        ctx.ckpt.prev = None
        return x


class ActivationInputs:
    """The checkpoints of one runner's calls (see module docstring)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.home: DeviceHome = DeviceHome()
        self.interval = 1  # keep the checkpoint of every k-th call of a chain (the engine sets it)
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
            return self.home.load(ctx)
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

"""Where a streamed node's input comes from in its backward: the activation checkpoints.

A unit's call keeps its input (the *checkpoint*) on the device, or in pinned host memory with
``offload_checkpoints`` (``core/activation_offload.py``, chained per micro-batch so the one before comes back
while this one is back-propagated). With ``checkpoint_interval=k`` only every k-th call of a
micro-batch's *chain* keeps it -- a chain is a run of calls each fed the very tensor the previous
one returned, unchanged -- and the backward of a call that kept none recomputes the inputs of its
block from the last kept one (each call's forward once more, without a graph, with its RNG and
autocast state), holding them for the block's other backwards (at most k-1 inputs at once).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING

import torch

from ..core.activation_offload import Checkpoint

if TYPE_CHECKING:
    from .streamed_call import Call


class Checkpoints:
    """The checkpoint part of :class:`~megatrain_hf.runtime.streamed_call.UnitRunner` (a mixin: it
    reads the runner's ``offload``, ``group``, ``streamer``, ``compute``, ``_autocast`` and
    ``_last_out``, ``_chains``, ``checkpoint_interval``).
    """

    # ------------------------------------------------------------------ checkpoint_interval
    def _chain_position(self, call: "Call", x: torch.Tensor) -> int:
        """With ``checkpoint_interval=k``: this call's place in the micro-batch's chain of calls, each
        fed the very output of the one before (0: it keeps its checkpoint); sets ``call.parent`` when
        the input is not kept but recomputed from the previous call in the backward."""
        k = self.checkpoint_interval
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

    def input_of(self, ctx) -> torch.Tensor:
        """A streamed node's input in its backward: its checkpoint (saved, offloaded), or recomputed
        from the last kept one (``checkpoint_interval``), the block's other inputs held for their own
        backward."""
        if ctx.recomputed is not None:
            x, ctx.recomputed = ctx.recomputed, None
            return x
        if ctx.parent is None:
            if ctx.ckpt is None:
                return ctx.saved_tensors[0]
            x = self.offload.load(ctx.ckpt)  # back from the host; the previous checkpoint starts up
            self.offload.prefetch(ctx.ckpt.prev)
            ctx.ckpt.prev = None
            return x
        chain, node = [ctx], ctx.parent
        while node.parent is not None and node.recomputed is None:
            chain.append(node)
            node = node.parent
        x = self.input_of(node)
        node.recomputed = x  # its own backward comes after the block's
        for child in reversed(chain):
            x = self._forward_again(node.call, x)
            child.recomputed, node = x, child
        ctx.recomputed = None
        return x

    @contextlib.contextmanager
    def replayed_rng(self, call: "Call"):
        """The RNG state the call's forward drew from (CPU, and the device's), restored afterwards;
        a call that drew nothing (``cpu_rng`` None) runs on the current state."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=call.cpu_rng is not None, device_type=self.device.type):
            if call.cpu_rng is not None:
                torch.set_rng_state(call.cpu_rng)
                if call.dev_rng is not None:
                    torch.cuda.set_rng_state(call.dev_rng, self.device)
            yield

    def _forward_again(self, call: "Call", x: torch.Tensor) -> torch.Tensor:
        """A call's forward once more (no graph), with its RNG and autocast state: its output again."""
        with self.replayed_rng(call):
            with torch.no_grad(), self._autocast(call.autocast):
                # as a recompute: only the hooks that changed a value in the forward run again (others
                # would record twice, e.g. captured router logits)
                out = self.compute(call, x.detach(), self.streamer.fetch(call.unit), recompute=True)
        self.stats.forward_units -= 1  # a recompute is not a forward
        return out.requires_grad_(True) if out.is_floating_point() else out  # it came out of a streamed node

    # ------------------------------------------------------------------ checkpoint offload
    def microbatch_key(self) -> int:
        group = self.group
        return group.current.index if group is not None and group.current is not None else 0

    def offload_checkpoint(self, x: torch.Tensor) -> Checkpoint | None:
        """With offloaded checkpoints: ``x`` saved to the host, linked to its micro-batch's chain."""
        if self.offload is None or not x.is_floating_point():
            return None
        key = self.microbatch_key()
        last = self._chains.get(key)
        ckpt = self.offload.save(x, last() if last is not None else None)
        self._chains[key] = weakref.ref(ckpt)
        return ckpt

"""The memory plan under data parallelism: host RAM per rank and per host, GPU memory per GPU.

Unit ``u``'s masters, gradient accumulator, AdamW moments and staging copy live on its owner rank
``u % world_size`` only (``core/sharding.py``); every other rank lays the unit into receive slots
(on GPUs: three master + staging slots and ``MAX_PENDING_SENDS + 2`` gradient slots of the largest
unit another rank owns; the gradient slots on the CPU are never written). A tied embedding (read by
the head) is kept whole, masters and staging, on every rank. Frozen weights (LoRA base weights) are
whole on every rank. Ranks fill hosts in order (``torchrun``: rank = node x GPUs per node + local
rank). Each GPU streams the whole model: its memory is the single-GPU plan's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..errors import MegatrainConfigError
from ..core.grads import MAX_PENDING_SENDS
from ..core.layout import lay_out
from .plan import _DTYPE_BY_NAME, LORA_TARGETS, MemoryPlan, _layout


@dataclass(frozen=True)
class RankPlan:
    world_size: int
    nodes: int
    rank_bytes: tuple[int, ...]
    """Host bytes of each rank: its units' four fp32 tiers and staging, receive slots, frozen weights."""
    slot_bytes: tuple[int, ...]
    """The receive slots among ``rank_bytes``."""
    host_bytes: tuple[int, ...]
    """Host bytes of each host: the sum over its ranks."""
    gpu_bytes: int
    """Estimated peak bytes of each GPU (the single-GPU plan's)."""

    def table(self) -> str:
        gib = 2**30
        per_node = self.world_size // self.nodes
        lines = [f"DATA PARALLEL: {self.world_size} ranks on {self.nodes} host(s), {per_node} per host, "
                 f"units owned by rank = unit % {self.world_size}"]
        for r, (b, s) in enumerate(zip(self.rank_bytes, self.slot_bytes)):
            lines.append(f"  rank {r:<3} host RAM {b / gib:9.2f} GiB  (receive slots {s / gib:.2f})")
        for n, b in enumerate(self.host_bytes):
            lines.append(f"  host {n:<3} host RAM {b / gib:9.2f} GiB")
        lines.append(f"  each GPU (estimate) {self.gpu_bytes / gib:9.2f} GiB")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "nodes": self.nodes, "rank_bytes": list(self.rank_bytes),
                "slot_bytes": list(self.slot_bytes), "host_bytes": list(self.host_bytes), "gpu_bytes": self.gpu_bytes}


def plan_ranks(plan: MemoryPlan, world_size: int, nodes: int = 1, host_staging: bool = True, gpu: bool = True,
               lora_targets: Iterable[str] = LORA_TARGETS) -> RankPlan:
    """Split ``plan`` (from :func:`plan_memory`, with the same ``host_staging`` and ``lora_targets``)
    over ``world_size`` ranks on ``nodes`` hosts; ``gpu=False``: CPU ranks (one master slot, no
    gradient slot written)."""
    if type(world_size) is not int or world_size < 1:
        raise MegatrainConfigError(f"world_size={world_size!r}: must be an int >= 1 (the number of processes / GPUs)")
    if type(nodes) is not int or nodes < 1 or world_size % nodes:
        raise MegatrainConfigError(f"nodes={nodes!r}: must be an int >= 1 that divides world_size={world_size} "
                                   "(torchrun starts the same number of processes on every host)")
    dtype = _DTYPE_BY_NAME[plan.compute_dtype]
    units = _layout(plan.shape, plan.lora_rank, tuple(lora_targets), experts_dtype=plan.experts_dtype)
    sizes = [lay_out(u.specs(dtype)) for u in units]
    staging = host_staging and dtype != torch.float32
    stage_bytes = dtype.itemsize if staging else 0
    tied = {0} if any(u.reads_embedding for u in units) else set()
    frozen = sum(n * d.itemsize for s in sizes for d, n in s.frozen.items())
    rank_bytes, slot_bytes = [], []
    for rank in range(world_size):
        own = remote_train = remote_staged = 0
        total = frozen
        for u, s in enumerate(sizes):
            if not s.n_train:
                continue
            if u % world_size == rank:
                own += 16 * s.n_train + stage_bytes * s.n_staged
            elif u in tied:  # read by the head: whole on every rank (no gradient or moments)
                own += 4 * s.n_train + stage_bytes * s.n_staged
            else:
                remote_train = max(remote_train, s.n_train)
                remote_staged = max(remote_staged, s.n_staged)
        master_slots, grad_slots = (3, MAX_PENDING_SENDS + 2) if gpu else (1, 0)
        slots = master_slots * (4 * remote_train + stage_bytes * remote_staged) + grad_slots * 4 * remote_train
        if world_size == 1:
            slots = 0
        rank_bytes.append(total + own + slots + plan.host_checkpoints)
        slot_bytes.append(slots)
    per_node = world_size // nodes
    host_bytes = tuple(sum(rank_bytes[n * per_node:(n + 1) * per_node]) for n in range(nodes))
    return RankPlan(world_size, nodes, tuple(rank_bytes), tuple(slot_bytes), host_bytes, plan.gpu_total)


"""Where a unit's fp32 masters live when the disk tier holds them (``offload_state="all"``).

A unit's master flat is ``[staged | fp32-wire]`` (``layout.py``). The staged part (the matrices,
which the device streams through the bf16 staging copy, so only the update reads their masters)
can live in the disk tier's file of the unit: the store is handed a mapping of that file's bytes
(``MAP_SHARED``) and the matrices' ``nn.Parameter`` objects alias slices of it, so whatever reads a
parameter outside the update (``state_dict``, ``save_pretrained``, ``load_state_dict``, user code)
reads or writes the file through the page cache, a page at a time, never a copy of the model in
RAM. The fp32-wire tail (norms, biases, embeddings, LoRA: what the device streams as fp32) moves
into a RAM flat of its own, aliased by those parameters as before. The update never reads the
mapping: it runs on the disk tier's RAM slot (one read, one write per unit per step).
"""

from __future__ import annotations

import torch

from .store import HostStore, alias


def page_masters(store: HostStore, u: int, mapped: torch.Tensor, writes=None) -> None:
    """Unit ``u``'s staged masters now live in ``mapped`` (``n_staged`` fp32 elements that already hold
    their current values): re-point the parameters, keep the fp32-wire tail in RAM, free the RAM flat.
    ``writes``: a weak method that waits for the write-backs into ``mapped``'s file (``HostStore.wait_master_writes``)."""
    bufs = store.buffers[u]
    n = bufs.n_staged
    if mapped.dtype != torch.float32 or mapped.numel() != n:
        raise ValueError(f"page_masters: unit {store.names[u]} needs {n} fp32 elements, got {mapped.numel()} "
                         f"{mapped.dtype}")
    fresh = store.staging.fresh(u)
    old, old_tail = bufs.master_host, bufs.master_tail if bufs.master_paged is not None else None
    tail = store.allocate(store.n_train(u) - n, torch.float32)
    tail.copy_(bufs.master_tail)
    for e in store.owned_trainable(u):
        e.tensor.data = alias(mapped, e.offset, e.shape) if e.offset < n else alias(tail, e.offset - n, e.shape)
    bufs.master_host, bufs.staged_master, bufs.master_tail, bufs.master_paged = None, mapped, tail, mapped
    bufs.master_writes = writes
    for flat in (old, old_tail):
        if flat is not None:
            store.free(flat)  # (unpinned; its memory goes back to malloc once nothing aliases it)
    if fresh:
        store.staging.written(u)  # the copy still matches: only the parameters' storage changed
    else:
        store.staging.mark_dirty(u)

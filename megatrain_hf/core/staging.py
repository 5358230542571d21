"""The staging copy: each unit's matrix masters in the compute dtype, what crosses the link for them.

``staging_host`` (one flat per unit, in the store's per-unit buffers) holds ``master[:n_staged]``
rounded to the compute dtype once per update instead of in every matmul. :class:`StagingCache`
knows whether a unit's copy still matches its masters: changes are known from :meth:`mark_dirty`
(optimizer steps, a data-parallel receive) or from the parameters' version counters
(``load_state_dict``, in-place edits); version counters alone are not enough, since the fused CPU
AdamW kernel does not bump them. :class:`NoStaging` is the same interface where there is no copy
(fp32 compute, or ``host_staging=False``): a fetch reads the fp32 masters and the device rounds them.
"""

from __future__ import annotations

import torch

from .layout import Entry


class NoStaging:
    """No compute-dtype copy: the fp32 masters themselves are read (and rounded on the device)."""

    enabled = False

    def __init__(self, store) -> None:
        self.store = store

    def allocate(self, u: int, bufs) -> None:
        """Unit ``u``'s copy, if it has one."""

    def read(self, u: int, staged: torch.Tensor) -> torch.Tensor:
        """What a fetch sends for unit ``u``'s staged masters ``staged``."""
        return staged

    def mark_dirty(self, u: int) -> None:
        """Unit ``u``'s masters changed."""

    def fresh(self, u: int) -> bool:
        """Whether unit ``u``'s copy matches its masters (False: it has none)."""
        return False

    def written(self, u: int) -> None:
        """An update wrote the copy of every master of unit ``u`` it changed."""

    def stage(self, u: int, master: torch.Tensor | None = None) -> None:
        """Refresh unit ``u``'s copy if its masters changed (``master``: from there)."""

    def slice(self, e: Entry) -> torch.Tensor | None:
        """Entry ``e``'s slice of its owner's copy (None: no copy, or sent in fp32)."""
        return None


class StagingCache(NoStaging):
    """The compute-dtype copies of the store's units and their freshness (see module docstring)."""

    enabled = True

    def __init__(self, store, compute_dtype: torch.dtype) -> None:
        super().__init__(store)
        self.compute_dtype = compute_dtype

    def allocate(self, u: int, bufs) -> None:
        if bufs.n_staged and bufs.staging_host is None:
            bufs.staging_host = self.store.allocate(bufs.n_staged, self.compute_dtype)

    def read(self, u: int, staged: torch.Tensor) -> torch.Tensor:
        self.stage(u)
        return self.store.buffers[u].staging_host

    def _versions(self, u: int) -> tuple[int, ...]:
        return tuple(e.tensor._version for e in self.store.owned_trainable(u))

    def mark_dirty(self, u: int) -> None:
        self.store.buffers[u].staging_dirty = True

    def fresh(self, u: int) -> bool:
        bufs = self.store.buffers[u]
        return bufs.staging_host is not None and not bufs.staging_dirty and self._versions(u) == bufs.staged_versions

    def written(self, u: int) -> None:
        bufs = self.store.buffers[u]
        bufs.staging_dirty = False
        bufs.staged_versions = self._versions(u)

    def stage(self, u: int, master: torch.Tensor | None = None) -> None:
        bufs = self.store.buffers[u]
        if bufs.staging_host is None:
            return
        versions = self._versions(u)
        if bufs.staging_dirty or versions != bufs.staged_versions:
            bufs.staging_host.copy_(master if master is not None else bufs.staged_master)
            bufs.staging_dirty = False
            bufs.staged_versions = versions

    def slice(self, e: Entry) -> torch.Tensor | None:
        staging = self.store.buffers[e.owner].staging_host
        return staging[e.offset : e.offset + e.numel] if staging is not None and e.wire != torch.float32 else None

"""The per-unit gradient norms and the global norm that clipping reads (``NormBook``).

Each unit's per-tensor L2 norms are recorded when its gradients land: from the device (computed on
what was sent, so the global norm is known when backward ends) or from the host accumulators.
A record is valid while the unit's gradients keep the identity and version they had when it was
made (``key``); a training_step override or a callback that edits ``.grad`` makes it stale, and
:meth:`global_norm` recomputes that unit from the host. Under data parallelism the owners' norms
are combined over the ranks as one scalar (``ownership.combine_norm``).

A resident unit's gradients are on the compute device (``resident.py``): its key is the device
accumulator's, its norms are device scalars, and :meth:`global_norm` brings them to the host in one
copy before the sum, in unit order (the same sum as of host norms).
"""

from __future__ import annotations

import torch


class NormBook:
    def __init__(self, store) -> None:
        self.store = store
        self.norms: list[tuple | None] = [None] * len(store.entries)  # (grad key, per-tensor norms)

    def _resident(self, u: int):
        resident = self.store.resident
        return resident if resident is not None and u in resident.grad else None

    def key(self, u: int) -> tuple:
        """Identity and version of unit ``u``'s gradients: a recorded norm is valid while it holds."""
        resident = self._resident(u)
        if resident is not None:
            return resident.grad_key(u)
        grads = [e.tensor.grad for e in self.store.owned_trainable(u)]
        return tuple((id(g), g._version) if g is not None else None for g in grads)

    def record(self, u: int, key: tuple, norms: list[torch.Tensor]) -> None:
        self.norms[u] = (key, norms)

    def forget(self, u: int) -> None:
        self.norms[u] = None

    def compute(self, u: int) -> tuple[tuple, list[torch.Tensor]]:
        """(key, norms) of unit ``u``'s gradients now (the host's, or a resident unit's on the device)."""
        resident = self._resident(u)
        grads = [resident.gradient(e) if resident is not None else e.tensor.grad for e in self.store.owned_trainable(u)]
        present = [g for g in grads if g is not None]
        # dtype=: a bf16 gradient is cast to fp32 first (vector_norm's documented meaning), as an fp32 .grad
        return self.key(u), (list(torch._foreach_norm(present, 2, dtype=torch.float32)) if present else [])

    def refresh(self, u: int) -> None:
        """Record unit ``u``'s norms from its host gradients."""
        self.norms[u] = self.compute(u)

    def global_norm(self) -> torch.Tensor:
        """L2 norm over all host gradients, as ``torch.nn.utils.clip_grad_norm_`` computes it (the
        gradients must have landed: ``GradSink.global_norm`` waits first)."""
        norms: list[torch.Tensor] = []
        on_device: list[int] = []  # positions of resident units' norms (device scalars)
        for u in range(len(self.norms)):
            # recompute when the gradients changed since (a training_step override edited them)
            if self.norms[u] is None or self.norms[u][0] != self.key(u):
                self.norms[u] = self.compute(u)
            if self._resident(u) is not None:
                on_device.extend(range(len(norms), len(norms) + len(self.norms[u][1])))
            norms.extend(self.norms[u][1])
        if on_device:  # one copy to the host, then the same sum as of host norms
            for i, n in zip(on_device, torch.stack([norms[i] for i in on_device]).to("cpu").unbind()):
                norms[i] = n
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros(())
        return self.store.ownership.combine_norm(total)

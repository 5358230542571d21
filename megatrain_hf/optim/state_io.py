"""HostAdamW's state as torch's AdamW shows it, and each unit's state tensors as the tiers hold them.

``state_dict()`` / ``load_state_dict()`` in ``torch.optim.AdamW``'s layout, whether the moments are
fp32 flats in RAM, compressed (``compressed.py``) or paged from the disk tier (``paged_state.py``);
``state_spec(u)`` / ``unit_state(u)``: a unit's contiguous state tensors, what checkpoints and the
disk tier read and write as bytes. A mixin of :class:`~.host_adamw.HostAdamW` (its attributes).
"""

from __future__ import annotations

import contextlib

import torch

from .compressed import unit_spec


class AdamWStateIO:
    def state_spec(self, u: int) -> dict[str, tuple[int, torch.dtype]]:
        """Unit ``u``'s contiguous state tensors: name -> (elements, dtype); the disk tier pages these as bytes."""
        if self.moments is not None:  # the codes and scales (or bf16 moments) of the compressed format
            return dict(self.moments.specs[u])
        return unit_spec(self.format, [], self.store.n_train(u))

    def unit_state(self, u: int, write: bool = False):
        """Unit ``u``'s state tensors, resident while the block runs (no update running: after :meth:`synchronize`);
        ``write=True``: what the block changed is kept (written back when the state is on disk)."""
        if self._paged(u):  # (its moments; a master on disk too stays in the file)
            return self._pager.state(u, write)
        if self.moments is not None:
            return contextlib.nullcontext(self.moments.tensors[u])
        return contextlib.nullcontext({"exp_avg": self._exp_avg[u], "exp_avg_sq": self._exp_avg_sq[u]})

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy a saved state into the host flats, tensor by tensor, from any device.

        torch's ``load_state_dict`` first builds new tensors for the whole state on the
        parameters' device: a second full copy of the moments (8 bytes/param) in host RAM.
        """
        self.synchronize()
        saved = state_dict["state"]
        # torch validates the groups (sizes, hooks) and maps the saved ids to parameters by position
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        loaded = {p: saved[i] for i, p in zip(ids, params) if i in saved}
        self._build_state_views()
        for u, groups in self._plan.items():
            if self.moments is not None:  # compressed from the saved fp32 values (in RAM or in a slot)
                with self.unit_state(u, write=True) as tensors:
                    states = self.moments.views(u, tensors)
                    for gi, entries in groups.items():
                        for e, step in zip(entries, self._steps[(u, gi)]):
                            src = loaded.get(e.tensor, {})
                            step.fill_(float(src["step"]) if "step" in src else 0.0)
                            for k, key in enumerate(("exp_avg", "exp_avg_sq")):
                                value = src[key].reshape(e.shape) if key in src else torch.zeros(e.numel)
                                states[id(e.tensor)].assign(self.format, k, value)
                continue
            with self.unit_state(u, write=True) as flats:
                for gi, entries in groups.items():
                    for e, step in zip(entries, self._steps[(u, gi)]):
                        src = loaded.get(e.tensor, {})
                        step.fill_(float(src["step"]) if "step" in src else 0.0)
                        for key in ("exp_avg", "exp_avg_sq"):
                            view = flats[key][e.offset : e.offset + e.numel].view(e.shape)
                            if key in src:
                                view.copy_(src[key].reshape(e.shape))
                            else:  # no saved state: a fresh start, as torch's AdamW would make
                                view.zero_()

    def _build_state_views(self) -> None:
        for u, groups in self._plan.items():
            for gi, entries in groups.items():
                for e, step in zip(entries, self._steps[(u, gi)]):
                    if self.moments is not None or self._paged(u):  # no fp32 views: a copy is built
                        self.state[e.tensor] = {"step": step}
                        continue
                    self.state[e.tensor] = {
                        "step": step,
                        "exp_avg": self._exp_avg[u][e.offset : e.offset + e.numel].view(e.shape),
                        "exp_avg_sq": self._exp_avg_sq[u][e.offset : e.offset + e.numel].view(e.shape),
                    }

    # ------------------------------------------------------------------ update
    def state_dict(self):
        """torch AdamW's layout; compressed moments are expanded to fp32 copies, moments on disk read into RAM
        (either way a full fp32 copy)."""
        self.synchronize()
        out = super().state_dict()
        if self.moments is not None:
            index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
            for u, groups in self._plan.items():
                with self.unit_state(u) as tensors:  # paged in from the disk tier when it is there
                    states = self.moments.views(u, tensors)
                    for entries in groups.values():
                        for e in entries:
                            st = states[id(e.tensor)]
                            out["state"][index[id(e.tensor)]].update(
                                exp_avg=st.expand(self.format, 0).view(e.shape),
                                exp_avg_sq=st.expand(self.format, 1).view(e.shape))
        elif self._pager is not None:
            from .paged_state import fill_state_dict

            fill_state_dict(self, out)
        return out

"""HostAdamW's scheduler when units are resident on the device (``MegaTrainConfig(resident_units=N)``).

:class:`ResidentWorker` is the default :class:`~.update_worker.HostWorker` (one worker, units in forward
order, readiness gates) whose resident units (``core/resident.py``) are updated on the device state
instead of the host flats: their fp32 masters, gradient accumulators and moments there, in place,
nothing copied down. The arithmetic is :func:`~.kernels.torch_update`'s: the step counts incremented,
``clip_grad_norm_``'s multiply by the step's clip coefficient, then ``torch._fused_adamw_`` (the kernel of
``AdamW(fused=True)``; on the CPU the same kernel on the same values as the host update: bitwise). A
step the optimizer skips (non-finite gradient norm) dispatches nothing, for these units as for the
others. HostAdamW's ``synchronize()`` (its ``state_dict``, the state files) copies the device state down
(``export``); its loads copy the moments up (``imported``).
"""

from __future__ import annotations

import torch

from .kernels import UnitJob
from .update_worker import HostWorker


class ResidentWorker(HostWorker):
    """The host worker; the resident units' jobs run on the device state (see module docstring)."""

    def __init__(self, updater, gates, threads: int, resident) -> None:
        super().__init__(updater, gates, threads)
        self.resident = resident
        resident.bind_moments(updater.moments.in_ram)  # fp32 in RAM: the plan refuses other formats and the disk tier

    @classmethod
    def factory(cls, resident):
        """``HostAdamW(scheduler=...)``'s builder of this scheduler over ``resident``."""
        return lambda updater, gates, threads: cls(updater, gates, threads, resident)

    def update(self, job: UnitJob) -> None:
        if job.unit in self.resident.units:
            update_on_device(self.resident, job)
        else:
            self.updater.update(job)

    def export(self) -> None:
        self.resident.sync_down()

    def imported(self, u: int | None = None) -> None:
        self.resident.moments_changed(u)


def update_on_device(resident, job: UnitJob) -> None:
    """AdamW of one resident unit on its device state, as ``kernels.torch_update`` on the host flats."""
    u, device = job.unit, resident.device
    for w in job.work:
        params, exp_avgs, exp_avg_sqs = resident.entry_views(u, w.entries)
        torch._foreach_add_(w.steps, 1)
        # the gradients snapshotted by step(): the device accumulators (or a tensor the user put in .grad)
        grads = [g if g.device == device else g.to(device) for g in w.grads]
        grads = [g if g.dtype == torch.float32 else g.float() for g in grads]
        if w.clip is not None:
            torch._foreach_mul_(grads, w.clip.to(device))  # exactly clip_grad_norm_'s multiply
        steps = w.steps if device.type == "cpu" else [s.to(device) for s in w.steps]
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=w.lr, beta1=w.beta1,
            beta2=w.beta2, weight_decay=w.weight_decay, eps=w.eps, maximize=w.maximize, grad_scale=None,
            found_inf=None,
        )
    resident.updated(u)

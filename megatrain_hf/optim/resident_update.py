"""HostAdamW's scheduler when units are resident on the device (``MegaTrainConfig(resident_units=N)``).

:class:`ResidentWorker` is the default :class:`~.update_worker.HostWorker` (one worker, units in forward
order, readiness gates) for the streamed units; the resident units' jobs (``core/resident.py``) do not
go to it: ``dispatch`` issues them at once, in the training thread, on the device state (fp32 masters,
gradient accumulators and moments there, in place, nothing copied down), in the device's stream order
(``ResidentState.run_update``: on CUDA a side stream after the step's gradients, whose event the next
fetch of the unit waits on; on the CPU inline). No readiness gate is closed for them.

The arithmetic is :func:`~.kernels.torch_update`'s: the step counts incremented (on the host, where
HostAdamW keeps them; their values go up), ``clip_grad_norm_``'s multiply by the step's clip coefficient,
then ``torch._fused_adamw_`` (the kernel of ``AdamW(fused=True)``; on the CPU the same kernel on the
same values as the host update: bitwise). A step the optimizer skips (non-finite gradient norm)
dispatches nothing, for these units as for the others. HostAdamW's ``synchronize()`` (its
``state_dict``, the state files) copies the device state down (``export``); its loads copy the moments
up (``imported``).
"""

from __future__ import annotations

import torch

from ..errors import UsageError
from .kernels import UnitJob
from .update_worker import HostWorker


class ResidentWorker(HostWorker):
    """The host worker for the streamed units; the resident units' updates in stream order (see module docstring)."""

    def __init__(self, updater, gates, threads: int, resident) -> None:
        super().__init__(updater, gates, threads)
        self.resident = resident
        self._device_numel = 0  # elements of the resident units' updates issued since the last take
        self._binding = resident.bind_moments(updater.moments.in_ram)  # fp32 in RAM (the plan refuses the rest)

    @classmethod
    def factory(cls, resident):
        """``HostAdamW(scheduler=...)``'s builder of this scheduler over ``resident``."""
        return lambda updater, gates, threads: cls(updater, gates, threads, resident)

    def dispatch(self, jobs: list[UnitJob]) -> None:
        """The streamed units' jobs to the host worker; the resident units' issued now."""
        if self.resident.binding is not self._binding:
            raise UsageError(
                "HostAdamW: a newer HostAdamW of this model took over its resident units' device moments (one "
                "optimizer updates them at a time), so this one would step the other's state. Fix: step the newest "
                "optimizer (engine.host_optimizer(...) or Trainer's), or build this one again.")
        units = self.resident.units
        super().dispatch([job for job in jobs if job.unit not in units])
        for job in jobs:
            if job.unit in units:
                self.resident.run_update(job.unit, lambda job=job: update_on_device(self.resident, job))
                self._device_numel += job.numel

    def take_device_numel(self) -> int:
        """Elements of the resident units' updates issued since the last call."""
        out, self._device_numel = self._device_numel, 0
        return out

    def export(self) -> None:
        self.resident.sync_down()

    def imported(self, u: int | None = None) -> None:
        self.resident.moments_changed(u)


def update_on_device(resident, job: UnitJob) -> None:
    """AdamW of one resident unit on its device state, as ``kernels.torch_update`` on the host flats (run on
    the stream ``ResidentState.run_update`` chose).

    The step counts' new values and the clip coefficient go up together (``ResidentState.upload_scalars``: one
    non-blocking copy from pinned memory, so the training thread does not wait for the update stream). A
    tensor ``lr`` stays on the host, as ``AdamW(fused=True)`` passes it: the kernel reads a host ``lr`` as a
    scalar (CUDA's ``lr.is_cpu()`` branch), where a device ``lr`` would cost a blocking copy and must be fp32."""
    u = job.unit
    for w in job.work:
        params, exp_avgs, exp_avg_sqs = resident.entry_views(u, w.entries)
        torch._foreach_add_(w.steps, 1)  # HostAdamW's counters (host scalars): their new values go up
        scalars = resident.upload_scalars([*w.steps, *([w.clip] if w.clip is not None else [])])
        steps = scalars[: len(w.steps)]
        grads = w.grads  # views of the device accumulators, snapshotted by step()
        if w.clip is not None:
            torch._foreach_mul_(grads, scalars[-1])  # exactly clip_grad_norm_'s multiply
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=w.lr, beta1=w.beta1,
            beta2=w.beta2, weight_decay=w.weight_decay, eps=w.eps, maximize=w.maximize, grad_scale=None,
            found_inf=None,
        )
    resident.updated(u)

"""GpuBudget: a GPU memory budget (``max_gpu_memory``) while training, and what it decides.

It caps PyTorch's allocator at the budget (switching it to expandable segments: at the cap,
fixed segments fragment and every failed allocation empties the cache, a device-wide
synchronisation), measures the GPU peak of the first steps, and sizes the layer-major schedule
from the measurements: how many micro-batches run per group. The first optimizer step runs its
micro-batches one at a time, the next at most two (a second measurement: the peak's growth per
micro-batch, which also covers what grows besides the checkpoints, e.g. full logits without the
chunked loss), then as many as the two measurements allow. With ``offload_checkpoints="auto"``,
when the budget fits fewer micro-batches than the step has and the host RAM can take the
checkpoints of two, it turns checkpoint offload on and measures again.

Planned on active bytes (allocated, plus blocks freed but still read by another stream, e.g.
inputs whose checkpoint copy is pending), with ``BUDGET_MARGIN`` left for fragmentation. Not on
reserved bytes: under a cap the caching allocator keeps freed blocks until an allocation fails,
so what it holds drifts up to the cap whatever the step needs and would never let a second
micro-batch in.

With offloaded checkpoints it also bounds the micro-batches per group by what host RAM holds.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from .host import DEFAULT_HEADROOM_BYTES

logger = logging.getLogger(__name__)

BUDGET_MARGIN = 0.9
"""Fraction of the budget planned for allocated bytes (the rest: fragmentation, estimate error)."""


def use_expandable_segments() -> Callable[[], None] | None:
    """Switch the caching allocator to expandable segments; return the undo, or None if unchanged.

    Applies to segments created after it; the user's own ``PYTORCH_ALLOC_CONF`` /
    ``PYTORCH_CUDA_ALLOC_CONF`` wins.
    """
    if any("expandable_segments" in os.environ.get(name, "") for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")):
        return None
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch < 2.12
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        logger.warning("megatrain: this torch cannot switch the CUDA allocator to expandable segments at run "
                       "time; under max_gpu_memory or max_seq_len set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        return None
    setter("expandable_segments:True")
    return lambda: setter("expandable_segments:False")


def _active_peak(device: torch.device) -> int:
    """Peak of the allocator's active bytes since the last reset (allocated if not reported)."""
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("active_bytes.all.peak", stats.get("allocated_bytes.all.peak", 0)))


class GpuBudget:
    """The GPU memory budget of one engine (``budget_bytes=None``: no budget, nothing is capped).

    ``offload`` returns the engine's checkpoint offload (None while off), ``start_offload`` turns
    it on, ``available_host`` gives the host RAM offloaded checkpoints may still take, and
    ``on_undo`` registers the allocator settings' undo with the engine; ``expandable`` switches the allocator to
    expandable segments without a budget (the plan's choice under ``max_seq_len``). ``peak_source`` is the
    measurement (the allocator's active-bytes peak since the last reset on CUDA; None: nothing is
    measured, no budget applies); tests on the CPU set ``budget`` and ``peak_source`` themselves.
    """

    def __init__(self, device: torch.device, budget_bytes: int | None, offload_mode: bool | str,
                 offload: Callable[[], object], start_offload: Callable[[], None],
                 available_host: Callable[[], int], on_undo: Callable[[Callable[[], None]], None],
                 expandable: bool = False) -> None:
        self.device = device
        self.budget = budget_bytes
        self._offload_mode = offload_mode
        self._offload, self._start_offload, self._available_host = offload, start_offload, available_host
        self.in_flight: int | None = None  # micro-batches per group in the current step (None: no step seen)
        self._ckpt_bytes = 0  # activation-checkpoint bytes kept on the device since the last observation
        self._peaks: dict[int, int] = {}  # micro-batches in flight -> GPU peak of the last such step
        self._per_microbatch = 0  # activation-checkpoint bytes of one micro-batch (measured)
        self._offload_per_token: float | None = None  # host checkpoint bytes per token of a micro-batch
        self.microbatch_tokens = 0  # the most tokens one training micro-batch has had
        self._host_fit_logged = False
        self.peak_source: Callable[[], int] | None = None
        # the largest peaks seen before each reset of the statistics (reset per measured step)
        self.max_peak_allocated = self.max_peak_reserved = 0
        if device.type != "cuda":
            return
        if budget_bytes is None:
            undo = use_expandable_segments() if expandable else None
            if undo is not None:
                on_undo(undo)
                logger.info("megatrain: CUDA allocator on expandable segments (max_seq_len: long sequences "
                            "fragment fixed segments)")
            return
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, budget_bytes / total)
        previous = torch.cuda.get_per_process_memory_fraction(device) if hasattr(
            torch.cuda, "get_per_process_memory_fraction") else 1.0
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        on_undo(lambda: torch.cuda.set_per_process_memory_fraction(previous, device))
        undo = use_expandable_segments()
        if undo is not None:
            on_undo(undo)
        self.peak_source = lambda: _active_peak(device)
        torch.cuda.empty_cache()  # blocks cached before the cap (e.g. a model initialised on the GPU)
        torch.cuda.reset_peak_memory_stats(device)
        logger.info("megatrain: GPU memory capped at %.2f GiB (%.1f%% of %s)%s", budget_bytes / 2**30,
                    100 * fraction, torch.cuda.get_device_name(device),
                    ", allocator on expandable segments" if undo is not None else "")

    def note_call(self, checkpoint_bytes: int, tokens: int) -> None:
        """A training call kept ``checkpoint_bytes`` on the device; ``tokens`` entered the embedding."""
        self._ckpt_bytes += checkpoint_bytes
        self.microbatch_tokens = max(self.microbatch_tokens, tokens)

    def microbatches_in_flight(self, k: int) -> int:
        """How many of a step's ``k`` micro-batches to run per layer-major group."""
        k = min(k, self._host_fit(k))
        if self.budget is None or self.peak_source is None:
            return k
        if not self._peaks:
            return 1
        low = min(self._peaks)
        per = self._per_microbatch
        if len(self._peaks) > 1:
            high = max(self._peaks)
            per = max(per, (self._peaks[high] - self._peaks[low]) // (high - low))
        if per <= 0:
            return k if len(self._peaks) > 1 else min(k, 2)
        base = self._peaks[low] - low * per
        room = BUDGET_MARGIN * self.budget - base
        fits = int(room // per)
        if fits < k:  # one measurement over-estimates what fits, so fewer than k is certain already
            rest = per - self._per_microbatch  # what a micro-batch would still add with offloaded checkpoints
            with_offload = k if rest <= 0 else int(room // rest)
            if with_offload > max(1, fits) and self._offload_instead(max(1, fits), k):
                return 1
        if len(self._peaks) == 1:
            fits = min(fits, 2)
        return max(1, min(k, fits))

    def _host_fit(self, k: int) -> int:
        """With offloaded checkpoints: micro-batches whose checkpoints the host RAM can hold.

        The first step runs one at a time and its pool size is one micro-batch's checkpoints;
        later steps fit what the pool and the RAM still available hold.
        """
        offload = self._offload()
        if offload is None:
            return k
        if self._offload_per_token is None:
            return 1
        capacity = offload.pool_bytes + self._available_host() - DEFAULT_HEADROOM_BYTES
        per_microbatch = max(1, int(self._offload_per_token * self.microbatch_tokens))
        fits = max(1, capacity // per_microbatch)
        if fits < k and not self._host_fit_logged:
            self._host_fit_logged = True
            logger.info("megatrain: host RAM holds the offloaded checkpoints of %d of the step's %d micro-batches "
                        "(%.2f GiB each); the step runs in groups of %d", fits, k, per_microbatch / 2**30, fits)
        return fits

    def observe_step(self, microbatches: int) -> None:
        """After an optimizer step of ``microbatches``: its GPU peak and checkpoint bytes per micro-batch."""
        offload = self._offload()
        if offload is not None and self._offload_per_token is None and microbatches > 0 and self.microbatch_tokens:
            # the first step ran one micro-batch at a time: its peak is one micro-batch's checkpoints
            self._offload_per_token = offload.peak_in_use_bytes / self.microbatch_tokens
        nbytes, self._ckpt_bytes = self._ckpt_bytes, 0
        if self.budget is None or self.peak_source is None or microbatches <= 0 or len(self._peaks) >= 2:
            return  # two group sizes measured: the plan is set, peak statistics are left alone
        self._per_microbatch = max(self._per_microbatch, nbytes // microbatches)
        self._peaks[self.in_flight or 1] = int(self.peak_source())
        self._restart_peaks()

    @property
    def per_microbatch_bytes(self) -> int:
        """Activation-checkpoint bytes one micro-batch kept on the device (measured; 0 before)."""
        return self._per_microbatch

    @property
    def kept_checkpoint_bytes(self) -> int:
        """Activation-checkpoint bytes kept on the device by the calls since the last observation."""
        return self._ckpt_bytes

    @property
    def offload_bytes_per_token(self) -> float | None:
        """Offloaded checkpoint bytes per token of a micro-batch (measured in the first step; None before)."""
        return self._offload_per_token

    def _restart_peaks(self) -> None:
        """Keep the peaks so far (``max_peak_*``, reported) and reset CUDA's statistics for the next measurement."""
        if self.device.type == "cuda":
            self.max_peak_allocated = max(self.max_peak_allocated, torch.cuda.max_memory_allocated(self.device))
            self.max_peak_reserved = max(self.max_peak_reserved, torch.cuda.max_memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)

    def _offload_instead(self, fits: int, k: int) -> bool:
        """``offload_checkpoints="auto"``: the budget fits ``fits`` < ``k``; offload if the host can hold
        two micro-batches' checkpoints, and measure again (the next steps run one, then two)."""
        if self._offload_mode != "auto" or self._offload() is not None or self._per_microbatch <= 0:
            return False
        if self._available_host() - DEFAULT_HEADROOM_BYTES < 2 * self._per_microbatch:
            return False
        logger.info("megatrain: max_gpu_memory fits %d of the step's %d micro-batches with the activation "
                    "checkpoints on the GPU; offloading them to host memory (%.2f GiB per micro-batch) and "
                    "measuring again", fits, k, self._per_microbatch / 2**30)
        self._start_offload()
        self._peaks, self._per_microbatch = {}, 0
        self.microbatch_tokens = 0  # the host measurement divides by the switch step's tokens
        self._restart_peaks()  # the new measurements start from here
        return True

    def peak_allocated(self) -> int:
        """The largest allocated peak since the engine started (CUDA only; statistics resets included)."""
        return max(torch.cuda.max_memory_allocated(self.device), self.max_peak_allocated)

    def peak_reserved(self) -> int:
        return max(torch.cuda.max_memory_reserved(self.device), self.max_peak_reserved)

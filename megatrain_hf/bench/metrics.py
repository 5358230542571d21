"""What a benchmark worker measures while Trainer trains: step times, memory, losses, link bytes.

- :class:`StepTimer` is a ``TrainerCallback``. Each optimizer step is timed from the end of the
  previous step to the end of this one (so data loading, logging and anything a system defers
  across the step boundary are all paid for), and split at Trainer's own events: ``between``
  (previous step end -> ``on_step_begin``: logging, fetching the step's batches), ``fwd_bwd``
  (-> ``on_pre_optimizer_step``: every micro-batch's forward + backward, and gradient clipping),
  ``optimizer`` (-> ``on_optimizer_step``), ``post`` (-> ``on_step_end``: scheduler, zero_grad).
  On CUDA every boundary synchronizes the device first, so GPU work is charged to the phase that
  queued it. Systems do different work in the same phase (DeepSpeed steps its optimizer inside
  backward), so compare phase times across systems with care; compare totals freely.
- It also reads the losses Trainer logs (``logging_steps=1``) and, for megatrain, the engine's
  counters (``engine_of(model).stats``) as increments that survive the plugin resetting them.
- :class:`ResourceSampler` is a background thread sampling host RSS (and, on CUDA, device memory
  in use as the driver sees it) every 50 ms; ``stop()`` joins it.
"""

from __future__ import annotations

import logging
import resource
import statistics
import threading
import time
from typing import Any

import psutil
import torch
from transformers import TrainerCallback

from .trend import step_trend

logger = logging.getLogger(__name__)

PHASES = ("between", "fwd_bwd", "optimizer", "post")


class StepTimer(TrainerCallback):
    """Per-optimizer-step wall times, phase split, logged losses and engine counter increments."""

    megatrain_observes_weights = False  # times and traces the step: reads no parameter or gradient

    def __init__(self, cuda_sync: bool) -> None:
        self.cuda_sync = cuda_sync
        self.steps: list[dict[str, Any]] = []
        self.losses: dict[int, float] = {}
        self.grad_norms: dict[int, float] = {}
        self.engine_logs: dict[int, dict[str, float]] = {}
        self._marks: dict[str, float] = {}
        self._last_end: float | None = None
        self._counters_seen: dict[str, int] = {}
        self._counters_step: dict[str, int] = {}

    def _now(self) -> float:
        if self.cuda_sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self._last_end = self._now()
        self._read_counters(kwargs.get("model"))
        self._counters_step = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self._marks = {"begin": self._now()}
        self._read_counters(kwargs.get("model"))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._marks["pre_opt"] = self._now()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._marks["opt"] = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        end = self._now()
        self._read_counters(kwargs.get("model"))
        begin = self._marks.get("begin", end)
        pre_opt = self._marks.get("pre_opt", end)
        opt = self._marks.get("opt", pre_opt)
        start = self._last_end if self._last_end is not None else begin
        self.steps.append(
            {
                "step": state.global_step,
                "total_s": end - start,
                "between_s": begin - start,
                "fwd_bwd_s": pre_opt - begin,
                "optimizer_s": opt - pre_opt,
                "post_s": end - opt,
                "engine_counters": dict(self._counters_step) or None,
                **memory_now(self.cuda_sync),
            }
        )
        self._counters_step = {}
        self._last_end = end

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])
        if logs.get("grad_norm") is not None:
            self.grad_norms[state.global_step] = float(logs["grad_norm"])
        engine_logs = {k: float(v) for k, v in logs.items() if k.startswith("megatrain/")}
        if engine_logs:
            self.engine_logs[state.global_step] = engine_logs

    def _read_counters(self, model) -> None:
        """Add to this step the increase of every int counter of the megatrain engine's stats.

        The plugin resets the counters when it logs; a value lower than the last one seen means a
        reset happened in between, so the whole current value is new.
        """
        stats = _engine_stats(model)
        if stats is None:
            return
        for name, value in _int_fields(stats).items():
            last = self._counters_seen.get(name, 0)
            increment = value - last if value >= last else value
            self._counters_step[name] = self._counters_step.get(name, 0) + increment
            self._counters_seen[name] = value


class StepProfiler(TrainerCallback):
    """Records one optimizer step with ``torch.profiler`` (CPU, CUDA, all threads) into a Chrome trace.

    For finding where a step's time goes, not for measuring it: the worker runs it after the
    measured steps. Recording starts at the previous step's optimizer step, so that the background
    update that the step's forward waits on is in the trace from its start, and ends once the
    step's own update finished. The trace shows the compute, copy and gradient streams and
    megatrain's ``megatrain.*`` ranges (unit updates on the host and device workers);
    ``scripts/trace_summary.py`` condenses it.
    """

    megatrain_observes_weights = False  # times and traces the step: reads no parameter or gradient

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path
        self._prof = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 2 == self.step and self._prof is None:  # in the step before
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            try:  # the update's ranges run on worker threads
                config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
            except (AttributeError, TypeError):  # a torch without it: the training thread only
                config = None
            self._prof = profile(activities=activities, experimental_config=config)
            self._prof.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        if self._prof is not None:  # training ended before the recorded step did: stop, keep no trace
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self._prof is not None and state.global_step == self.step:
            inner = getattr(optimizer, "optimizer", optimizer)
            if hasattr(inner, "synchronize"):  # HostAdamW: its update of this step, to the end
                inner.synchronize()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(self.path)
            logger.info("profiled step %d: %s", self.step, self.path)


def _engine_stats(model) -> Any | None:
    if model is None:
        return None
    try:
        from megatrain_hf import engine_of
    except ImportError:
        return None
    engine = engine_of(model)
    return getattr(engine, "stats", None) if engine is not None else None


def _int_fields(stats: Any) -> dict[str, int]:
    names = ("h2d_bytes", "d2h_bytes", "forward_units", "backward_units", "tokens")
    found = {name: getattr(stats, name, None) for name in names}
    extra = {k: v for k, v in vars(stats).items() if not k.startswith("_")} if hasattr(stats, "__dict__") else {}
    found.update(extra)
    return {k: int(v) for k, v in found.items() if isinstance(v, int) and not isinstance(v, bool)}


class ResourceSampler:
    """Background sampler of host RSS and (optionally) CUDA device memory in use."""

    def __init__(self, interval_s: float = 0.05, cuda_device: int | None = None) -> None:
        self.interval_s = interval_s
        self.cuda_device = cuda_device
        self.peak_rss_bytes = 0
        self.peak_device_used_bytes: int | None = None
        self.marks: dict[str, dict[str, float]] = {}  # phase -> host RSS now and peak so far (GiB)
        self._process = psutil.Process()
        self._lock = threading.Lock()  # a sample in flight must not undo reset_device_peak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-resource-sampler", daemon=True)

    def start(self) -> ResourceSampler:
        self._thread.start()
        return self

    def _sample(self) -> None:
        self.peak_rss_bytes = max(self.peak_rss_bytes, self._process.memory_info().rss)
        # The driver's view (includes the CUDA context and memory outside PyTorch's allocator);
        # only once the main thread created the context, so sampling never creates one itself.
        if self.cuda_device is not None and torch.cuda.is_initialized():
            with self._lock:
                free, total = torch.cuda.mem_get_info(self.cuda_device)
                self.peak_device_used_bytes = max(self.peak_device_used_bytes or 0, total - free)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except Exception as exc:  # noqa: BLE001 -- a sampler must never take the benchmark down
                logger.warning("resource sampling failed: %s", exc)
                return
            self._stop.wait(self.interval_s)

    def reset_device_peak(self) -> None:
        """Forget the device peak so far (the model's random init on the GPU is not training)."""
        with self._lock:
            self.peak_device_used_bytes = None

    def mark(self, phase: str) -> None:
        """Record the host RSS now, the peak so far and the kernel's split of the RSS, by phase.

        Logged at once as well: a worker killed for memory still leaves its phases in the log.
        """
        self._sample()
        mark = {"rss_gib": self._process.memory_info().rss / 2**30, "peak_rss_gib": self.peak_rss_bytes / 2**30}
        mark.update(proc_status_gib())
        self.marks[phase] = mark
        logger.info("host memory at %s: %s", phase, ", ".join(f"{k} {v:.2f}" for k, v in mark.items()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()


class PhaseMarks(TrainerCallback):
    """Marks the sampler at the start of training (optimizer built), after step 1, and at the end."""

    megatrain_observes_weights = False  # times and traces the step: reads no parameter or gradient

    def __init__(self, sampler: ResourceSampler) -> None:
        self.sampler = sampler

    def on_train_begin(self, args, state, control, **kwargs):
        self.sampler.mark("train_begin")

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.sampler.mark("first_step_done")

    def on_train_end(self, args, state, control, **kwargs):
        self.sampler.mark("train_end")


_STATUS_FIELDS = ("RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin", "VmHWM")


def proc_status_gib() -> dict[str, float]:
    """This process's anonymous / file / shared RSS, locked / pinned pages and RSS high-water mark
    from ``/proc/self/status`` (GiB; empty where the file does not exist)."""
    found: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in _STATUS_FIELDS:
                    found[f"{name}_gib"] = int(value.split()[0]) * 1024 / 2**30  # the kernel writes kB
    except OSError:
        pass
    return found


def memory_now(cuda: bool) -> dict[str, float]:
    """Host RSS and (with ``cuda``) the CUDA allocator's current bytes, in GiB: per step, so that a
    long run shows whether memory stays flat."""
    now = {"host_rss_gib": psutil.Process().memory_info().rss / 2**30}
    if cuda:
        now["gpu_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
        now["gpu_reserved_gib"] = torch.cuda.memory_reserved() / 2**30
    return now


def ru_maxrss_bytes() -> int:
    """Peak RSS of this process per the kernel (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def summarize_steps(steps: list[dict[str, Any]], warmup_steps: int) -> dict[str, Any]:
    """Every measured step's time (warmup steps dropped), their mean/median, their trend
    (:func:`.trend.step_trend`) and the mean phase times."""
    measured = [s for s in steps if s["step"] > warmup_steps]
    if not measured:
        raise RuntimeError(f"no measured step: {len(steps)} steps ran, {warmup_steps} of them warmup")
    totals = [s["total_s"] for s in measured]
    summary = {
        "measured_steps": len(measured),
        "step_times_s": totals,
        "warmup_step_times_s": [s["total_s"] for s in steps if s["step"] <= warmup_steps],
        "trend": step_trend(totals),
        "step_time_mean_s": statistics.fmean(totals),
        "step_time_median_s": statistics.median(totals),
        "step_time_min_s": min(totals),
        "step_time_max_s": max(totals),
        "phases_mean_s": {p: statistics.fmean(s[f"{p}_s"] for s in measured) for p in PHASES},
    }
    counters = [s["engine_counters"] for s in measured if s.get("engine_counters")]
    if counters:
        names = sorted(set().union(*counters))
        summary["engine_counters_per_step"] = {n: statistics.fmean(c.get(n, 0) for c in counters) for n in names}
    return summary

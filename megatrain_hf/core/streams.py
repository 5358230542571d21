"""The device's streams and events, behind one small interface: CUDA, or emulated on the CPU.

The transfer pipelines (uploads in ``streamer.py``, gradients in ``grads.py``, activation
checkpoints in ``offload.py``) are written against :class:`CudaStreams`. :class:`EmulatedStreams`
gives the same calls on the CPU -- every copy runs at once, in program order; events may report
completion late -- so the CPU test suite runs the real pipeline code, bookkeeping and all, not a
copy of it. On the CPU without emulation the components take their inline paths (no copies).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch


class CudaStreams:
    """Streams, events and allocations of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def on(self, stream) -> contextlib.AbstractContextManager:
        """Work issued inside runs on ``stream``."""
        return torch.cuda.stream(stream)

    def record(self, stream, *, timing: bool = False, blocking: bool = False) -> torch.cuda.Event:
        """An event marking what ``stream`` has been given so far (``blocking``: its ``synchronize()``
        sleeps instead of spinning a core)."""
        event = torch.cuda.Event(enable_timing=timing, blocking=blocking)
        event.record(stream)
        return event

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised device memory (from the caching allocator, on the current stream)."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised page-locked host memory (a target for non-blocking copies down, a source of ones up)."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        """``tensor``'s memory is not reused before the work queued on ``stream`` so far ran."""
        tensor.record_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class _EmulatedEvent:
    """Completes at ``done_at`` (``time.perf_counter()`` seconds)."""

    def __init__(self, done_at: float) -> None:
        self._done_at = done_at

    def query(self) -> bool:
        return time.perf_counter() >= self._done_at

    def synchronize(self) -> None:
        wait = self._done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)

    def elapsed_time(self, other: "_EmulatedEvent") -> float:
        return max(0.0, (other._done_at - self._done_at) * 1e3)


class _EmulatedStream:
    """Work runs at once, in program order, so every dependency holds already; what is emulated is
    when the stream's events complete: ``latency_s`` after they are recorded, and never before an
    event the stream was made to wait for (a compute stream's event recorded after a wait for a
    late upload completes with it, so the stall measured between two events is the wait's)."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self._done_at = 0.0  # when the work given to the stream so far completes

    def wait_event(self, event: Any) -> None:
        self._done_at = max(self._done_at, event._done_at)

    def wait_stream(self, stream: Any) -> None:
        self._done_at = max(self._done_at, stream._done_at)

    def synchronize(self) -> None:
        wait = self._done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


class EmulatedStreams:
    """:class:`CudaStreams`' calls on the CPU: copies run at once; events of the streams it creates
    (the transfer streams) complete ``latency_s`` late, so code that waits for a transfer before
    reading its result is exercised. The compute stream (``current()``) has no latency of its own."""

    def __init__(self, latency_s: float = 0.0) -> None:
        self.device = torch.device("cpu")
        self.latency_s = latency_s
        self._stream = _EmulatedStream(0.0)

    def new_stream(self) -> _EmulatedStream:
        return _EmulatedStream(self.latency_s)

    def current(self) -> _EmulatedStream:
        return self._stream

    def on(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def record(self, stream, *, timing: bool = False, blocking: bool = False) -> _EmulatedEvent:
        stream._done_at = max(stream._done_at, time.perf_counter() + stream.latency_s)
        return _EmulatedEvent(stream._done_at)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


Streams = CudaStreams | EmulatedStreams


def streams_for(device: torch.device) -> CudaStreams | None:
    """The streams of ``device``: CUDA's, or None on the CPU (components compute in place)."""
    return CudaStreams(device) if device.type == "cuda" else None

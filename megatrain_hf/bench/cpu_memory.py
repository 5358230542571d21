"""Peak bytes of the tensors a function allocates on the CPU, from torch's memory profiler.

``torch.profiler.profile(profile_memory=True)`` records every allocation and free of torch's CPU
allocator as a ``[memory]`` event with its signed size; their running sum in time order is the
bytes of tensor storage alive beyond what existed when the function started, its maximum the
peak. Only tensor storage is counted (not Python objects, not the allocator's own caches).
"""

from __future__ import annotations

from typing import Callable

from torch.profiler import ProfilerActivity, profile


def peak_tensor_bytes(fn: Callable[[], object]) -> int:
    """The peak of CPU tensor bytes allocated by ``fn()`` (and not freed before it), in bytes."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    alive = peak = 0
    for event in events:
        alive += event.nbytes()
        peak = max(peak, alive)
    return peak


def peaks_by_window(fn: Callable[[], object], window: str) -> tuple[int, list[int]]:
    """``(peak, per_window)`` of ``fn()``: :func:`peak_tensor_bytes`'s peak, and for each profiler event
    named ``window`` (in time order; e.g. ``"StreamedUnitBackward"``, one streamed unit's backward) the
    maximum of the running sum inside it minus the sum when it starts: the bytes that event's work
    allocated on top of what was alive."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    spans = sorted((e.start_ns(), e.end_ns()) for e in events if e.name() == window)
    alive = peak = 0
    timeline = []
    for t, n in memory:
        alive += n
        peak = max(peak, alive)
        timeline.append((t, alive))
    per_window = []
    for start, end in spans:
        base = next((a for t, a in reversed(timeline) if t < start), 0)
        per_window.append(max((a for t, a in timeline if start <= t <= end), default=base) - base)
    return peak, per_window


def streamed_layer_peak(step: Callable[[], object], layers: int, tokens: int, hidden: int) -> tuple[int, int, list[int]]:
    """``(step peak, layer peak, per-unit peaks)`` of one training step ``step()`` of a decoder-only model
    attached with megatrain on the CPU (units: embedding, ``layers`` decoder layers, final norm, head).

    The layer peak is what ``memory/activations.layer_working_set`` models: the most any decoder layer's
    streamed backward (its recompute with grad and its backward) allocates above what is alive when it
    starts, plus the fp32 ``tokens x hidden`` gradient flowing into it (allocated by the unit after it,
    counted by the plan). Backward order: the head's unit, the final norm's, the layers' last to first,
    the embedding's."""
    peak, units = peaks_by_window(step, "StreamedUnitBackward")
    if len(units) != layers + 3:
        raise RuntimeError(f"expected {layers + 3} streamed unit backwards (embedding, {layers} layers, norm, head), "
                           f"the profiler saw {len(units)}")
    return peak, max(units[2: 2 + layers]) + tokens * hidden * 4, units

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

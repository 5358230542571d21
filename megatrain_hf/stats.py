"""What the engine counts, how FLOPs are counted, and the ``megatrain/*`` metrics built from both.

FLOPs follow PaLM's model-FLOPs convention (Chowdhery et al. 2022, appendix B; nanoGPT's MFU
estimate): per trained token, ``6 N + 12 L H Q S``, with ``N`` the parameters of every matmul --
all parameters except the input-embedding lookup tables (a table tied to the head counts once, as
the head; of a mixture-of-experts layer's routed experts, the ``experts_per_token`` a token
activates) -- ``L`` layers, ``H`` attention heads, ``Q`` the head dimension and ``S`` the sequence
length; the engine's recompute is not counted. Two named conventions differ in the attention term
(``FLOPS_CONVENTIONS``): ``"palm"`` counts causal attention in full, as PaLM does
(``megatrain/tflops``); ``"palm_causal"`` halves it, ``6 N + 6 L H Q S``, the work a causal
kernel does (``megatrain/tflops_causal``). With frozen parameters (LoRA) the weight-gradient third
counts only the trainable ones: ``4 N + 2 N_trainable + 12 L H Q S`` (``6 L H Q S`` causal).

Metric levels (``MegaTrainConfig(metrics=...)``): ``"basic"`` -- throughput (tokens/s, TFLOPS),
the waits the step exposes (on the optimizer, on gradient transfers, on uploads), host RSS and
GPU peak; ``"all"`` -- also link bytes and rates, fetch and update statistics; ``"none"``. Keys
that do not apply to the compute device (GPU memory, link traffic on a CPU) are left out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import psutil
import torch

from .errors import MegatrainConfigError


FLOPS_CONVENTIONS = {
    "palm": "6*N + 12*L*H*Q*S per token: PaLM's (Chowdhery et al. 2022, App. B), causal attention counted in full",
    "palm_causal": "6*N + 6*L*H*Q*S per token: PaLM's with the attention term halved for causal attention "
                   "(the score and value matmuls of the lower triangle only)",
}
"""The FLOPs conventions the metrics and the bench report, by name (module docstring)."""


def model_flops_per_token(matmul_params: int, trainable_matmul_params: int, layers: int, heads: int,
                          head_dim: int, seq_len: int, convention: str = "palm") -> float:
    """Training FLOPs per token by ``convention`` (``FLOPS_CONVENTIONS``)."""
    if convention not in FLOPS_CONVENTIONS:
        raise MegatrainConfigError(f"FLOPs convention {convention!r}; known: {sorted(FLOPS_CONVENTIONS)}")
    attention = (6.0 if convention == "palm_causal" else 12.0) * layers * heads * head_dim * seq_len
    return 4.0 * matmul_params + 2.0 * trainable_matmul_params + attention


@dataclass
class EngineStats:
    """Counters since the last ``reset`` (read by the metrics)."""

    forward_units: int = 0
    backward_units: int = 0
    tiled_calls: int = 0  # unit computes (forwards and recomputes) whose MLP ran over sequence tiles
    tiled_layer_calls: int = 0  # of those, the ones whose every per-token operation ran over tiles (a layer recipe)
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    tokens: int = 0  # token ids entering the embedding in training calls
    model_flops: float = 0.0  # by the "palm" convention of the module docstring
    model_flops_causal: float = 0.0  # by "palm_causal"
    optimizer_wait_s: float = 0.0  # training thread blocked on a background HostAdamW update
    grad_wait_s: float = 0.0  # backward blocked on gradient transfers (queue full, or the last ones at its end)
    grad_stream_bytes: int = 0  # bytes the grad stream moved: gradients down, accumulators up
    grad_stream_busy_s: float = 0.0  # grad stream time spent on them (CUDA events)
    fetches: int = 0  # unit weight fetches
    uploads: int = 0  # ... that had to upload the unit (the others reused the copy on the device)
    fetches_not_ready: int = 0  # ... whose upload had not landed when the compute needed it
    update_h2d_bytes: int = 0  # optimizer state the device's share of the update moved (device_update)
    update_d2h_bytes: int = 0
    dequantized_bytes: int = 0  # compute-dtype bytes of quantized base weights dequantized on the device

    def __post_init__(self) -> None:
        self._flops_model: tuple[int, int, int, int, int] | None = None

    def set_flops_model(self, matmul_params: int, trainable_matmul_params: int, layers: int, heads: int,
                        head_dim: int) -> None:
        self._flops_model = (matmul_params, trainable_matmul_params, layers, heads, head_dim)

    def count_tokens(self, tokens: int, seq_len: int) -> None:
        """``tokens`` token ids of sequences of ``seq_len`` entered a training forward."""
        self.tokens += tokens
        if self._flops_model is not None:
            self.model_flops += tokens * model_flops_per_token(*self._flops_model, seq_len)
            self.model_flops_causal += tokens * model_flops_per_token(*self._flops_model, seq_len, "palm_causal")

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)


class Metrics:
    """The ``megatrain/*`` metrics of one run, since the previous :meth:`read` (training logs only)."""

    LEVELS = ("none", "basic", "all")

    def __init__(self, level: str = "basic") -> None:
        if level not in self.LEVELS:
            raise MegatrainConfigError(f"metrics={level!r}; allowed: {list(self.LEVELS)}")
        self.level = level
        self._last: float | None = None
        self._alloc_retries: int | None = None

    def start(self, engine) -> None:
        """Training starts: the first interval begins now."""
        self._last = time.perf_counter()
        engine.stats.reset()

    def read(self, engine, optimizer=None, skipped_steps: int = 0) -> dict[str, float]:
        if self.level == "none" or engine is None:
            return {}
        now = time.perf_counter()
        stats = engine.stats
        cuda = engine.device.type == "cuda"
        full = self.level == "all"
        out: dict[str, float] = {}
        if self._last is not None:
            elapsed = max(now - self._last, 1e-9)
            out["megatrain/tokens_per_s"] = stats.tokens / elapsed
            out["megatrain/tflops"] = stats.model_flops / elapsed / 1e12
            out["megatrain/tflops_causal"] = stats.model_flops_causal / elapsed / 1e12
            out["megatrain/optimizer_wait_frac"] = stats.optimizer_wait_s / elapsed
            if cuda:
                out["megatrain/grad_wait_frac"] = stats.grad_wait_s / elapsed
                out["megatrain/h2d_wait_frac"] = engine.streamer.exposed_wait_s() / elapsed
        if skipped_steps or full:
            out["megatrain/skipped_steps"] = float(skipped_steps)
        out["megatrain/host_rss_GiB"] = psutil.Process().memory_info().rss / 2**30
        tier = getattr(optimizer, "disk_tier", None)  # HostAdamW's moments on disk (offload_dir)
        if tier is not None:
            read, written = tier.take_io_stats()
            out["megatrain/disk_GB"] = (read + written) / 1e9
            if self._last is not None:
                out["megatrain/disk_GBps"] = (read + written) / 1e9 / max(now - self._last, 1e-9)
        if cuda:
            out["megatrain/gpu_peak_allocated_GiB"] = engine.budget.peak_allocated() / 2**30
            out["megatrain/gpu_peak_reserved_GiB"] = engine.budget.peak_reserved() / 2**30
        compiler = engine.runner.compiler  # compile=True: cumulative graphs, breaks, recompiles
        if compiler is not None:
            out.update(compiler.metrics())
        if full:
            out.update(self._details(engine, optimizer, now, cuda))
        stats.reset()
        self._last = now
        return out

    def _details(self, engine, optimizer, now: float, cuda: bool) -> dict[str, float]:
        stats = engine.stats
        out: dict[str, float] = {"megatrain/tokens": float(stats.tokens)}
        elapsed = max(now - self._last, 1e-9) if self._last is not None else None
        if engine.budget.in_flight is not None:
            out["megatrain/microbatches_in_flight"] = float(engine.budget.in_flight)
        if cuda:
            link = stats.h2d_bytes + stats.d2h_bytes + stats.update_h2d_bytes + stats.update_d2h_bytes
            out["megatrain/h2d_GB"] = stats.h2d_bytes / 1e9
            out["megatrain/d2h_GB"] = stats.d2h_bytes / 1e9
            if stats.update_h2d_bytes or stats.update_d2h_bytes:
                out["megatrain/update_link_GB"] = (stats.update_h2d_bytes + stats.update_d2h_bytes) / 1e9
            if elapsed is not None:
                out["megatrain/link_GBps"] = link / 1e9 / elapsed
            if stats.fetches:
                out["megatrain/h2d_not_ready_frac"] = stats.fetches_not_ready / stats.fetches
            if stats.grad_stream_busy_s > 0:  # the link's effective rate while the grad stream copied
                out["megatrain/grad_stream_GBps_busy"] = stats.grad_stream_bytes / 1e9 / stats.grad_stream_busy_s
            # allocations that failed, emptied the allocator's cache (a device synchronisation) and
            # retried: a step that keeps doing this runs at the memory cap, slowly
            retries = int(torch.cuda.memory_stats(engine.device).get("num_alloc_retries", 0))
            if self._alloc_retries is not None:
                out["megatrain/alloc_retries"] = float(retries - self._alloc_retries)
            self._alloc_retries = retries
        if optimizer is not None:  # the host update's own time, hidden or not, and its rate
            update_s, updated = optimizer.take_update_stats()
            take_device = getattr(optimizer, "take_device_numel", None)  # device_update's share, resident units
            on_device = take_device() if take_device is not None else None
            if on_device is not None and updated + on_device > 0:
                out["megatrain/update_device_frac"] = on_device / (updated + on_device)
            if elapsed is not None and update_s > 0:
                out["megatrain/update_frac"] = update_s / elapsed
                out["megatrain/update_Gparams_per_s"] = updated / update_s / 1e9
        return out

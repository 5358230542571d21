"""Benchmark harness: megatrain and its baselines, side by side, through the HF Trainer.

``main(argv)`` (wired as ``megatrain bench``; also ``python -m megatrain_hf.bench``) trains the same
Llama-shaped model with the same tokens per optimizer step, precision, activation checkpointing
and warm-up with each system -- megatrain (its defaults), plain full-GPU Trainer, DeepSpeed
ZeRO-3 offload, ZeRO-2 offload, ZeRO-Offload++ and ZenFlow, FSDP2 with CPU offload, each
configured as its experts would on one GPU -- each in its own worker process, and writes
results.json, results.md and results.png. A system that cannot run is reported with its
reason, never with numbers. TFLOPS follow PaLM's model-FLOPs convention; every measured step's
time is reported, and a system whose steps still trend is flagged.

Modules: ``presets`` (shapes), ``flops`` (the FLOP convention), ``systems`` (each system's
Trainer setup and configuration), ``worker`` (one system in one process), ``metrics`` (timing
callback, memory sampler), ``trend`` (the warm-up test), ``runner`` (the CLI), ``runinfo``
(hardware/versions/commit), ``report`` (json/md/png), ``combine`` (one report from several
invocations of one workload), ``scaling`` (depth/width scaling).
"""

from .runner import main

__all__ = ["main"]

"""Benchmark harness: megatrain and its baselines, side by side, through the HF Trainer.

``main(argv)`` (wired as ``megatrain bench``; also ``python -m megatrain_hf.bench``) trains the same
Llama-shaped model with the same tokens per optimizer step, precision and activation
checkpointing with each system -- megatrain, plain full-GPU Trainer, DeepSpeed ZeRO-3 with CPU
offload, FSDP2 with CPU offload -- each in its own worker process, and writes results.json,
results.md and results.png. A system that cannot run is reported with its reason, never with
numbers.

Modules: ``presets`` (shapes, FLOP formula), ``systems`` (each system's Trainer setup),
``worker`` (one system in one process), ``metrics`` (timing callback, memory sampler),
``runner`` (the CLI), ``runinfo`` (hardware/versions/commit), ``report`` (json/md/png).
"""

from .runner import main

__all__ = ["main"]

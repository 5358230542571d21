"""The exceptions megatrain raises for a condition the user can act on, in one module.

Every class derives from :class:`MegatrainError` *and* from the builtin type the same condition
raised before the types existed (``ValueError``, ``RuntimeError``, ``MemoryError``, ``OSError``,
``TypeError``), so ``except ValueError`` in user code still catches a bad option and ``except
MemoryError`` a host plan that does not fit. The messages keep their form: what is wrong (naming
the value), why, and ``Fix: ...``; ``docs/troubleshooting.md`` names the type of each.

What stays builtin: internal invariants (``assert``, a bare ``RuntimeError`` saying which
invariant broke), a function called with arguments of the wrong kind (``TypeError``, Python's own
convention) and a file named on the command line that does not exist (``FileNotFoundError``).

This module imports nothing, so every layer of the package may raise from it.
"""

from __future__ import annotations


class MegatrainError(Exception):
    """Base class of every error megatrain raises on purpose."""


# ---------------------------------------------------------------------------------- options
class MegatrainConfigError(MegatrainError, ValueError):
    """One option or argument has a value megatrain does not accept (``MegaTrainConfig`` fields,
    ``megatrain_hf.init()`` / ``from_pretrained`` / ``HostAdamW`` arguments, a YAML config file,
    ``megatrain estimate`` flags)."""


class IncompatibleOptionsError(MegatrainConfigError):
    """Two choices that are each valid do not combine: two options, an option and the
    ``TrainingArguments`` / accelerate config, or an option and this machine (no CUDA, one rank).
    Every such rule of the engine's options lives in ``megatrain_hf/plan.py``."""


# ---------------------------------------------------------------------------------- models, data, files
class AttentionKernelError(IncompatibleOptionsError):
    """Long context asked of an attention kernel that materialises the ``seq x seq`` scores (HF's
    eager attention): the rule of ``plan.py``, checked when a training sequence first reaches it."""


class UnsupportedModelError(MegatrainError, ValueError):
    """The model (or the checkpoint it is read from) has a family, layout, dtype or placement that
    megatrain cannot stream."""


class UnitCallableError(UnsupportedModelError):
    """A callable on a unit's module (a bound method, partial, closure or per-instance ``forward``, e.g.
    axolotl's LoRA kernels) computes with the real module or a streamed parameter and cannot be rebound to
    the unit's template exactly (``core/unit_callables.py``)."""


class TrainingDataError(MegatrainError, ValueError):
    """The training data cannot be trained on as given (empty, or longer than the model's positions)."""


class CheckpointError(MegatrainError, ValueError):
    """A saved file megatrain reads (model weights, optimizer state, a Trainer checkpoint folder) does
    not belong to this model and these options, or is damaged."""


class UnreadableCheckpointError(CheckpointError, RuntimeError):
    """A checkpoint megatrain refuses to read (pickled code) or could not read whole."""


# ---------------------------------------------------------------------------------- use of the attached model
class UsageError(MegatrainError, RuntimeError):
    """The attached model or the engine is used in a way megatrain does not support while it streams
    (attached twice, a backward it cannot see, a KV cache in training, a second gradient in one step
    of a bf16 accumulator, ...)."""


class AttachedModelError(UsageError, ValueError):
    """The attached model was changed in a way its host store cannot follow (a weight unfrozen, cast
    or moved after attach), or a parameter the store does not hold was handed to megatrain."""


class StreamedCallError(UsageError, TypeError):
    """A streamed unit was called, or returned, in a form megatrain cannot stream (no tensor input, a
    tuple output)."""


class DependencyError(MegatrainError, RuntimeError):
    """An optional package needed by the chosen option is missing or has a version/form megatrain
    does not know (TRL's fused LM head, DeepSpeed's async I/O op, Triton)."""


# ---------------------------------------------------------------------------------- resources
class UnsupportedTrlError(DependencyError):
    """A trl version outside the range megatrain trains exactly, or a trl patch of the model's ``forward``
    that reads a streamed parameter directly (``integrations/trl.py``)."""


class HostMemoryError(MegatrainError, MemoryError):
    """Host RAM is short for the plan (checked before allocating) or for offloaded activation checkpoints."""


class PinnedMemoryError(HostMemoryError, RuntimeError):
    """The OS refused to page-lock host memory (``ulimit -l``, or RAM short)."""


class DiskSpaceError(MegatrainError, MemoryError):
    """``offload_dir``'s filesystem has too little free space for the disk tier."""


class LongContextFitError(MegatrainError, MemoryError):
    """No placement of the optimizer state and the activation checkpoints fits the GPU, the host RAM and the
    disk at the sequence length asked for (``memory/long_context.py``; ``max_seq_len``'s exact placement,
    ``memory/seq_placement.py``); names the longest that fits and what fits more."""


class DiskIOError(MegatrainError, OSError):
    """A read, write, reservation or sync of the disk tier's files failed (``errno`` is the OS's)."""


# ---------------------------------------------------------------------------------- background work
class CollectiveError(MegatrainError, RuntimeError):
    """A data-parallel collective (a unit's weight broadcast, a gradient reduce) failed or timed out:
    another rank stopped or raised."""


class LoneRankCallError(UsageError):
    """Under data parallelism a model call (a forward, ``generate``, an evaluation) was made on some ranks
    and not the others: each rank holds only its units, so every model call is collective."""


class BackgroundWorkerError(MegatrainError, RuntimeError):
    """A host worker thread (gradient accumulation, the optimizer update, a layer-major micro-batch)
    failed or ended; the original error is chained (``__cause__``)."""


__all__ = [
    "MegatrainError", "MegatrainConfigError", "IncompatibleOptionsError", "AttentionKernelError",
    "UnsupportedModelError",
    "TrainingDataError", "CheckpointError", "UnreadableCheckpointError", "UsageError", "AttachedModelError",
    "StreamedCallError", "DependencyError", "UnitCallableError", "UnsupportedTrlError", "HostMemoryError",
    "PinnedMemoryError", "DiskSpaceError", "LongContextFitError", "DiskIOError", "CollectiveError",
    "BackgroundWorkerError", "LoneRankCallError",
]

"""Mixture-of-experts in bf16 against plain Trainer ``bf16=True`` on the CPU, per experts kernel and
``experts_dtype``: the largest difference of a micro-batch loss and of a parameter after 6 steps.

Each row trains the tests' tiny model of a family (``tests/helpers.py``: 2 layers, 4 experts, top-2;
the Trainer arguments of ``training_args``: 6 steps of 2 x 2 sequences of 16 tokens) twice, plain and
under megatrain, from the same seed. Plain runs are repeated for ``batched_mm``, whose gather's backward
is not bitwise reproducible on the CPU (plain against plain is printed).

Run: ``PYTHONPATH=. python scripts/moe_bf16_parity.py [family ...]`` (CPU only, about 10 s a row).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.helpers import MOE_FAMILIES, state_of, tiny_model, train, training_args  # noqa: E402

from megatrain_hf import MegaTrainConfig, MegaTrainPlugin  # noqa: E402


def _run(family: str, kernel: str, out: Path, experts_dtype: str | None):
    model = tiny_model(family)
    model.set_experts_implementation(kernel)
    callbacks = [MegaTrainPlugin(MegaTrainConfig(experts_dtype=experts_dtype))] if experts_dtype else None
    _, losses = train(model, training_args(out, bf16=True), callbacks=callbacks)
    return losses, state_of(model)


def _distance(a, b) -> str:
    (la, sa), (lb, sb) = a, b
    loss = max(abs(x - y) for x, y in zip(la, lb))
    param, name = max(((sa[n] - sb[n]).abs().max().item(), n) for n in sa)
    return f"loss {loss:.2g}, parameter {param:.2g} ({name})"


def main(families: list[str]) -> None:
    tmp = Path(tempfile.mkdtemp())
    for family in families:
        for kernel in ("grouped_mm", "batched_mm", "eager"):
            plain = _run(family, kernel, tmp / "plain", None)
            if kernel == "batched_mm":
                print(f"{family:10} {kernel:10} plain vs plain:     {_distance(plain, _run(family, kernel, tmp / 'p2', None))}")
            for experts_dtype in ("auto", "compute"):
                got = _run(family, kernel, tmp / experts_dtype, experts_dtype)
                print(f"{family:10} {kernel:10} {experts_dtype:8} vs plain: {_distance(plain, got)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(MOE_FAMILIES))

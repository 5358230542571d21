"""Run a training script with megatrain enabled for every Trainer it builds.

    python -m megatrain_hf.run train.py ARGS...
    python -m megatrain_hf.run -m my_pkg.train ARGS...
    accelerate launch --config_file megatrain_accelerate.yaml -m megatrain_hf.run train.py ARGS...

The script is not edited: ``megatrain_hf.enable()`` is called with the config handed over in
the ``MEGATRAIN_CONFIG`` environment variable (set by ``megatrain launch``) or the defaults,
then the script runs as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m megatrain_hf.run (SCRIPT.py | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stderr.write(USAGE + "\n")
        return 0 if argv else 2
    from .config import MegaTrainConfig
    from .integrations.trainer import enable

    enable(MegaTrainConfig.from_env())
    if argv[0] == "-m":
        if len(argv) < 2:
            sys.stderr.write(USAGE + "\n")
            return 2
        module, rest = argv[1], argv[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    script, rest = argv[0], argv[1:]
    if not os.path.isfile(script):
        sys.stderr.write(f"megatrain_hf.run: no such script {script!r}\n{USAGE}\n")
        return 2
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())

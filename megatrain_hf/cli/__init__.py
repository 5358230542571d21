"""The ``megatrain`` command: ``launch`` (``launch.py``), ``estimate`` (``estimate.py``), ``bench``.

``python -m megatrain_hf.cli`` is the same command.
"""

from __future__ import annotations

import difflib
import sys
from importlib import metadata

COMMANDS = {
    "launch": "run an unchanged training script, -m module or console script with megatrain (accelerate config "
              "+ `megatrain:` section)",
    "estimate": "host RAM and GPU memory a model needs, and the largest model that fits",
    "bench": "benchmark megatrain against its baselines",
}

USAGE = "usage: megatrain [-h] [--version] {" + ",".join(COMMANDS) + "} ..."


def _help() -> str:
    lines = [USAGE, "", "Full fine-tuning of LLMs larger than the GPU from the Hugging Face Trainer.", "", "commands:"]
    lines += [f"  {name:10s}{text}" for name, text in COMMANDS.items()]
    lines += [
        "",
        "options:",
        "  -h, --help  show this message and exit",
        "  --version   print the versions of megatrain_hf, torch, transformers and accelerate and exit",
        "",
        "`megatrain COMMAND --help` lists a command's options, e.g.",
        "  megatrain launch --config_file configs/megatrain_cpu.yaml train.py --output_dir out",
        "  megatrain launch --config_file configs/megatrain_cpu.yaml llamafactory-cli train config.yaml",
        "  megatrain estimate --model llama-7b",
    ]
    return "\n".join(lines) + "\n"


def version_line() -> str:
    """``megatrain_hf 0.1.0 (torch 2.13.0, transformers 5.24.0, accelerate 1.15.0)``."""
    from .. import __version__

    def installed(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    deps = ", ".join(f"{dist} {installed(dist)}" for dist in ("torch", "transformers", "accelerate"))
    return f"megatrain_hf {__version__} ({deps})"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.stderr.write(_help())
        return 2
    if argv[0] in ("-h", "--help"):
        sys.stdout.write(_help())
        return 0
    if argv[0] in ("-V", "--version"):
        print(version_line())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        sys.stderr.write(f"{USAGE}\nmegatrain: error: unknown command {command!r} (choose from "
                         f"{', '.join(COMMANDS)}){hint}\n")
        return 2
    try:
        if command == "launch":
            from .launch import launch

            return launch(rest)
        if command == "estimate":
            from .estimate import estimate_main

            return estimate_main(rest)
        from ..bench import main as bench_main

        return bench_main(rest)
    except (ValueError, FileNotFoundError) as exc:
        sys.stderr.write(f"megatrain {command}: error: {exc}\n")
        return 2
    except SystemExit as exc:  # argparse: --help exits 0, a usage error 2; bench's checks exit with a message
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        sys.stderr.write(f"megatrain {command}: error: {exc.code}\n")
        return 2

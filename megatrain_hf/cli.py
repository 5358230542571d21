"""The ``megatrain`` command: ``launch``, ``estimate``, ``bench``.

``megatrain launch --config_file megatrain.yaml train.py ARGS`` reads an accelerate config that
also has a ``megatrain:`` section. Accelerate's YAML schema is closed (an unknown key raises),
so the launcher splits the file: accelerate's keys go to a temporary accelerate config, the
``megatrain:`` section is validated here and handed to the training processes through the
``MEGATRAIN_CONFIG`` environment variable, and the script runs under ``megatrain_hf.run``.
YAML is read with ``yaml.safe_load`` only.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import tempfile
from importlib import metadata

from .config import ENV_VAR, MegaTrainConfig

COMMANDS = {
    "launch": "run an unchanged training script with megatrain (accelerate config + `megatrain:` section)",
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
        "  megatrain estimate --model llama-7b",
    ]
    return "\n".join(lines) + "\n"


def version_line() -> str:
    """``megatrain_hf 0.1.0 (torch 2.13.0, transformers 5.24.0, accelerate 1.15.0)``."""
    from . import __version__

    def installed(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    deps = ", ".join(f"{dist} {installed(dist)}" for dist in ("torch", "transformers", "accelerate"))
    return f"megatrain_hf {__version__} ({deps})"


# ------------------------------------------------------------------------------------------ launch
def load_launch_config(path: str) -> tuple[dict, MegaTrainConfig]:
    """(accelerate's keys, megatrain config) from a megatrain launch YAML."""
    import yaml

    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config_file {path!r} does not exist; see configs/ for ready-made files.")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise ValueError(
                f"{path} is not a plain YAML mapping ({exc.__class__.__name__}: {exc}). Only plain YAML is "
                "read (safe_load): tags such as !!python/object are refused."
            ) from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a YAML mapping of accelerate keys plus a `megatrain:` section")
    section = data.pop("megatrain", None) or {}
    if not isinstance(section, dict):
        raise ValueError(f"the `megatrain:` section of {path} must be a mapping, got {type(section).__name__}")
    return data, MegaTrainConfig.from_dict(section)


def launch(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="megatrain launch",
        description="accelerate launch, with the `megatrain:` section of the config applied to every Trainer",
    )
    parser.add_argument("--config_file", required=True, help="accelerate YAML with a `megatrain:` section")
    parser.add_argument("--dry_run", action="store_true", help="print the command instead of running it")
    parser.add_argument("script", help="training script (run unchanged)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    accelerate_keys, config = load_launch_config(args.config_file)
    import yaml

    with tempfile.TemporaryDirectory(prefix="megatrain_launch_") as tmp:
        accel_path = os.path.join(tmp, "accelerate.yaml")
        with open(accel_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(accelerate_keys, f)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accel_path]
        cmd += ["-m", "megatrain_hf.run", args.script, *args.script_args]
        env = dict(os.environ, **{ENV_VAR: json.dumps(config.to_dict())})
        if args.dry_run:
            print(f"{ENV_VAR}={env[ENV_VAR]!r} " + " ".join(cmd))
            return 0
        return subprocess.call(cmd, env=env)


# ------------------------------------------------------------------------------------------ main
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
            return launch(rest)
        if command == "estimate":
            from .memory import estimate_main

            return estimate_main(rest)
        from .bench import main as bench_main

        return bench_main(rest)
    except (ValueError, FileNotFoundError) as exc:
        sys.stderr.write(f"megatrain {command}: error: {exc}\n")
        return 2
    except SystemExit as exc:  # argparse: --help exits 0, a usage error 2; bench's checks exit with a message
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        sys.stderr.write(f"megatrain {command}: error: {exc.code}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())

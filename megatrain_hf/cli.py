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
import json
import os
import subprocess
import sys
import tempfile

from .config import ENV_VAR, MegaTrainConfig


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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"launch": "run a training script with megatrain", "estimate": "memory plan", "bench": "benchmark"}
    if not argv or argv[0] not in commands:
        lines = [f"  {name:9s} {text}" for name, text in commands.items()]
        sys.stderr.write("usage: megatrain {launch,estimate,bench} ...\n" + "\n".join(lines) + "\n")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "launch":
            return launch(rest)
        if command == "estimate":
            from .memory.cli import estimate_main

            return estimate_main(rest)
        from .bench import main as bench_main

        return bench_main(rest)
    except (ValueError, FileNotFoundError) as exc:
        sys.stderr.write(f"megatrain {command}: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())

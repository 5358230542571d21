"""``megatrain launch --config_file megatrain.yaml train.py ARGS``: an unchanged training script, with megatrain.

The YAML is an accelerate config that also has a ``megatrain:`` section. Accelerate's YAML schema
is closed (an unknown key raises), so the launcher splits the file: accelerate's keys are checked
against accelerate's own schema (an error names the user's file, not a temporary one) and go to a
temporary accelerate config, the ``megatrain:`` section is validated here and handed to the
training processes through the ``MEGATRAIN_CONFIG`` environment variable, and the script runs
under ``megatrain_hf.run``. YAML is read with ``yaml.safe_load`` only.

The target is a script, ``-m MODULE`` (``megatrain launch --config_file c.yaml -m axolotl.cli.train
cfg.yml``) or an installed console script by name (``megatrain launch --config_file c.yaml
llamafactory-cli train cfg.yaml``); ``megatrain_hf.run`` runs each as its own command would. The
launcher is the outermost wrapper of the run (``integrations/reach.py``): every Python process the run
starts boots megatrain, and a run in which no Trainer trained with megatrain ends with a WARNING.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from importlib import metadata

from ..errors import MegatrainConfigError
from ..config import ENV_VAR, MegaTrainConfig


def load_launch_config(path: str) -> tuple[dict, MegaTrainConfig]:
    """(accelerate's keys, megatrain config) from a megatrain launch YAML; both parts validated."""
    import yaml

    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config_file {path!r} does not exist; see configs/ for ready-made files.")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise MegatrainConfigError(
                f"{path} is not a plain YAML mapping ({exc.__class__.__name__}: {exc}). Only plain YAML is "
                "read (safe_load): tags such as !!python/object are refused."
            ) from exc
    if not isinstance(data, dict):
        raise MegatrainConfigError(f"{path} must hold a YAML mapping of accelerate keys plus a `megatrain:` section")
    section = data.pop("megatrain", None) or {}
    if not isinstance(section, dict):
        raise MegatrainConfigError(
            f"the `megatrain:` section of {path} must be a mapping, got {type(section).__name__}")
    try:
        config = MegaTrainConfig.from_dict(section)
    except (ValueError, TypeError) as exc:
        raise MegatrainConfigError(f"the `megatrain:` section of {path}: {exc}") from exc
    check_accelerate_keys(data, path)
    return data, config


def check_accelerate_keys(keys: dict, path: str) -> None:
    """Raise ``ValueError`` naming ``path`` for what ``accelerate launch`` would refuse in these keys.

    The same checks as accelerate's ``load_config_from_file`` (``ClusterConfig`` for a local machine,
    ``SageMakerConfig`` otherwise): its defaults applied by ``process_config``, then no key outside the
    config class's fields, then the class built (enum values checked). Accelerate itself would report
    them against the temporary file the launcher writes.
    """
    from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig
    from accelerate.utils import ComputeEnvironment, DistributedType, PrecisionType, SageMakerDistributedType

    accelerate = f"accelerate {metadata.version('accelerate')}"
    environments = [e.value for e in ComputeEnvironment]
    environment = keys.get("compute_environment", ComputeEnvironment.LOCAL_MACHINE.value)
    if environment not in environments:
        raise MegatrainConfigError(
            f"{path}: compute_environment={environment!r} is not one of {accelerate}'s {environments}. "
            "Fix: compute_environment: LOCAL_MACHINE"
        )
    for key in ("distributed_type", "mixed_precision"):
        if isinstance(keys.get(key), bool):  # YAML 1.1 reads an unquoted NO / no as false
            quoted = '"NO"' if key == "distributed_type" else '"no"'
            raise MegatrainConfigError(
                f"{path}: {key}={keys[key]!r}: YAML reads an unquoted NO/no as the boolean false. "
                f"Fix: quote it, {key}: {quoted}"
            )
    precisions = [p.value for p in PrecisionType]
    if keys.get("mixed_precision") not in (None, *precisions):
        raise MegatrainConfigError(
            f"{path}: mixed_precision={keys['mixed_precision']!r} is not one of {accelerate}'s {precisions}. "
            'Fix: mixed_precision: bf16 on a GPU, mixed_precision: "no" on a CPU'
        )
    if "distributed_type" not in keys:
        raise MegatrainConfigError(
            f"{path} has no distributed_type, which {accelerate} requires. "
            'Fix: add distributed_type: "NO" (one process), as in configs/megatrain_cpu.yaml'
        )
    local = environment == ComputeEnvironment.LOCAL_MACHINE.value
    distributed = [d.value for d in (DistributedType if local else SageMakerDistributedType)]
    if keys["distributed_type"] not in distributed:
        raise MegatrainConfigError(
            f"{path}: distributed_type={keys['distributed_type']!r} is not one of {accelerate}'s {distributed} "
            f"(compute_environment {environment}). Fix: distributed_type: \"NO\" (one process)"
        )
    cls = ClusterConfig if local else SageMakerConfig
    values = cls.process_config(copy.deepcopy(keys))
    allowed = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        megatrain_fields = {f.name for f in dataclasses.fields(MegaTrainConfig)}
        hints = []
        for key in unknown:
            if key in megatrain_fields:
                hints.append(f"{key!r} is a megatrain option: move it under the `megatrain:` section")
            else:
                close = difflib.get_close_matches(key, allowed, n=1)
                hints.append(f"{key!r}: did you mean {close[0]!r}?" if close else f"{key!r}: remove it")
        raise MegatrainConfigError(
            f"{path} has accelerate key(s) that {accelerate} does not know: {unknown} ({'; '.join(hints)}). "
            f"Allowed top-level keys: {allowed}, plus the `megatrain:` section."
        )
    try:
        cls(**values)
    except (ValueError, TypeError) as exc:
        raise MegatrainConfigError(f"{path}: {accelerate} refuses its accelerate keys: {exc}") from exc


def launch(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="megatrain launch",
        description="accelerate launch, with the `megatrain:` section of the config applied to every Trainer",
        epilog="example: megatrain launch --config_file configs/megatrain_cpu.yaml train.py --output_dir out",
    )
    parser.add_argument("--config_file", required=True,
                        help="accelerate YAML with a `megatrain:` section (ready-made ones: configs/)")
    parser.add_argument("--dry_run", action="store_true",
                        help="check the config and the script, print the accelerate config and the command, "
                             "run nothing")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="the target is a module, run as `python -m MODULE` would (e.g. -m axolotl.cli.train)")
    parser.add_argument("script", help="training script (run unchanged), module (with -m), or console script "
                                       "(an installed command such as llamafactory-cli)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = parser.parse_args(argv)
    accelerate_keys, config = load_launch_config(args.config_file)
    target = ["-m", args.script] if args.module else [args.script]
    _check_target(args.script, args.module)
    import yaml

    from ..integrations.reach import child_env, owned_run

    config_json = json.dumps(config.to_dict())
    if args.dry_run:
        env = child_env(config_json)
        print(f"# the accelerate keys of {args.config_file}, written to a temporary ACCELERATE_YAML at launch:")
        print("\n".join("#   " + line for line in yaml.safe_dump(accelerate_keys).splitlines()))
        print(f"PYTHONPATH={shlex.quote(env['PYTHONPATH'])} {ENV_VAR}={shlex.quote(env[ENV_VAR])} "
              + shlex.join(_command("ACCELERATE_YAML", target, args.script_args)))
        return 0
    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = config_json  # owned_run hands it to every child, with megatrain's boot
    try:
        with owned_run(["megatrain", "launch", *argv]) as run, \
                tempfile.TemporaryDirectory(prefix="megatrain_launch_") as tmp:
            accel_path = os.path.join(tmp, "accelerate.yaml")
            with open(accel_path, "w", encoding="utf-8") as f:
                yaml.safe_dump(accelerate_keys, f)
            code = subprocess.call(_command(accel_path, target, args.script_args))
            run.failed = code != 0
            return code
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous


def _check_target(script: str, module: bool) -> None:
    """Refuse a target that cannot run, before starting anything."""
    from importlib import metadata, util

    usage = ("usage: megatrain launch --config_file CONFIG.yaml (SCRIPT.py | -m MODULE | CONSOLE_SCRIPT) "
             "[ARGS...]")
    if module:
        try:
            found = util.find_spec(script) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise FileNotFoundError(f"module {script!r} cannot be imported here (-m takes a module name such as "
                                    f"axolotl.cli.train); {usage}")
        return
    if os.path.isfile(script):
        return
    if os.sep not in script and any(True for _ in metadata.entry_points(group="console_scripts", name=script)):
        return
    hint = " (a module? put -m before it)" if "." in script and not script.endswith(".py") else ""
    raise FileNotFoundError(
        f"training script {script!r} does not exist (looked in {os.getcwd()}) and is no installed console "
        f"script{hint}; {usage}"
    )


def _command(accelerate_yaml: str, target: list[str], script_args: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_yaml]
    return cmd + ["-m", "megatrain_hf.run", *target, *script_args]

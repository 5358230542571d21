"""megatrain in every Python child of a wrapped run, and a warning when no Trainer took it anywhere.

``python -m megatrain_hf.run`` enables megatrain in its own process; the tools people fine-tune with
train in another one: ``axolotl train`` relaunches itself through ``accelerate launch``, ``trl sft`` runs
its script in a child, LLaMA-Factory starts ``torchrun`` when several devices are visible. So, as
auto-instrumentation tools do (OpenTelemetry's ``opentelemetry-instrument``, ddtrace), the wrapper puts
a directory holding a ``sitecustomize.py`` (``integrations/boot/``) first on ``PYTHONPATH`` and the
config in ``MEGATRAIN_CONFIG``. Every Python child (torchrun's workers, accelerate's, a tool's own
relaunch) inherits both; its ``sitecustomize`` runs the one it shadows (chained), then installs an
import hook (standard library only: a child that never imports the Trainer pays nothing else): when the
child imports ``transformers.trainer``, :func:`enable_in_child` runs ``enable()`` with the config, so
every Trainer it builds trains with megatrain.

Each process whose Trainer megatrain attached to leaves a marker file (:func:`record_attached`) in the
run's folder named by ``MEGATRAIN_ATTACH_DIR``, which the outermost wrapper creates
(:func:`owned_run`). When the run ends, the wrapper reads them (:func:`report`): none means the run
trained without megatrain (or trained nothing), and it says so at WARNING level with the likely cause
and the module to wrap instead.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

BOOT_DIR = str(Path(__file__).resolve().parent / "boot")
"""The folder put first on children's ``PYTHONPATH``: it holds megatrain's ``sitecustomize.py`` only."""
ATTACH_DIR_VAR = "MEGATRAIN_ATTACH_DIR"
"""The run's marker folder (created and removed by the outermost wrapper)."""

# console scripts / modules of the tools that relaunch themselves, and the module that builds their Trainer
RELAUNCHERS = {
    "axolotl": "axolotl.cli.train CONFIG.yml",
    "llamafactory-cli": "llamafactory.launcher CONFIG.yaml",
    "lmf": "llamafactory.launcher CONFIG.yaml",
    "trl": "trl.scripts.sft ARGS (or trl.scripts.dpo, ...)",
}


def child_env(config_json: str, env: dict | None = None) -> dict:
    """``env`` (default ``os.environ``) with megatrain's boot folder first on ``PYTHONPATH`` and the config
    in ``MEGATRAIN_CONFIG``; an existing ``PYTHONPATH`` is kept after it."""
    from ..config import ENV_VAR

    env = dict(os.environ if env is None else env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOT_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, *paths])
    env[ENV_VAR] = config_json
    return env


class Run:
    """What the wrapper tells :func:`owned_run` about the run: ``failed`` (a non-zero exit) skips the report."""

    failed = False


@contextmanager
def owned_run(argv: list[str]):
    """Around a wrapped run in the outermost wrapper: ``os.environ`` set up so that children boot
    megatrain, and the report once the run ended well (see module docstring). A nested wrapper (a rank
    started by ``megatrain launch``) leaves both to the outer one. Yields a :class:`Run`."""
    from ..config import ENV_VAR, MegaTrainConfig

    run = Run()
    if os.environ.get(ATTACH_DIR_VAR):
        yield run
        return
    config_json = os.environ.get(ENV_VAR) or json.dumps(MegaTrainConfig.from_env().to_dict())
    folder = tempfile.mkdtemp(prefix="megatrain_run_")
    before = {k: os.environ.get(k) for k in ("PYTHONPATH", ENV_VAR, ATTACH_DIR_VAR)}
    os.environ.update(child_env(config_json))
    os.environ[ATTACH_DIR_VAR] = folder
    try:
        yield run
    except SystemExit as exc:
        run.failed = exc.code not in (None, 0)
        raise
    except BaseException:
        run.failed = True
        raise
    finally:
        for key, value in before.items():  # this process's environment as it was
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        try:
            if not run.failed:
                report(folder, argv)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _marker(kind: str, **fields) -> None:
    folder = os.environ.get(ATTACH_DIR_VAR)
    if not folder or not os.path.isdir(folder):
        return
    record = {"kind": kind, "pid": os.getpid(), "argv": sys.argv, "rank": os.environ.get("RANK"), **fields}
    path = os.path.join(folder, f"{kind}-{os.getpid()}-{time.monotonic_ns()}.json")
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError as exc:  # never fail training for a marker
        logger.debug("megatrain: could not write the marker %s: %s", path, exc)


def record_attached(trainer_class: str) -> None:
    """This process's Trainer (of ``trainer_class``) trains with megatrain."""
    _marker("attached", trainer=trainer_class)


def record_trainer_import() -> None:
    """This process imported transformers' Trainer with megatrain enabled."""
    _marker("imported")


def _records(folder: str) -> list[dict]:
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue
    return out


def report(folder: str, argv: list[str]) -> bool:
    """Warn when no process of the run attached megatrain to a Trainer; returns whether one did."""
    records = _records(folder)
    attached = [r for r in records if r["kind"] == "attached"]
    if attached:
        return True
    imported = [r for r in records if r["kind"] == "imported"]
    command = " ".join(argv)
    tool = next((RELAUNCHERS[os.path.basename(a)] for a in argv[:2] if os.path.basename(a) in RELAUNCHERS), None)
    instead = (f"python -m megatrain_hf.run -m {tool}" if tool else
               "python -m megatrain_hf.run -m MODULE ARGS, where MODULE is the module that builds the Trainer")
    if imported:
        cause = (f"{len(imported)} process(es) imported transformers' Trainer with megatrain enabled "
                 f"({', '.join(' '.join(r['argv'])[:120] for r in imported[:3])}) but built no Trainer that trained "
                 "(a hand-written loop, a Trainer built before megatrain was enabled, or a run that stopped before "
                 "training)")
    else:
        cause = ("no process started by it imported transformers' Trainer through megatrain's boot: the Trainer "
                 "was built in a process that did not inherit PYTHONPATH (a launcher that clears the environment, "
                 "`python -I` / `-E`, a container or a remote host), or the command built no Trainer at all")
    logger.warning(
        "megatrain: `%s` finished and no Trainer trained with megatrain anywhere in it: %s. The results are those "
        "of plain training. Fix: wrap the module that builds the Trainer instead: %s (under a launcher: accelerate "
        "launch -m megatrain_hf.run -m ..., torchrun -m megatrain_hf.run -m ...).", command, cause, instead)
    return False


_pending = False  # the boot asked for enable() while megatrain's Trainer integration was being imported


def enable_in_child() -> None:
    """Called by the boot's hook once a child imported ``transformers.trainer``: ``enable()`` with the
    environment's config, and a marker that it did. When megatrain's own Trainer integration is what
    imported the Trainer (it is half-imported then), its package finishes the job (:func:`finish_pending`)."""
    global _pending

    package = sys.modules.get("megatrain_hf.integrations.trainer")
    if package is not None and not hasattr(package, "enable"):
        _pending = True
        return
    from .trainer import enable, is_enabled

    _enable(enable, is_enabled)


def finish_pending(enable, is_enabled) -> None:
    """At the end of ``integrations/trainer/__init__.py``: the enable() the boot asked for meanwhile."""
    global _pending

    if _pending:
        _pending = False
        _enable(enable, is_enabled)


def _enable(enable, is_enabled) -> None:
    from ..config import MegaTrainConfig

    if not is_enabled():
        enable(MegaTrainConfig.from_env())
    record_trainer_import()

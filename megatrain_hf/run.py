"""Run a training command with megatrain enabled for every Trainer it builds, in every process it starts.

    python -m megatrain_hf.run train.py ARGS...
    python -m megatrain_hf.run -m my_pkg.train ARGS...
    python -m megatrain_hf.run llamafactory-cli train config.yaml      # a console script, by name
    python -m megatrain_hf.run axolotl train config.yml
    accelerate launch --config_file megatrain_accelerate.yaml -m megatrain_hf.run train.py ARGS...

Nothing is edited: ``megatrain_hf.enable()`` is called with the config handed over in the
``MEGATRAIN_CONFIG`` environment variable (set by ``megatrain launch``) or the defaults, then the
target runs as ``__main__``. Every Python child it starts (a tool relaunching itself through
``accelerate launch`` or ``torchrun``) boots megatrain too, and when the command ends without any
Trainer having trained with megatrain, a WARNING says so (``integrations/reach.py``).

The target is a module (``-m``), a script file, or a console script (an installed command such as
``llamafactory-cli``, by name or by its path): a console script runs its entry point, and a ``.py``
file that belongs to an importable package (``.../llamafactory/cli.py``) runs as that module, so its
relative imports work.
"""

from __future__ import annotations

import os
import runpy
import sys
from importlib import metadata, util

USAGE = "usage: python -m megatrain_hf.run (SCRIPT.py | -m MODULE | CONSOLE_SCRIPT) [ARGS...]"


def console_script(name: str) -> metadata.EntryPoint | None:
    """The installed console script called ``name`` (or whose file is ``name``), else None."""
    found = metadata.entry_points(group="console_scripts", name=os.path.basename(name))
    return next(iter(found), None)


def module_of(path: str) -> str | None:
    """The importable module that ``path`` (a .py file inside a package) is, else None."""
    path = os.path.abspath(path)
    if not path.endswith(".py"):
        return None
    parts = [os.path.splitext(os.path.basename(path))[0]]
    folder = os.path.dirname(path)
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        parts.insert(0, os.path.basename(folder))
        folder = os.path.dirname(folder)
    if len(parts) == 1:
        return None
    name = ".".join(parts)
    try:
        spec = util.find_spec(name)
    except (ImportError, ValueError):
        return None
    same = spec is not None and spec.origin and os.path.abspath(spec.origin) == path
    return name if same else None


def resolve(argv: list[str]) -> tuple[str, str, list[str]]:
    """(kind, target, args): kind ``module``, ``script`` or ``entry``; raises ValueError with the usage."""
    if argv[0] == "-m":
        if len(argv) < 2:
            raise ValueError(f"-m needs a module name\n{USAGE}")
        return "module", argv[1], argv[2:]
    target, rest = argv[0], argv[1:]
    if os.path.isfile(target):
        module = module_of(target)
        if module is not None:
            return "module", module, rest
        if not target.endswith(".py") and console_script(target) is not None:
            return "entry", os.path.basename(target), rest
        return "script", target, rest
    if os.sep not in target and console_script(target) is not None:
        return "entry", target, rest
    raise ValueError(f"no such script, module or console script: {target!r} (looked in {os.getcwd()} and the "
                     f"installed console scripts)\n{USAGE}")


def execute(kind: str, target: str, rest: list[str]) -> int:
    """Run the target as ``__main__`` with ``sys.argv`` set as its own command line would set it."""
    if kind == "module":
        sys.argv = [target, *rest]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return 0
    if kind == "entry":
        sys.argv = [target, *rest]
        result = console_script(target).load()()
        if result is None or isinstance(result, int):
            return result or 0
        sys.stderr.write(f"{result}\n")  # as sys.exit(main()) does with a message
        return 1
    sys.argv = [target, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stderr.write(USAGE + "\n")
        return 0 if argv else 2
    try:
        kind, target, rest = resolve(argv)
    except ValueError as exc:
        sys.stderr.write(f"megatrain_hf.run: {exc}\n")
        return 2
    from .config import MegaTrainConfig
    from .integrations.reach import owned_run
    from .integrations.trainer import enable

    with owned_run(argv) as run:
        enable(MegaTrainConfig.from_env())
        code = execute(kind, target, rest)
        run.failed = code != 0
    return code


if __name__ == "__main__":
    sys.exit(main())

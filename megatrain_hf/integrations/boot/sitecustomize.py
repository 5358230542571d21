"""megatrain's boot in the Python children of a wrapped run (``integrations/reach.py`` says why and how).

This folder is put first on ``PYTHONPATH`` by ``python -m megatrain_hf.run`` and ``megatrain launch``;
Python's ``site`` imports this file at the start of every interpreter that inherits it. It

1. runs the ``sitecustomize`` it shadows (the next one on ``sys.path``: a distribution's or a user's),
   so that nothing another tool set up this way is lost;
2. when ``MEGATRAIN_CONFIG`` is set, installs an import hook: once ``transformers.trainer`` has been
   imported, ``megatrain_hf.integrations.reach.enable_in_child()`` enables megatrain for every Trainer
   the process builds.

Standard library only until the Trainer is imported (no torch, no megatrain import at start-up), and
nothing here may break the interpreter: a failure is printed to stderr and start-up goes on.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TRAINER = "transformers.trainer"


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # as if it had been found first
    spec.loader.exec_module(module)


def _enable() -> None:
    from megatrain_hf.integrations.reach import enable_in_child

    enable_in_child()


class _Loader:
    """The Trainer module's loader, then megatrain enabled."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the real loader for what reads it later
        self.loader.exec_module(module)
        _enable()


class _Finder:
    """A meta-path finder for ``transformers.trainer`` only; it removes itself at the first lookup."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRAINER:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None

    def invalidate_caches(self) -> None:
        pass


def _boot() -> None:
    if os.environ.get("MEGATRAIN_CONFIG") is None:
        return
    if _TRAINER in sys.modules:
        _enable()
    else:
        sys.meta_path.insert(0, _Finder())


for _step in (_chain, _boot):
    try:
        _step()
    except Exception as _exc:  # noqa: BLE001 (start-up must go on; say what failed)
        sys.stderr.write(f"megatrain boot ({__file__}): {_step.__name__} failed: {type(_exc).__name__}: {_exc}\n")

"""The package's shape: imports run one way, and the architecture page's file table names exactly the
modules of the tree (the structure's smells: tests/repo/test_structure.py).

Layers (docs/architecture.md): cli, bench, run -> integrations -> engine, plan, config, stats,
-> runtime, optim, memory, models (never one another) -> core (torch only); errors (the typed
exceptions, no imports) below them all.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
PACKAGE = ROOT / "megatrain_hf"

# group of a module -> groups it may import (its own group always)
ALLOWED = {
    "errors": set(),  # the typed exceptions: importable from every layer
    "core": set(),
    "runtime": {"core"},
    "optim": {"core"},
    "memory": {"core"},
    "models": {"core"},
    "stats": set(),
    "config": {"runtime", "optim", "memory", "models"},  # the option classes, owned by their components
    "plan": {"core", "optim", "memory", "config"},  # the engine's layer: decides from the options and the machine
    "engine": {"core", "runtime", "optim", "memory", "models", "config", "stats", "plan"},
    "integrations": {"core", "runtime", "optim", "memory", "models", "config", "stats", "engine", "plan"},
    "package": {"config", "engine", "stats"},  # megatrain_hf/__init__.py (the rest lazily, by name)
    "run": {"config", "integrations"},
    "cli": {"config", "memory", "models", "bench", "package", "plan", "integrations"},  # launch: integrations/reach.py
    "bench": {"config", "memory", "stats", "engine", "integrations", "package"},
}
THIRD_PARTY_FORBIDDEN = {  # group -> top-level packages it must not import
    "core": {"transformers", "accelerate", "peft", "trl"},
    "runtime": {"transformers", "accelerate", "peft", "trl"},
    "optim": {"transformers", "accelerate", "peft", "trl"},
    "memory": {"accelerate", "peft", "trl"},
    "models": {"accelerate", "trl"},
    "engine": {"accelerate", "trl"},
    "plan": {"transformers", "accelerate", "peft", "trl"},
    "config": {"transformers", "accelerate", "peft", "trl"},
    "stats": {"transformers", "accelerate", "peft", "trl"},
}
MODULE_GROUPS = {"placement": "plan"}  # a top-level module in another's layer: the plan's decisions from the sizes
for _group, _allowed in ALLOWED.items():
    if _group != "errors":
        _allowed.add("errors")


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _group(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
        return "package" if rel.name == "__init__.py" else MODULE_GROUPS.get(rel.stem, rel.stem)
    return rel.parts[0]


def _imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in ``path``, lazy ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(("megatrain_hf", *path.relative_to(PACKAGE).parent.parts))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x: x is a module, or an attribute of the package
                    for alias in node.names:
                        sub = Path(ROOT, *name.split("."), alias.name)
                        is_module = sub.with_suffix(".py").is_file() or sub.is_dir()
                        out.append((f"{name}.{alias.name}" if is_module else name, node.lineno))
                    continue
            else:
                name = node.module
            out.append((name, node.lineno))
    return out


def _group_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "megatrain_hf":
        return None
    if len(parts) == 1:
        return "package"
    target = PACKAGE.joinpath(*parts[1:])
    if target.is_dir() or len(parts) > 2:
        return parts[1]
    return "package" if parts[1] == "__init__" else MODULE_GROUPS.get(parts[1], parts[1])


def test_imports_follow_the_layers():
    problems = []
    for path in _modules():
        group = _group(path)
        allowed = ALLOWED[group] | {group}
        for name, line in _imports(path):
            target = _group_of_module(name)
            if target is None:
                top = name.split(".")[0]
                if top in THIRD_PARTY_FORBIDDEN.get(group, ()):
                    problems.append(f"{path.relative_to(ROOT)}:{line} ({group}) imports {name}")
            elif target not in allowed:
                problems.append(f"{path.relative_to(ROOT)}:{line} ({group}) imports {name} ({target})")
    assert not problems, "imports against the layering of docs/architecture.md:\n" + "\n".join(problems)


def test_the_layering_check_sees_a_violation(tmp_path):
    """The check above parses relative imports the way Python resolves them."""
    core = PACKAGE / "core" / "store.py"
    names = {name for name, _ in _imports(core)}
    assert "megatrain_hf.core.layout" in names and _group_of_module("megatrain_hf.core.layout") == "core"
    assert _group_of_module("megatrain_hf.engine") == "engine" and "engine" not in ALLOWED["core"]


def _table_paths() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## Files") :]
    section = section[: section.index("\n## ", 4)]
    paths: set[str] = set()
    for row in re.findall(r"^\| (`[^|]+`) \|", section, flags=re.M):
        for item in re.findall(r"`([^`]+)`", row):
            paths.add(item)
    return paths


def test_architecture_file_table_matches_the_tree():
    listed = _table_paths()
    tree = {str(p.relative_to(PACKAGE)) for p in _modules()} | {
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.cpp")
    }
    folders = {entry.rstrip("/") for entry in listed if entry.endswith("/")}
    covered = {m for m in tree if any(m.startswith(f"{folder}/") for folder in folders)}
    missing = sorted(tree - listed - covered - {"core/__init__.py", "runtime/__init__.py", "optim/__init__.py",
                                                 "models/__init__.py", "memory/__init__.py", "integrations/__init__.py",
                                                 "integrations/trainer/__init__.py"})
    stale = sorted(entry for entry in listed - tree if not entry.endswith("/"))
    assert not missing, f"modules missing from docs/architecture.md's file table: {missing}"
    assert not stale, f"docs/architecture.md's file table names modules that do not exist: {stale}"


@pytest.mark.parametrize("group", sorted(ALLOWED))
def test_every_group_exists(group):
    assert any(_group(p) == group for p in _modules()), f"layer {group!r} has no module: update ALLOWED"

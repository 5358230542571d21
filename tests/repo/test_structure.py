"""The structure's smells, checked on the package's source: a class reads only attributes it (or a
base) defines -- no mixin living off its host class's attributes --, the modules import one another
without a cycle (lazy imports included: a cycle broken only by importing late is still one), and no
module grows past the point where it has several jobs.

Module size is a guideline near 400 lines (docs/architecture.md); the hard limit here, 600, is where a
module has certainly taken on a second job.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

from tests.helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "megatrain_hf"
MAX_LINES = 600


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# ---------------------------------------------------------------------------------- attributes
def _class_attributes(node: ast.ClassDef) -> tuple[set[str], dict[str, int]]:
    """(attributes the class body defines, {attribute the class reads from self: first line})."""
    defined, read = set(), {}
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                defined |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
            if isinstance(sub.ctx, (ast.Store, ast.Del)):
                defined.add(sub.attr)
            else:
                read.setdefault(sub.attr, sub.lineno)
        elif (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "setattr"
              and len(sub.args) > 1 and isinstance(sub.args[0], ast.Name) and sub.args[0].id == "self"
              and isinstance(sub.args[1], ast.Constant)):
            defined.add(sub.args[1].value)
    return defined, read


def _source_class(cls) -> ast.ClassDef | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return None
    return next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)


def _defined_by(cls) -> set[str]:
    """What ``cls`` and its bases define: their bodies' and methods' ``self.x =`` (sources read where
    they exist: torch's Optimizer sets ``param_groups`` in its ``__init__``), plus ``dir(cls)``."""
    names = set(dir(cls))
    for klass in cls.__mro__:
        node = _source_class(klass) if klass is not object else None
        if node is not None:
            names |= _class_attributes(node)[0]
    return names


def test_no_class_reads_attributes_it_does_not_define():
    problems = []
    for path in _modules():
        if path.name == "__main__.py":
            continue
        module = importlib.import_module(_name(path))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            defined = _defined_by(cls)
            missing = {a: line for a, line in _class_attributes(node)[1].items() if a not in defined}
            if missing:
                problems.append(f"{path.relative_to(REPO_ROOT)}: {node.name} reads {missing}")
    assert not problems, "classes reading attributes they do not define (a mixin's contract):\n" + "\n".join(problems)


def test_the_attribute_check_sees_a_mixin():
    class Mixin:
        def total(self):
            return self.items  # defined by whoever mixes it in

    defined, read = _class_attributes(_source_class(Mixin))
    assert "items" in read and "items" not in _defined_by(Mixin)


# ---------------------------------------------------------------------------------- imports
def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, lazy imports included, ``if TYPE_CHECKING:`` blocks not."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _name(path) if path.name == "__init__.py" else _name(path).rsplit(".", 1)[0]
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = (".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [node.module or ""])
                    .rstrip(".") if node.level else node.module)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in modules and m != _name(path) and not m.endswith(("megatrain_hf",))
            and not (PACKAGE / Path(*m.split(".")[1:]) / "__init__.py").exists()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    modules = {_name(p): p for p in _modules()}
    graph = {m: _imports(p, set(modules)) for m, p in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, f"modules importing each other (pass what is needed in instead): {cycles}"


def test_the_cycle_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_past_the_size_where_it_has_two_jobs():
    long = {str(p.relative_to(REPO_ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"

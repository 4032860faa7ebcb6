"""The house rules, checked on the source: rooms without cycles, no reaching into another module's
privates, files a reader can hold, a small public API.

Imports are read from the source (``ast``), so lazy imports inside functions and imports under
``TYPE_CHECKING`` count: a cycle hidden in a function is still a cycle a reader must untangle.
Importing ``a.b.c`` runs ``a/b/__init__.py`` first, so it counts as importing that package too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("estimators", "solver", "planner", "examples")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(module imported, names imported from it) for every import statement of ``path``."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([base] if base else []))
            names = [a.name for a in node.names]
            # "from pkg import module" imports the module; "from module import name" the module.
            submodules = [n for n in names if f"{base}.{n}" in modules]
            out += [(f"{base}.{n}", []) for n in submodules]
            out.append((base, [n for n in names if n not in submodules]))
    return [(m, n) for m, n in out if m.split(".")[0] in PACKAGES]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, _ in _imports(name, path, modules):
            parts = target.split(".")
            # the module itself and every package __init__ on its way
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                    graph[name].add(prefix)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles_between_files():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (lazy and TYPE_CHECKING imports count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.slow
def test_no_module_imports_another_module_s_private_names():
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        for target, names in _imports(name, path, modules):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and target != name:
                    offenders.append(f"{name} imports {target}.{n}")
    assert not offenders, "\n".join(offenders)


def test_files_stay_readable():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_public_api_is_small_and_importable():
    import planner

    assert len(planner.__all__) <= 12
    for name in planner.__all__:
        assert getattr(planner, name) is not None


@pytest.mark.parametrize("package", ["solver", "estimators.contract"])
def test_the_solver_side_never_imports_torch(package):
    modules = _modules()
    for name, path in modules.items():
        if name == package or name.startswith(package + "."):
            for target, _ in _imports(name, path, modules):
                assert not target.startswith(("estimators.tracing", "estimators.step", "estimators.runtime",
                                              "planner")), f"{name} imports {target}"
            assert "import torch" not in path.read_text(), f"{name} imports torch"

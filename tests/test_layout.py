"""The package's imports flow one way: no module imports, even lazily inside
a function, a module that imports it back (directly or through others), and
``_registry`` (the group -> coordinator map) imports nothing of the package.
Read from the source with ``ast``: nothing is imported here."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "torch_groupcomm"


def _modules() -> dict[str, str]:
    """Dotted module name -> path, for every .py file of the package."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its source."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    with open(path) as f:
        tree = ast.parse(f.read())
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                # `from .x import y`: y is a module of the package, or a name in x
                candidate = f"{prefix}.{alias.name}"
                targets.add(candidate if candidate in modules else prefix)
    # a module's own packages are imported before it anyway (``from . import _C``
    # names the extension, not the package's __init__)
    return {t for t in targets if t in modules and t != module and not module.startswith(t + ".")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_import_cycle() -> None:
    cycle = _cycle(_graph())
    assert not cycle, " -> ".join(cycle)


def test_registry_is_a_leaf() -> None:
    assert _graph()[f"{PACKAGE}._registry"] == set()


def test_only_the_c10d_layer_makes_bridges() -> None:
    """The C++ bridge is built in one place: c10d.registration."""
    makers = []
    for name, path in _modules().items():
        with open(path) as f:
            if "GroupCommBackend(" in f.read():
                makers.append(name)
    assert makers == [f"{PACKAGE}.c10d.registration"], makers

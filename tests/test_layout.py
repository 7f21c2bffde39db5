"""The code's layout, read from the source with ``ast`` (nothing is imported): the packages'
layers point one way, no two modules import each other (through any chain), and no module is
over 500 lines.

Every import counts: at the top, inside functions, and under ``if TYPE_CHECKING:`` (a type-only
import is the same dependency: the module cannot be understood, or changed, without the other).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "mesh", "edge_node", "cloud_node", "mesh_app")
MAX_LINES = 500
LAYERS = {
    "protocol": {"protocol"},  # the wire: imports nothing of ours
    "mesh": {"protocol", "mesh"},  # the runtime and SDK: no node, no app
    "edge_node": {"protocol", "mesh", "edge_node"},  # never a cloud node
    "cloud_node": {"protocol", "mesh", "cloud_node"},  # never an edge node
    "mesh_app": set(PACKAGES),  # the CLI composes everything; nothing imports it
}
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()
"""Imports (importer, imported) left out of the cycle check, each with a comment naming the
cycle it closes, until it is broken. None today."""


@cache
def modules() -> dict[str, Path]:
    """Every module of ours, by dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _ours(name: str) -> str | None:
    """The module of ours that importing ``name`` runs: the longest known prefix."""
    known = modules()
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imported(tree: ast.AST, module: str, is_package: bool = False) -> Iterator[tuple[str, int]]:
    """(module of ours, line) for every import in ``tree``, wherever it stands: at the top,
    inside a function, under ``if TYPE_CHECKING:``; ``importlib.import_module("literal")`` too."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import name``: the submodule pkg.name if there is one, else pkg.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base
                for alias in node.names
            ]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for name in names:
            target = _ours(name)
            if target is not None and target != module:
                yield target, node.lineno


@cache
def graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the first line that does}."""
    edges: dict[str, dict[str, int]] = {}
    for module, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        found: dict[str, int] = {}
        for target, line in imported(tree, module, path.name == "__init__.py"):
            found.setdefault(target, line)
        edges[module] = found
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, without
    recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root, targets in edges.items():
        if root in index:
            continue
        work = [(root, iter(sorted(targets)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_walker_sees_every_kind_of_import() -> None:
    """Type-only, function-level, relative and ``from package import module`` imports all count."""
    source = """
from typing import TYPE_CHECKING
import mesh.config
from mesh import kept
from protocol.errors import MeshError
from . import records
if TYPE_CHECKING:
    from edge_node.node import EdgeNode
def later():
    from cloud_node.worker import Worker
    importlib.import_module("mesh_app.cli")
"""
    found = {target for target, _ in imported(ast.parse(source), "edge_node.relay")}
    assert found == {
        "mesh.config",
        "mesh.kept",
        "protocol.errors",
        "edge_node.records",
        "edge_node.node",
        "cloud_node.worker",
        "mesh_app.cli",
    }


def test_the_layers_point_one_way() -> None:
    """protocol imports nothing of ours; mesh only protocol; edge and cloud nodes import
    protocol and mesh, never each other; nothing imports mesh_app."""
    wrong = [
        f"{module} imports {target} (line {line}): {module.split('.')[0]} may import only "
        f"{sorted(LAYERS[module.split('.')[0]])}"
        for module, targets in graph().items()
        for target, line in targets.items()
        if target.split(".")[0] not in LAYERS[module.split(".")[0]]
    ]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_through_others() -> None:
    """No import cycles between modules (a type-only import counts)."""
    edges = {
        module: {t for t in targets if (module, t) not in KNOWN_CYCLE_EDGES}
        for module, targets in graph().items()
    }
    found = cycles(edges)
    described = [
        " <-> ".join(cycle)
        + ": "
        + "; ".join(
            f"{a} imports {b} (line {graph()[a][b]})" for a in cycle for b in cycle if b in edges[a]
        )
        for cycle in found
    ]
    assert not found, "\n".join(described)


def test_known_cycle_exceptions_still_exist() -> None:
    """An exception for an import that is gone goes too."""
    stale = [edge for edge in KNOWN_CYCLE_EDGES if edge[1] not in graph().get(edge[0], {})]
    assert not stale, stale


def test_no_module_is_over_500_lines() -> None:
    long = {
        module: lines
        for module, path in modules().items()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_the_cycle_finder_finds_cycles() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []

"""The packages form a DAG (docs/ARCHITECTURE.md): each imports only the layers below it, and no module
imports itself back through others. Read from the source with ``ast``, so an import inside a function or
under ``TYPE_CHECKING`` counts as much as one at the top."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ALLOWED: dict[str, frozenset[str]] = {
    "edgewire": frozenset(),
    "routing": frozenset(),
    "service": frozenset(),
    "inference": frozenset({"edgewire", "routing"}),
    "gateway": frozenset({"edgewire", "routing", "service", "inference"}),
    "edge_agent": frozenset({"edgewire", "routing", "service", "inference"}),
    "demo": frozenset({"edgewire", "routing", "service", "inference", "gateway", "edge_agent"}),
}
"""Package -> the project packages it may import (the picture in docs/ARCHITECTURE.md)."""


def _modules() -> dict[str, Path]:
    """Every module of the project's packages by dotted name (generated protobuf code left out)."""
    found: dict[str, Path] = {}
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            if rel.parts[:2] == ("edgewire", "pb"):
                continue
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            found[".".join(parts)] = path
    return found


def _imports(path: Path, module: str, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported project module, line) for each import in the file, resolved to the deepest known module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for imported in names:
            target = imported
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target:
                yield target, getattr(node, "lineno", 0)


def _graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    known = _modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    where: dict[tuple[str, str], int] = {}
    for name, path in known.items():
        for target, line in _imports(path, name, known):
            if target != name and not name.startswith(target + "."):  # a module's own package: not an edge
                edges[name].add(target)
                where.setdefault((name, target), line)
    return edges, where


def test_packages_import_only_the_layers_below() -> None:
    """No package imports one it may not (gateway <-> edge_agent above all)."""
    edges, where = _graph()
    wrong = [
        f"{source} imports {target} (line {where[source, target]})"
        for source, targets in edges.items()
        for target in targets
        if (top := target.split(".")[0]) != source.split(".")[0] and top not in ALLOWED[source.split(".")[0]]
    ]
    assert not wrong, "\n".join(sorted(wrong))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back() -> None:
    """No circle of imports between modules, inside a package or across packages."""
    edges, _ = _graph()
    assert _cycles(edges) == []


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_cycle_finder_finds_circles(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    """The checker itself reports a circle and passes a chain."""
    assert _cycles(edges) == expected


def test_import_reader_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    """Imports in functions and TYPE_CHECKING blocks are read: a lazy import cannot hide a layer break."""
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gateway.config import GatewayConfig\n"
        "def f():\n    import edge_agent.agent\n"
    )
    known = {"gateway.config": source, "edge_agent.agent": source}
    assert {name for name, _ in _imports(source, "inference.mod", known)} == {
        "gateway.config",
        "edge_agent.agent",
    }

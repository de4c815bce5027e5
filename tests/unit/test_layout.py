"""The layout stays readable: no module over ``MAX_MODULE`` lines, no function over
``MAX_FUNCTION``, and no import circle between ptcluster's modules (imports that run when a module
loads; those under ``TYPE_CHECKING`` or inside a function do not count). Read from the source."""

from __future__ import annotations

import ast
from pathlib import Path

import ptcluster

SRC = Path(ptcluster.__file__).parent
MAX_MODULE = 450
MAX_FUNCTION = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def load_time_imports(tree: ast.Module, name: str) -> set[str]:
    """The ptcluster modules ``name`` imports when it loads."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in MODULES)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if sub in MODULES:
                        found.add(sub)
                    elif node.module in MODULES:
                        found.add(node.module)

    visit(tree.body)
    found.discard(name)
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of the graph, each once (from its smallest name)."""
    circles: list[list[str]] = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                circles.append([*path, start])
            elif nxt > start and nxt not in path:
                walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return circles


def test_no_module_is_too_long() -> None:
    long = {name: n for name, p in MODULES.items()
            if (n := p.read_text().count("\n")) > MAX_MODULE}
    assert not long, f"modules over {MAX_MODULE} lines (one concern each?): {long}"


def test_no_function_is_too_long() -> None:
    long = {f"{name}.{node.name}": node.end_lineno - node.lineno + 1
            for name, p in MODULES.items() for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION}
    assert not long, f"functions over {MAX_FUNCTION} lines (read top to bottom?): {long}"


def test_no_import_circle() -> None:
    graph = {name: load_time_imports(ast.parse(p.read_text()), name)
             for name, p in MODULES.items()}
    assert import_circles(graph) == []


def test_the_circle_finder_finds_circles_and_only_them() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_circles(graph) == [["a", "b", "c", "a"], ["e", "e"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from ptcluster.launch import plan\nfrom ptcluster.node import wire\n"
                     "def f():\n    from ptcluster import errors\n")
    assert load_time_imports(tree, "x") == {"ptcluster.node.wire"}

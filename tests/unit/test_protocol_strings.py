"""Every string that crosses a boundary is spelled in its protocol module, once: frame kinds in
``node.wire.Kind`` (head <-> node programs), control requests in ``control.protocol`` (other
terminals -> a running head). A frame kind written as a bare literal elsewhere fails here, found
by the AST where a frame is made, sent or told apart — not by grepping for words."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ptcluster
from ptcluster.node.wire import Kind

SRC = Path(ptcluster.__file__).parent
KINDS = {v for k, v in vars(Kind).items() if not k.startswith("_") and isinstance(v, str)}
FRAME_CALLS = {"encode", "encode_text", "send", "ask", "emit", "now", "later"}
"""Functions whose first argument is a frame kind (``wire.encode(kind, ...)``, a channel's
``send(kind, ...)``, a session's ``ask(kind, ...)``, the outbox's ``now``/``later``)."""
KIND_NAMES = {"kind", "frame_kind"}
"""Names a received frame's kind is held in and compared with."""


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _strings(node: ast.AST) -> list[ast.Constant]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c for e in node.elts for c in _strings(e)]
    return []


def bare_frame_kinds(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, kind) of every frame kind spelled as a literal where a frame is made or read."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        candidates: list[ast.Constant] = []
        if isinstance(node, ast.Call) and _name(node.func) in FRAME_CALLS and node.args:
            candidates = _strings(node.args[0])
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_name(s) in KIND_NAMES for s in sides):
                candidates = [c for s in sides for c in _strings(s)]
        found += [(c.lineno, c.value) for c in candidates if c.value in KINDS]
    return found


def modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p != SRC / "node" / "wire.py")


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_frame_kind_is_spelled_outside_wire(path: Path) -> None:
    bare = bare_frame_kinds(ast.parse(path.read_text()))
    assert not bare, (f"{path.relative_to(SRC)}: frame kinds spelled bare (use wire.Kind): "
                      + ", ".join(f"line {line} {kind!r}" for line, kind in bare))


def control_requests(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, request) of every control request spelled as a literal: ``{"cmd": "stacks"}``."""
    return [(v.lineno, v.value) for node in ast.walk(tree) if isinstance(node, ast.Dict)
            for k, v in zip(node.keys, node.values, strict=True)
            if isinstance(k, ast.Constant) and k.value == "cmd"
            and isinstance(v, ast.Constant) and isinstance(v.value, str)]


@pytest.mark.parametrize("path", [p for p in modules() if p != SRC / "control" / "protocol.py"],
                         ids=lambda p: str(p.relative_to(SRC)))
def test_no_control_request_is_spelled_outside_its_protocol(path: Path) -> None:
    bare = control_requests(ast.parse(path.read_text()))
    assert not bare, (f"{path.relative_to(SRC)}: control requests spelled bare (use "
                      "control.protocol): " + ", ".join(f"line {n} {r!r}" for n, r in bare))


def test_the_finder_finds_what_it_must_and_nothing_else() -> None:
    code = '''
send("stop")
wire.encode("ready", {})
if kind == "hb" or kind in ("o", "e"):
    pass
out.now(encode(Kind.STOP))
name = "ready"           # not a frame
if mode == "stop": pass  # not a frame kind
'''
    assert sorted(bare_frame_kinds(ast.parse(code))) == [
        (2, "stop"), (3, "ready"), (4, "e"), (4, "hb"), (4, "o")]
    assert control_requests(ast.parse('ask(path, {"cmd": "kill", "by": x})\n{"cmd": CMD}')) == [
        (1, "kill")]

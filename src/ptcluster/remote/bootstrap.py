"""How node programs (the guard, the doctor's probe, the monitor's sampler) reach a node: a
fixed one-line command, then everything else over stdin.

The only text that passes through the node's shell is ``PYTHON -u -c BOOTSTRAP PROGRAM TAG``
(quoted with shlex; PROGRAM and TAG are plain words), so ``ps`` on the node shows which program
runs for which job. The program's source and its JSON config (argv, env, paths) travel on the
channel's stdin, so no host, path or env value is ever re-parsed by a shell.

A shipped program may use the standard library, the modules named in ``INLINED`` and its own
``parts``: the packer puts their source in front of the program's and drops the imports of them
(marked ``# inlined``), so the node needs nothing of ptcluster installed.
"""

from __future__ import annotations

import ast
import base64
import json
import re
import zlib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

BOOTSTRAP = (
    "import sys,zlib,base64;"
    "exec(compile(zlib.decompress(base64.b64decode(sys.stdin.buffer.readline())),"
    "'ptcluster-'+sys.argv[1],'exec'))"
)
INLINED = (("ptcluster.node", "wire.py"), ("ptcluster.node", "netif.py"))
"""Modules every shipped program gets in front of its own source, in this order."""
_FUTURE = "from __future__ import annotations"
_WORD = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@dataclass(frozen=True)
class NodeProgram:
    """A program shipped to a node: ``name`` is its label on the node (argv, tracebacks);
    ``parts`` are modules of the same package shipped in front of it."""

    name: str
    package: str
    filename: str
    parts: tuple[str, ...] = ()


GUARD = NodeProgram("guard", "ptcluster.node", "guard.py",
                    ("proctree.py", "hangwatch.py", "rank_server.py"))
"""The node side of a run (the programs of other subsystems are declared where they are used)."""


def pack_source(program: NodeProgram) -> str:
    """The source a node executes: the inlined modules, the program's parts, then the program,
    in one namespace. Imports of the shipped modules are dropped (found by the AST, not by
    formatting); they are marked ``# inlined`` for the reader."""
    files = [*INLINED, *((program.package, part) for part in program.parts),
             (program.package, program.filename)]
    shipped = {"__future__"} | {f"{pkg}.{name.removesuffix('.py')}" for pkg, name in files}
    parts = [_FUTURE]
    for pkg, name in files:
        text = resources.files(pkg).joinpath(name).read_text()
        lines = text.splitlines()
        for node in reversed(ast.parse(text).body):
            if isinstance(node, ast.ImportFrom) and node.module in shipped:
                del lines[node.lineno - 1:node.end_lineno]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


@lru_cache(maxsize=8)
def payload(program: NodeProgram) -> bytes:
    """Line 1 of a node program's stdin: its packed source, compressed."""
    source = pack_source(program).encode()
    return base64.b64encode(zlib.compress(source, 9)) + b"\n"


def node_argv(python: str, program: NodeProgram, tag: str = "-") -> list[str]:
    """The command run on the node (locally, or as ssh's remote command).

    ``tag`` (a job id, or "-") is only there to be seen: in ``ps`` and by tests that look for
    what a job left behind.
    """
    if not _WORD.match(tag):
        raise ValueError(f"bad node program tag {tag!r}")
    return [python, "-u", "-c", BOOTSTRAP, program.name, tag]


def preamble(program: NodeProgram, config: dict[str, Any]) -> bytes:
    """What a node program reads first: its source, then its JSON config."""
    return payload(program) + json.dumps(config).encode() + b"\n"

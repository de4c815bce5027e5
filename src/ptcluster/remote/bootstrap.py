"""How node programs (the guard, the doctor's facts, the monitor's sampler) reach a node: a
fixed one-line command, then everything else over stdin.

The only text that passes through the node's shell is ``PYTHON -u -c BOOTSTRAP PROGRAM TAG``
(quoted with shlex; PROGRAM and TAG are plain words), so ``ps`` on the node shows which program
runs for which job; nothing is imported from the directory it starts in. The program's source
and its JSON config (argv, env, paths) travel on the channel's stdin, so no host, path or env
value is ever re-parsed by a shell.

What a shipped program may import, and what is packed with it, is declared in ``ptcluster.node``
(``Program``): the packer puts its ``parts`` in front of the program's own source and drops the
imports of them (marked ``# inlined``), so the node needs nothing of ptcluster installed.
"""

from __future__ import annotations

import ast
import base64
import json
import re
import zlib
from functools import lru_cache
from importlib import resources
from typing import Any

from ptcluster.node import Program

BOOTSTRAP = (
    # First, before any import that searches sys.path: the current directory off it (``-c``
    # puts it first; a json.py in the directory the head or srun ran from, or in the node
    # user's home, was imported by every node program). Not ``-I``: it also drops PYTHONPATH
    # and the user's site-packages, where a node's optional psutil/pynvml may be; not ``-P``:
    # Python 3.11+ only (Ubuntu 20.04 and 22.04 run 3.8 and 3.10).
    "import sys;sys.path[:]=[p for p in sys.path if p not in('','.')];"
    "import zlib,base64;"
    "exec(compile(zlib.decompress(base64.b64decode(sys.stdin.buffer.readline())),"
    "'ptcluster-'+sys.argv[1],'exec'))"
)
HANDED = "HANDED"
"""The name, in a packed program, of its ``hands``: ``{filename: packed source}``."""
_FUTURE = "from __future__ import annotations"
_WORD = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def module_source(module: str) -> str:
    package, _, name = module.rpartition(".")
    return resources.files(package).joinpath(name + ".py").read_text()


@lru_cache(maxsize=16)
def pack_source(program: Program) -> str:
    """The source a node or rank executes: the program's parts, then the program, in one
    namespace (the programs it hands on first, as one constant). Imports of the shipped modules
    are dropped (found by the AST, not by formatting); they are marked ``# inlined``."""
    shipped = {"__future__", *program.modules}
    parts = [_FUTURE]
    if program.hands:
        handed = {hand.module.rpartition(".")[2] + ".py": pack_source(hand)
                  for hand in program.hands}
        parts.append(f"{HANDED} = {handed!r}")
    for module in program.modules:
        text = module_source(module)
        lines = text.splitlines()
        for node in reversed(ast.parse(text).body):
            if isinstance(node, ast.ImportFrom) and node.module in shipped:
                del lines[node.lineno - 1:node.end_lineno]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


@lru_cache(maxsize=8)
def payload(program: Program) -> bytes:
    """Line 1 of a node program's stdin: its packed source, compressed."""
    source = pack_source(program).encode()
    return base64.b64encode(zlib.compress(source, 9)) + b"\n"


def node_argv(python: str, program: Program, tag: str = "-") -> list[str]:
    """The command run on the node (locally, or as ssh's remote command).

    ``tag`` (a job id, or "-") is only there to be seen: in ``ps`` and by tests that look for
    what a job left behind.
    """
    if not _WORD.match(tag):
        raise ValueError(f"bad node program tag {tag!r}")
    return [python, "-u", "-c", BOOTSTRAP, program.name, tag]


def preamble(program: Program, config: dict[str, Any]) -> bytes:
    """What a node program reads first: its source, then its JSON config."""
    return payload(program) + json.dumps(config).encode() + b"\n"

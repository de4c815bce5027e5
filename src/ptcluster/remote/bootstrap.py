"""How node programs (the guard, the doctor's facts, the monitor's sampler) reach a node: a
fixed one-line command, then everything else over stdin.

The only text that passes through the node's shell is ``PYTHON -u -c BOOTSTRAP PROGRAM TAG``
(quoted with shlex; PROGRAM and TAG are plain words), so ``ps`` on the node shows which program
runs for which job; nothing is imported from the directory it starts in. The program and its
JSON config (argv, env, paths) travel on the channel's stdin, so no host, path or env value is
ever re-parsed by a shell.

A program travels as its modules (mitogen's first stage, then AnsiballZ's idea: the modules and
``runpy``): ``node.importer``'s source, the program's import closure as ``{module: source}``
(every ``ptcluster`` module its module imports, and theirs: found in their compiled code here),
and one call that runs it with those modules importable (``node.importer``), each under its own
path.
"""

from __future__ import annotations

import ast
import base64
import dis
import json
import re
import zlib
from collections.abc import Iterator, Mapping
from functools import lru_cache
from importlib import resources
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import CodeType
from typing import Any

import ptcluster
from ptcluster.node import IMPORTER, RANK, Program

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
PACKAGE = "ptcluster"
_ROOT = Path(ptcluster.__file__).parent.parent
_WORD = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def module_source(module: str) -> str:
    package, _, name = module.rpartition(".")
    return resources.files(package).joinpath(name + ".py").read_text()


def is_module(name: str) -> bool:
    """Whether ``name`` is a module of ours with a file of its own (not a package; nothing is
    imported to tell)."""
    return _ROOT.joinpath(*name.split(".")).with_suffix(".py").is_file()


def imported(module: str) -> set[str]:
    """The ``ptcluster`` modules ``module`` imports, anywhere in it (``from P import M`` counts
    as the module ``P.M`` where that is one), read off its compiled code: every import is an
    ``IMPORT_NAME`` there, after its level and its names. The code comes from the head's own
    bytecode cache where it is current (as an import takes it), so a run parses no source:
    a syntax tree of the guard's 45 modules cost every run ~0.15 s."""
    found: set[str] = set()
    for name, level, names in _imports(_code(module)):
        if level == 0 and name.split(".")[0] == PACKAGE:
            subs = {f"{name}.{a}" for a in names or ()}
            found |= {s for s in subs if is_module(s)} or {name}
    return found


def _code(module: str) -> CodeType:
    path = _ROOT.joinpath(*module.split(".")).with_suffix(".py")
    code = SourceFileLoader(module, str(path)).get_code(module)
    assert code is not None  # (None only for a loader without source)
    return code


def _imports(code: CodeType) -> Iterator[tuple[str, Any, Any]]:
    """``(module, level, names)`` of every import in ``code`` and the code inside it (the two
    values an ``IMPORT_NAME`` takes are the ones loaded just before it)."""
    todo = [code]
    while todo:
        co = todo.pop()
        todo.extend(c for c in co.co_consts if isinstance(c, CodeType))
        if not any(n.split(".")[0] == PACKAGE for n in co.co_names):
            continue  # (no import of ours here: most of the code objects)
        before: list[Any] = [None, None]
        for ins in dis.get_instructions(co):
            if ins.opname == "IMPORT_NAME":
                yield ins.argval, before[0], before[1]
            before = [before[1], ins.argval]


@lru_cache(maxsize=64)
def closure(module: str) -> tuple[str, ...]:
    """``module`` and every ``ptcluster`` module it needs, sorted: what is shipped with it."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(imported(name))
    return tuple(sorted(seen))


def shipped(program: Program) -> tuple[str, ...]:
    """The modules a program travels with: its module's closure (and its ``parts``'s)."""
    return tuple(sorted({m for name in (program.module, *program.parts) for m in closure(name)}))


@lru_cache(maxsize=1)
def importer_source() -> str:
    """``node.importer`` as it goes in front of every program: its code, without docstrings
    (a node never shows its lines; every program carries it, the guard three times: 3 KB of
    its payload)."""
    tree = ast.parse(module_source(IMPORTER))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            body[:] = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(
                s.value, ast.Constant) and isinstance(s.value.value, str))] or [ast.Pass()]
    return ast.unparse(tree) + "\n"


@lru_cache(maxsize=16)
def pack_source(program: Program) -> str:
    """The source a node or rank executes: the import hook, the program's modules, and the
    call that runs it (``node.importer``): a node program as ``__main__`` with the hook in place
    for good; a rank-side one is loaded and the hook taken away before its ``main()`` runs (it
    runs in a user's process, or beside torch). A node program's ``hands`` come as its data
    files (``{file name: packed source}``: ``importer.Shipped.get_data``)."""
    sources = {m: module_source(m) for m in shipped(program)}
    if program.kind == RANK:
        call = (f"PROGRAM = load({sources!r}, {program.module!r})\n"
                "if __name__ == '__main__':\n    PROGRAM.main()\n")
    else:
        call = f"run({sources!r}, {program.module!r}, {hands(program)!r})\n"
    return importer_source() + "\n\n" + call


def hands(program: Program) -> dict[str, str]:
    """What a program hands on, as the files it finds them in: ``{file name: packed source}``
    (the file named as the handed program's module is)."""
    return {hand.module.rpartition(".")[2] + ".py": pack_source(hand) for hand in program.hands}


@lru_cache(maxsize=8)
def payload(program: Program) -> bytes:
    """Line 1 of a node program's stdin: its packed source, compressed (level 6: the guard's
    0.5 MB in a third of level 9's time, 0.5 % larger)."""
    source = pack_source(program).encode()
    return base64.b64encode(zlib.compress(source, 6)) + b"\n"


def node_argv(python: str, program: Program, tag: str = "-") -> list[str]:
    """The command run on the node (locally, or as ssh's remote command).

    ``tag`` (a job id, or "-") is only there to be seen: in ``ps`` and by tests that look for
    what a job left behind.
    """
    if not _WORD.match(tag):
        raise ValueError(f"bad node program tag {tag!r}")
    return [python, "-u", "-c", BOOTSTRAP, program.name, tag]


def preamble(program: Program, config: Mapping[str, object]) -> bytes:
    """What a node program reads first: its source, then its JSON config."""
    return payload(program) + json.dumps(config).encode() + b"\n"

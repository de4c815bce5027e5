"""Programs shipped to nodes and ranks run where ptcluster is not installed. What each may import
follows from its declaration in ``ptcluster.node`` (the one list): node programs the standard
library and their parts; rank programs also torch. Every module of the node package is declared.
Plus: every packed node program compiles and says hello in the wire format, and the guard hands
its ranks what they run."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

import ptcluster.node
from ptcluster.node import (
    FACTS,
    GUARD,
    NODE,
    OPTIONAL,
    PROGRAMS,
    RANK,
    SAMPLER,
    SETUP_AGENT,
    Program,
    rank_wire,
    wire,
)
from ptcluster.remote.bootstrap import BOOTSTRAP, HANDED, pack_source, preamble

ALLOWED_THIRD_PARTY = {NODE: set(OPTIONAL), RANK: {"torch"}}


def tree(module: str) -> ast.Module:
    package, _, name = module.rpartition(".")
    return ast.parse(resources.files(package).joinpath(name + ".py").read_text())


def imports(module: str) -> set[str]:
    """Every module ``module`` imports; a ptcluster module counts as shipped only when it is
    imported the way the packer strips it: ``from X import ...`` at the top level."""
    found = set()
    module_tree = tree(module)
    top = {id(n) for n in module_tree.body}
    for node in ast.walk(module_tree):
        if isinstance(node, ast.Import):  # `import ptcluster.x` is never stripped
            found |= {a.name + (" (import)" if a.name.startswith("ptcluster") else "")
                      for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            nested = id(node) not in top and node.module.startswith("ptcluster")
            found.add(node.module + (" (not top level)" if nested else ""))
    return found


def not_allowed(program: Program, module: str) -> set[str]:
    """What ``module`` imports that the node would not have: only the standard library, the
    parts shipped before it in ``program`` and the kind's third-party modules are there."""
    before = set(program.modules[:program.modules.index(module)])
    extra = ALLOWED_THIRD_PARTY[program.kind]
    return {m for m in imports(module)
            if m.split(".")[0] not in sys.stdlib_module_names and m not in before
            and m.split(".")[0] not in extra}


def top_level_names(module: str) -> set[str]:
    """The names a module defines at its top level (also in ``if``/``try`` blocks there, and
    every name of a tuple assignment: ``OUT, ERR = ...``); imports are not counted (two parts
    may well both import ``os``)."""
    return _defined(tree(module).body) - {"__all__"}


def _defined(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        elif isinstance(node, (ast.If, ast.Try)):
            blocks = [node.body, node.orelse, *(h.body for h in getattr(node, "handlers", [])),
                      getattr(node, "finalbody", [])]
            names |= {n for block in blocks for n in _defined(block)}
    return names


def test_a_tuple_assignment_defines_every_name_it_binds() -> None:
    assert _defined(ast.parse("A, (B, C) = 1, (2, 3)\nif x:\n    D = 4\nimport os\n").body) \
        == {"A", "B", "C", "D"}


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_no_two_parts_of_a_program_define_one_name(program: Program) -> None:
    """Packed, a program is one namespace: a name defined twice is silently the last one."""
    seen: dict[str, str] = {}
    for module in program.modules:
        for name in top_level_names(module):
            assert name not in seen, f"{name} is defined in {seen[name]} and {module}"
            seen[name] = module


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_every_shipped_module_imports_only_what_its_node_has(program: Program) -> None:
    for module in program.modules:
        bad = not_allowed(program, module)
        assert not bad, f"{module} (in {program.name}) imports {bad}: the node does not have them"


def test_the_check_finds_a_forbidden_import() -> None:
    """The rule itself: a module shipped before the one that needs it does not count."""
    wrong_order = Program("x", "ptcluster.node.guard.rank_server", parts=("ptcluster.node.wire",))
    assert not_allowed(wrong_order, "ptcluster.node.guard.rank_server") == {
        "ptcluster.node.guard.progress", "ptcluster.node.guard.outbox", "ptcluster.node.rank_wire"}
    assert "torch" in not_allowed(Program("y", "ptcluster.node.rank.api"),
                                  "ptcluster.node.rank.api")
    clash = [n for n in top_level_names("ptcluster.node.wire")
             if n in top_level_names("ptcluster.node.rank_wire")]
    assert clash == [], clash  # (was: two `encode`s; the packed guard got the rank one)


def test_every_module_of_the_node_package_is_declared() -> None:
    root = Path(ptcluster.node.__file__).parent
    found = {".".join(("ptcluster.node", *p.relative_to(root).with_suffix("").parts))
             for p in root.rglob("*.py") if p.name != "__init__.py"}
    declared = {m for p in PROGRAMS for m in p.modules}
    assert found == declared, f"undeclared: {found - declared}, missing: {declared - found}"


def test_rank_records_and_their_frames_agree() -> None:
    assert set(wire.RANK_FRAMES) == {rank_wire.START, rank_wire.EXIT, rank_wire.ERROR,
                                     rank_wire.REPORT}
    handed = next(line for line in pack_source(GUARD).splitlines()
                  if line.startswith(f"{HANDED} = "))  # one line: a repr
    names = ast.literal_eval(handed.partition(" = ")[2])
    assert set(names) == {rank_wire.SHIM_FILE, rank_wire.PROBE_FILE, rank_wire.AGENT_FILE}
    for name, source in names.items():
        compile(source, name, "exec")
        assert "from ptcluster" not in source


@pytest.mark.no_job
@pytest.mark.parametrize("program", [GUARD, FACTS, SAMPLER, SETUP_AGENT], ids=lambda p: p.name)
def test_packed_program_compiles_and_says_hello(program: Program) -> None:
    source = pack_source(program)
    compile(source, program.name, "exec")
    assert "from ptcluster" not in source  # the package imports were dropped
    if program in (FACTS, SETUP_AGENT):
        return  # they collect facts first; their frames are tested with them
    config = {"interval": 0.2} if program is SAMPLER else {
        "job_id": "J", "argv": ["true"], "env": {}, "workdir": "/nonexistent-dir",
        "target": {}, "heartbeat_timeout": 15, "grace": 1}
    proc = subprocess.run([sys.executable, "-u", "-c", BOOTSTRAP, program.name, "-"],
                          input=preamble(program, config), capture_output=True, timeout=60)
    first = proc.stdout.decode().splitlines()[0]
    kind, payload = wire.split(first)
    assert kind == "hello" and wire.control(payload)["v"] == wire.VERSION
    if program is GUARD:  # a missing workdir is refused before anything starts
        kind, payload = wire.split(proc.stdout.decode().splitlines()[1])
        assert kind == "error" and "does not exist" in wire.control(payload)["problem"]


@pytest.mark.no_job
@pytest.mark.parametrize("program", [GUARD, SETUP_AGENT], ids=lambda p: p.name)
def test_a_node_program_imports_nothing_from_the_directory_it_starts_in(
        program: Program, tmp_path) -> None:
    # `python -c` puts the current directory first on sys.path: the head's directory (a cloned
    # repository) for a local node, srun's, or the node user's home. Before: the planted
    # json.py ran in every node program started there.
    from ptcluster.remote.bootstrap import node_argv

    for name in ("json", "base64", "zlib", "selectors", "threading"):
        (tmp_path / f"{name}.py").write_text(
            f"open({str(tmp_path / ('IMPORTED-' + name))!r}, 'w').close()\n")
    proc = subprocess.run(node_argv(sys.executable, program), cwd=tmp_path,
                          input=preamble(program, {}) + b"bye\n", capture_output=True,
                          timeout=60)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("IMPORTED")] == []
    kind, payload = wire.split(proc.stdout.decode().splitlines()[0])
    assert kind == "hello", proc.stderr


def test_the_fast_suite_refuses_a_test_that_starts_a_job() -> None:
    """conftest's guard for ``-m "not slow"`` (this test is not slow: it is under the guard)."""
    from ptcluster.node import GUARD as guard
    from ptcluster.remote.bootstrap import node_argv

    with pytest.raises(AssertionError, match="mark it @pytest.mark.slow"):
        subprocess.Popen(node_argv(sys.executable, guard, "J"))
    with pytest.raises(AssertionError, match="mark it @pytest.mark.slow"):
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "x.py"])
    with pytest.raises(AssertionError, match="mark it @pytest.mark.slow"):
        subprocess.Popen(["ip", "netns", "add", "x"])
    subprocess.run(["true"], check=True)  # anything else runs


def test_the_guard_reads_its_hands_under_the_name_the_packer_gives_them() -> None:
    """The packer assigns a program's ``hands`` to ``bootstrap.HANDED`` in front of its source;
    the guard's part that writes them out for the ranks reads that very name (no import can
    carry it: the packed program is one namespace, and the node has no ptcluster)."""
    readers = [m for m in GUARD.modules if HANDED in top_level_names(m)]
    assert readers == ["ptcluster.node.guard.spawn"], readers
    source = pack_source(GUARD)
    assigned = source.index(f"\n{HANDED} = {{")
    assert assigned < source.index(f'\n{HANDED}: dict[str, str] = globals().get("{HANDED}"')

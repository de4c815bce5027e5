"""Programs shipped to nodes and ranks run where ptcluster is not installed. Each travels as its
modules: its own and every ``ptcluster`` module it imports (``bootstrap.shipped``, computed),
behind ``node.importer``. What each module may import follows from its program's kind: node
programs the standard library and the shipped modules; rank programs also torch. Plus: every
packed node program starts and says hello in the wire format, a rank-side program leaves no trace
of the hook for the user's code, the guard hands its ranks what they run, and a node's traceback
shows the module's path, the line and its source."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ptcluster.node
from ptcluster.node import (
    FACTS,
    GUARD,
    IMPORTER,
    NODE,
    OPTIONAL,
    PROGRAMS,
    RANK,
    SAMPLER,
    SETUP_AGENT,
    SHIM,
    Program,
    rank_wire,
    wire,
)
from ptcluster.node.warm.protocol import POOL_FILE
from ptcluster.remote.bootstrap import (
    BOOTSTRAP,
    PACKAGE,
    closure,
    hands,
    imported,
    is_module,
    module_source,
    node_argv,
    pack_source,
    preamble,
    shipped,
)

ALLOWED_THIRD_PARTY = {NODE: set(OPTIONAL), RANK: {"torch"}}
NODE_PACKAGE = "ptcluster.node."


def imports(module: str) -> set[str]:
    """Every module ``module`` imports, anywhere in it (``from P import M``: ``P.M`` where that
    is a module of ours)."""
    found = set()
    for node in ast.walk(ast.parse(module_source(module))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names if is_module(
                f"{node.module}.{a.name}")}
            found |= subs or {node.module}
    return found


def not_allowed(program: Program, module: str) -> set[str]:
    """What ``module`` imports that the node would not have: only the standard library, the
    modules shipped with ``program`` and the kind's third-party modules are there; and a module
    of ours only when it is a node module (never the head's, never a package's ``__init__``)."""
    extra = ALLOWED_THIRD_PARTY[program.kind]
    there = set(shipped(program))
    return {m for m in imports(module)
            if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] not in extra
            and not (m in there and m.startswith(NODE_PACKAGE) and is_module(m))}


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_every_shipped_module_imports_only_what_its_node_has(program: Program) -> None:
    for module in (*shipped(program), IMPORTER):
        bad = not_allowed(program, module)
        assert not bad, f"{module} (in {program.name}) imports {bad}: the node does not have them"


@pytest.mark.parametrize("program", [p for p in PROGRAMS if p.kind == RANK], ids=lambda p: p.name)
def test_a_rank_side_module_imports_ours_at_its_top(program: Program) -> None:
    """A rank-side program's hook is gone once its modules are imported (``importer.load``): an
    import of ours inside a function would find nothing (or the user's installed copy)."""
    for module in shipped(program):
        tree = ast.parse(module_source(module))
        top = {id(n) for n in tree.body}
        late = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                and id(n) not in top and any(name.startswith(PACKAGE) for name in (
                    [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]))]
        assert not late, f"{module} imports ptcluster modules late, at lines {late}"


def test_the_check_finds_a_forbidden_import() -> None:
    """The rule itself: a head module, a package's ``__init__`` and torch in a node program are
    refused; what a module imports is shipped with it, inside a function too."""
    assert not_allowed(Program("x", "ptcluster.launch.plan"), "ptcluster.launch.plan")
    assert "torch" in not_allowed(Program("y", "ptcluster.node.rank.api"),
                                  "ptcluster.node.rank.api")
    assert "ptcluster.node" not in imports("ptcluster.node.guard.agent")
    assert {"ptcluster.node.guard.rank_server", "ptcluster.node.guard.outbox",
            "ptcluster.node.rank_wire", "ptcluster.node.wire"} <= set(closure(GUARD.module))
    assert set(closure("ptcluster.node.rank.shim")) == {
        "ptcluster.node.rank.shim", "ptcluster.node.rank_wire", "ptcluster.node.rank.stack_probe",
        "ptcluster.node.rank.step_probe"}


def test_the_closure_read_off_compiled_code_is_the_one_the_syntax_tree_gives() -> None:
    """``bootstrap.imported`` reads a module's imports off its bytecode (no source parsed per
    run): the same ``ptcluster`` modules as its syntax tree names, for every module shipped
    (imports inside functions, ``from P import M`` of a module and of names alike)."""
    modules = {m for p in PROGRAMS for m in shipped(p)} | {IMPORTER}
    for module in sorted(modules):
        ours = {m for m in imports(module) if m.split(".")[0] == PACKAGE}
        assert imported(module) == ours, module


def test_every_module_of_the_node_package_is_shipped() -> None:
    root = Path(ptcluster.node.__file__).parent
    found = {".".join(("ptcluster.node", *p.relative_to(root).with_suffix("").parts))
             for p in root.rglob("*.py") if p.name != "__init__.py"}
    used = {m for p in PROGRAMS for m in shipped(p)} | {IMPORTER}
    assert found == used, f"shipped by no program: {found - used}, not found: {used - found}"


def as_the_guard(code: str) -> object:
    """What ``code`` prints (JSON) in a process whose modules are the guard's, as shipped."""
    code = (module_source(IMPORTER) + "\nimport json\n"
            + "\nsources = " + repr({m: module_source(m) for m in shipped(GUARD)})
            + "\nsys.meta_path.insert(0, Shipped(sources, " + repr(hands(GUARD)) + "))\n"
            + code)
    proc = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_guard_finds_a_users_module_as_the_ranks_will_not_its_own_copy() -> None:
    """The guard refuses a ``-m`` target its ranks would not find; ``ptcluster`` is imported
    in the guard (its own shipped modules), but the ranks see the installed one (or none)."""
    found = as_the_guard(
        "from ptcluster.node.guard.prechecks import module_present\n"
        "print(json.dumps([module_present(m, '/') for m in ('ptcluster.examples.mnist',"
        " 'ptcluster.node.guard.agent', 'ptcluster.no_such_module', 'json.tool')]))\n")
    assert found == [True, True, False, True]


def test_the_guard_hands_its_ranks_the_shim_torchruns_agent_and_the_warm_pool() -> None:
    handed = as_the_guard("from ptcluster.node.guard.spawn import HANDED\n"
                          "print(json.dumps(HANDED))\n")
    assert isinstance(handed, dict)
    assert set(handed) == {rank_wire.SHIM_FILE, rank_wire.AGENT_FILE, POOL_FILE}
    assert handed == hands(GUARD) and repr(handed) in pack_source(GUARD)
    assert handed[rank_wire.SHIM_FILE] == pack_source(SHIM)
    for name, source in handed.items():
        compile(source, name, "exec")


@pytest.mark.parametrize("program", [p for p in PROGRAMS if p.kind == RANK], ids=lambda p: p.name)
def test_a_rank_side_program_leaves_the_users_imports_alone(program: Program) -> None:
    """Loaded (as the shim is in every rank), then the user's code: no hook is left, no module
    of ours is in ``sys.modules``, and ``import ptcluster`` finds the installed one."""
    code = ("ns = {'__name__': 'not_main'}\n"
            f"exec(compile({pack_source(program)!r}, 'p', 'exec'), ns)\n"
            "import sys\n"
            "assert callable(ns['PROGRAM'].main)\n"
            "assert not [m for m in sys.modules if m.startswith('ptcluster')], sys.modules\n"
            "assert not [f for f in sys.meta_path if type(f).__name__ == 'Shipped']\n"
            "import ptcluster.node.rank_wire as w\n"
            "assert w.__file__.endswith('/src/ptcluster/node/rank_wire.py'), w.__file__\n")
    proc = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.no_job
@pytest.mark.parametrize("program", [GUARD, FACTS, SAMPLER, SETUP_AGENT], ids=lambda p: p.name)
def test_packed_program_compiles_and_says_hello(program: Program) -> None:
    source = pack_source(program)
    compile(source, program.name, "exec")
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
        said = wire.control(payload)
        assert kind == "error" and said["code"] == "guard.workdir-missing", said


@pytest.mark.no_job
def test_a_node_programs_traceback_shows_the_module_line_and_source() -> None:
    """A node program that raises (the sampler, given an interval that is no number): its
    traceback names the shipped module's path in the package, the line, and the line's text."""
    proc = subprocess.run(node_argv(sys.executable, SAMPLER), input=preamble(
        SAMPLER, {"interval": "soon"}), capture_output=True, timeout=60)
    err = proc.stderr.decode()
    source = module_source(SAMPLER.module).splitlines()
    line = next(n for n, text in enumerate(source, 1) if 'float(cfg.get("interval"' in text)
    assert f'File "ptcluster/node/sampler.py", line {line}, in main\n' in err, err
    assert f"\n    {source[line - 1].strip()}\n" in err, err
    assert err.rstrip().endswith("ValueError: could not convert string to float: 'soon'"), err
    assert proc.returncode == 1


@pytest.mark.no_job
@pytest.mark.parametrize("program", [GUARD, SETUP_AGENT], ids=lambda p: p.name)
def test_a_node_program_imports_nothing_from_the_directory_it_starts_in(
        program: Program, tmp_path) -> None:
    # `python -c` puts the current directory first on sys.path: the head's directory (a cloned
    # repository) for a local node, srun's, or the node user's home. Before: the planted
    # json.py ran in every node program started there. (Also: a planted ptcluster package.)
    for name in ("json", "base64", "zlib", "selectors", "threading", "runpy", "linecache"):
        (tmp_path / f"{name}.py").write_text(
            f"open({str(tmp_path / ('IMPORTED-' + name))!r}, 'w').close()\n")
    (tmp_path / "ptcluster").mkdir()
    (tmp_path / "ptcluster" / "__init__.py").write_text(
        f"open({str(tmp_path / 'IMPORTED-ptcluster')!r}, 'w').close()\n")
    proc = subprocess.run(node_argv(sys.executable, program), cwd=tmp_path,
                          input=preamble(program, {}) + b"bye\n", capture_output=True,
                          timeout=60)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("IMPORTED")] == []
    kind, payload = wire.split(proc.stdout.decode().splitlines()[0])
    assert kind == "hello", proc.stderr


def test_the_fast_suite_refuses_a_test_that_starts_a_job() -> None:
    """conftest's guard for ``-m "not slow"`` (this test is not slow: it is under the guard)."""
    with pytest.raises(AssertionError, match="mark it @pytest.mark.slow"):
        subprocess.Popen(node_argv(sys.executable, GUARD, "J"))
    with pytest.raises(AssertionError, match="mark it @pytest.mark.slow"):
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "x.py"])
    with pytest.raises(AssertionError, match="mark it @pytest.mark.slow"):
        subprocess.Popen(["ip", "netns", "add", "x"])
    subprocess.run(["true"], check=True)  # anything else runs


@pytest.mark.slow  # (a run: the guard starts, and fails in its prechecks)
def test_a_guard_that_raises_shows_the_module_line_and_source_on_the_heads_console(
        tmp_path) -> None:
    """The real head and guard (a local run); a ``sitecustomize`` on the ``PYTHONPATH`` the
    guard inherits makes ``socket.gethostname`` raise in the guard's process only, as a bug in
    the guard would: the head's console shows where, in the guard's own module, with the
    line's text."""
    from tests.support.head import only_run, run_head

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import socket, sys\n\ndef broken():\n    raise RuntimeError('a guard that raises')\n"
        "\nif sys.argv[:2] == ['-c', 'guard']:\n    socket.gethostname = broken\n")
    (tmp_path / "t.py").write_text("")
    code, head = run_head(["run", "--nproc", "1", "--run-dir", "runs", "t.py"], cwd=tmp_path,
                          timeout=120, env={"PYTHONPATH": str(site)})
    said = "\n".join(head.err + head.lines)
    source = module_source("ptcluster.node.guard.prechecks").splitlines()
    line = next(n for n, text in enumerate(source, 1) if "socket.gethostname()" in text)
    assert code != 0
    root = next(text for text in head.err + head.lines if text.startswith("Root cause"))
    _, summary = only_run(tmp_path / "runs")  # and in the run directory, the same
    cause = summary["root_cause"]
    assert (cause["kind"], cause["host"], cause["message"]) == (
        "guard", "localhost", "the guard failed: RuntimeError('a guard that raises')"), cause
    assert root.rstrip() == f"Root cause (first observed failure): localhost: " \
                            f"{cause['message']}. Fix: {cause['fix']}".rstrip(), said
    frames = cause["fix"].split("Traceback (most recent call last): | ")[1].split(" | ")
    at = frames.index(f'  File "ptcluster/node/guard/prechecks.py", line {line}, in precheck')
    assert frames[at + 1].strip() == source[line - 1].strip(), frames  # (the source line)
    assert frames[-4:] == [f'  File "{site / "sitecustomize.py"}", line 4, in broken',
                           "    raise RuntimeError('a guard that raises')",
                           "RuntimeError: a guard that raises", ""], frames

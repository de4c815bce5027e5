"""What can go wrong is declared data (``node.problems``): every table's entries have a unique,
well-formed code, a title and a fix of their own; each entry's text takes exactly its named
fields (one missing or one too many is an error); and every place in the source that says a
declared problem gives exactly the fields its entry declares (read from the source here, in
the test, so that a call no test runs is still checked)."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

import ptcluster
from ptcluster.checkpoint.collect import TABLE as CHECKPOINT
from ptcluster.cli.problems import TABLE as CLI
from ptcluster.control.kill import TABLE as KILL
from ptcluster.control.protocol import TABLE as CONTROL
from ptcluster.doctor.findings import SHM_SMALL, TABLE, Finding
from ptcluster.errors import Problem, PtclusterError
from ptcluster.launch.problems import TABLE as RUN
from ptcluster.node.blobs import TABLE as FILE
from ptcluster.node.data_agent import TABLE as NODE_PUSH
from ptcluster.node.facts.health import REFUSALS, WARNINGS
from ptcluster.node.guard.refusal import TABLE as GUARD
from ptcluster.node.guard.refusal import GuardError, refuse
from ptcluster.node.kill import TABLE as NODE_KILL
from ptcluster.node.problems import Declared, lint, placeholders
from ptcluster.node.venv_problems import PACKAGE_DIFFERS
from ptcluster.node.venv_problems import TABLE as NODE_VENVS
from ptcluster.push.scan import TABLE as PUSH
from ptcluster.remote.diagnoses import TABLE as NODE
from ptcluster.remote.slurm import TABLE as SLURM
from ptcluster.setup.problems import TABLE as SETUP
from ptcluster.submit.sbatch import TABLE as SUBMIT
from ptcluster.venvs.problems import TABLE as VENVS

TABLES = {"doctor": TABLE, "node": NODE, "health": REFUSALS + WARNINGS, "guard": GUARD,
          "run": RUN, "venvs": VENVS + NODE_VENVS, "cli": CLI, "submit": SUBMIT, "slurm": SLURM,
          "checkpoint": CHECKPOINT, "push": PUSH + NODE_PUSH, "file": FILE,
          "kill": NODE_KILL + KILL, "control": CONTROL, "setup": SETUP}
EVERY = [e for entries in TABLES.values() for e in entries]
SRC = Path(ptcluster.__file__).parent


def test_every_code_is_unique_well_formed_and_of_its_table() -> None:
    assert lint(EVERY) == []
    for kind, entries in TABLES.items():
        assert entries and all(e.code.startswith(f"{kind}.") for e in entries), kind


def test_the_lint_finds_what_it_refuses() -> None:
    bad = [Declared("doctor.x", "t", "w", "f"), Declared("doctor.x", "t", "w", "f"),
           Declared("Doctor_y", "t", "w", "f"), Declared("doctor.z", "t", "w", "{fix}")]
    assert lint(bad) == ["doctor.x: given twice", "Doctor_y: not KIND.NAME",
                         "doctor.z: no fix of its own"]


@pytest.mark.parametrize("entry", EVERY, ids=lambda e: e.code)
def test_each_entry_takes_exactly_its_fields(entry: Declared) -> None:
    values = {name: f"<{name}>" for name in entry.fields}
    what, fix = entry.texts(**values)
    assert all(f"<{name}>" in what + fix for name in entry.fields)  # every field is used
    assert fix.strip() and what.strip()
    with pytest.raises(TypeError, match="extra"):
        entry.texts(**values, unused="x")
    for name in entry.fields:
        with pytest.raises(TypeError, match=name):
            entry.texts(**{k: v for k, v in values.items() if k != name})


def test_placeholders_with_a_format_spec() -> None:
    assert placeholders("{a} of {b:.2f} ({c!r}) {{not}}") == {"a", "b", "c"}


def test_a_problem_a_finding_and_an_error_carry_the_code_and_fields() -> None:
    problem = Problem.of(SHM_SMALL, "n1", total="0.06")
    assert (problem.code, problem.fields) == ("doctor.shm-small", {"total": "0.06"})
    finding = SHM_SMALL.at("n1", total="0.06")
    assert isinstance(finding, Finding) and finding.problem == problem
    assert finding.to_json()["code"] == "doctor.shm-small"
    assert finding.to_json()["fields"] == {"total": "0.06"}
    err = PtclusterError.of(SHM_SMALL, total="0.06")
    assert (err.code, err.message, err.fix) == (problem.code, problem.what, problem.fix)
    assert str(err) == str(problem.by(None))  # the one rendering
    refused = refuse(GUARD[0])
    assert isinstance(refused, GuardError) and refused.frame()["code"] == GUARD[0].code


def test_a_node_sends_a_declared_problem_and_the_head_reads_it() -> None:
    sent = PACKAGE_DIFFERS.sent(name="tinya", have="1.0", version="1.1", env="/e")
    got = Problem.received("n1", json.loads(json.dumps(sent)))  # (through the wire's JSON)
    assert got == Problem.of(PACKAGE_DIFFERS, "n1", name="tinya", have="1.0", version="1.1",
                             env="/e")
    assert (got.code, got.fields) == ("venvs.package-differs", {
        "name": "tinya", "have": "1.0", "version": "1.1", "env": "/e"})
    words = Problem.received("n1", {"what": "in words"})  # (no code: said in words only)
    assert (words.code, words.fix, words.fields) == (None, None, {})


SAYERS = {"at": None, "of": 0, "refuse": 0, "refused": 1, "warned": 0, "sent": None,
          "BadReply": 0, "step": None}
"""Calls that say a declared problem: the method or function, and the position of the entry
among its arguments (None: the method's object is the entry, ``SHM_SMALL.at(host, ...)``)."""


def _resolver(module: ModuleType, tree: ast.Module) -> dict[str, object]:
    """Every name a module can use for a table entry: its own, and what it imports."""
    names: dict[str, object] = dict(vars(module))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                try:
                    names[alias.asname or alias.name] = getattr(
                        importlib.import_module(node.module), alias.name)
                except (ImportError, AttributeError):
                    continue
    return names


def _entry(node: ast.expr, names: dict[str, object]) -> Declared | None:
    if isinstance(node, ast.Name):
        found = names.get(node.id)
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        found = getattr(names.get(node.value.id), node.attr, None)
    else:
        return None
    return found if isinstance(found, Declared) else None


TABLE_MODULES = ("findings", "diagnoses", "refusal", "facts.health", "venvs.problems",
                 "venv_problems", "cli.problems", "setup.problems", "setup import problems",
                 "Declared(")
"""What a module that says a declared problem names: a table's module, or its own entries."""


def said_in_source() -> list[tuple[str, int, Declared, set[str]]]:
    """(module, line, entry, the keywords given) of every call that says a declared entry."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if not any(f"{s}(" in text for s in SAYERS) or not any(
                t in text for t in TABLE_MODULES):  # (no entry to say: not imported here)
            continue
        name = ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(
            ".__init__")
        tree = ast.parse(text)
        names = _resolver(importlib.import_module(name), tree)
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call) or any(k.arg is None for k in call.keywords):
                continue
            func = call.func
            said = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if said not in SAYERS:
                continue
            at = SAYERS[said]
            target = (func.value if isinstance(func, ast.Attribute) else None) if at is None \
                else (call.args[at] if len(call.args) > at else None)
            entry = _entry(target, names) if target is not None else None
            if entry is not None:
                keys = {str(k.arg) for k in call.keywords if k.arg not in ("busy", "environment")}
                out.append((name, call.lineno, entry, keys))
    return out


def test_every_call_gives_its_entry_exactly_its_fields() -> None:
    calls = said_in_source()
    assert len(calls) > 60  # the checks, the diagnoses, the health gate, the guard
    bad = [f"{m}:{line} {e.code}: gives {sorted(keys)}, declares {sorted(e.fields)}"
           for m, line, e, keys in calls if keys != e.fields]
    assert not bad, "\n".join(bad)


def test_the_source_check_sees_a_wrong_field() -> None:
    """The check itself: a call with a field its entry does not declare is found."""
    tree = ast.parse("F.SHM_SMALL.at(host, total=1, free=2)")
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    import ptcluster.doctor.findings as F

    assert isinstance(call.func, ast.Attribute)
    entry = _entry(call.func.value, {"F": F})
    assert entry is SHM_SMALL and {k.arg for k in call.keywords} != entry.fields


def test_a_known_failure_has_a_code_of_its_name() -> None:
    """The known rank failures keep their table (``known.py``: matched, not raised); a failure
    that is one says ``known.NAME`` as its code, beside ``known``."""
    from ptcluster.launch.result import Failure
    from ptcluster.launch.supervise.known import TABLE as KNOWN
    from ptcluster.node.problems import CODE

    assert all(CODE.match(f"known.{k.name}") for k in KNOWN)
    failure = Failure(host="n1", rank=0, message="boom", known=KNOWN[0].name)
    assert failure.code == f"known.{KNOWN[0].name}"
    assert Failure(host="n1", rank=0, message="boom").code is None

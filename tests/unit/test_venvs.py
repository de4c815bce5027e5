"""The pure parts of the project's environment: which to keep, refusals, records, paths."""

from __future__ import annotations

import json
import os
import sys

import pytest

from ptcluster.errors import Problem
from ptcluster.node.guard.agent import mark_env_use
from ptcluster.node.venv_store import choose, norm
from ptcluster.venvs.resolved import Platform, ResolvedEnv, Wheel
from ptcluster.venvs.runenv import EnvironmentFailed
from ptcluster.venvs.ship import NodeEnv, ShipResult, platform_problem

GIB = 1 << 30


def env(name: str, size: int = GIB, in_use: tuple[str, ...] = ()) -> dict:
    return {"digest": name, "size": size, "in_use": list(in_use)}


@pytest.mark.parametrize(("envs", "keep", "cap", "kept", "why_removed"), [
    # the most recent first: keep the first N
    ([env("a"), env("b"), env("c"), env("d")], 3, 100 * GIB, ["a", "b", "c"],
     {"d": "not among the 3 most recently used"}),
    # one in use is kept, however old
    ([env("a"), env("b"), env("c", in_use=("j1",))], 1, 100 * GIB, ["a", "c"],
     {"b": "not among the 1 most recently used"}),
    # over the size cap: the oldest unused go, never the newest, never one in use
    ([env("a", 5 * GIB), env("b", 5 * GIB, ("j",)), env("c", 5 * GIB)], 3, 9 * GIB, ["a", "b"],
     {"c": "over the size cap (9663676416 bytes)"}),
    ([env("a", 50 * GIB)], 3, GIB, ["a"], {}),
    ([env("a"), env("b", in_use=("j",))], 0, 0, ["b"], {"a": "not among the 0 most recently used"}),
])
def test_choose(envs: list[dict], keep: int, cap: int, kept: list[str],
                why_removed: dict[str, str]) -> None:
    got_kept, got_removed = choose(envs, keep, cap)
    assert sorted(e["digest"] for e in got_kept) == kept
    assert {e["digest"]: e["why"] for e in got_removed} == why_removed


def test_choose_keeps_one_given_to_a_job_moments_ago() -> None:
    envs = [{**env("a"), "last_used": 100.0}, {**env("b"), "last_used": 50.0}]
    kept, removed = choose(envs, 0, 0, recent=90.0)
    assert [(e["digest"], e["why"]) for e in kept] == [
        ("a", "given to a job moments ago (it may be starting)")]
    assert [e["digest"] for e in removed] == ["b"]


def test_norm() -> None:
    assert norm("Foo_Bar.baz") == norm("foo-bar-baz") == "foo-bar-baz"


def resolved(python: str = "3.11", machine: str = "x86_64") -> ResolvedEnv:
    return ResolvedEnv("req.txt", "requirements", Platform(python, machine, "2.36"),
                       (Wheel("a", "1", "a-1-py3-none-any.whl", "0" * 64, 10),), ())


def test_platform_refusals_name_both_and_the_fix() -> None:
    ok = {"python": "3.11", "machine": "x86_64"}
    assert platform_problem("n1", resolved(), ok) is None
    p = platform_problem("n1", resolved(), {**ok, "python": "3.10"})
    assert p is not None and p.who == "n1" and p.code == "venvs.python-differs"
    assert p.fields == {"have": "3.10", "source": "req.txt", "want": "3.11"}
    p = platform_problem("n1", resolved(), {**ok, "machine": "aarch64"})
    assert p is not None and p.code == "venvs.machine-differs"
    assert p.fields == {"have": "aarch64", "want": "x86_64"}


def test_digest_depends_on_platform_and_pins() -> None:
    assert resolved().digest == resolved().digest
    assert resolved().digest != resolved(python="3.12").digest
    other = ResolvedEnv("req.txt", "requirements", resolved().platform,
                        (Wheel("a", "2", "a-2-py3-none-any.whl", "1" * 64, 10),), ())
    assert other.digest != resolved().digest
    assert ResolvedEnv.from_json(other.to_json()) == other


def test_failed_nodes_in_one_message() -> None:
    result = ShipResult({"n1": NodeEnv("n1", "built"),
                         "n2": NodeEnv("n2", "failed", problem=Problem("n2", "disk full", "free"))},
                        {})
    assert not result.ok and list(result.failed) == ["n2"]
    err = EnvironmentFailed([n.problem for n in result.failed.values() if n.problem])
    assert err.problems == [result.failed["n2"].problem] and err.exit_code == 1
    assert (err.code, err.problem.fields) == ("venvs.not-ready", {
        "hosts": "n2", "said": "n2: disk full. Fix: free"})  # (each node's, as it says it)


@pytest.mark.parametrize(("python", "kept"), [
    ("{root}/envs/" + "a" * 64 + "/bin/python", True),
    ("/usr/bin/python3", False),
    ("{root}/envs/short/bin/python", False),
    ("auto", False),
])
def test_env_use_record(python: str, kept: bool, tmp_path) -> None:
    root = tmp_path / ".ptcluster"
    (root / "uses").mkdir(parents=True)
    path = mark_env_use(python.format(root=root), "j")
    assert path == (str(root / "uses" / "j.json") if kept else "")
    if kept:
        got = json.loads((root / "uses" / "j.json").read_text())
        assert got == {"pid": os.getpid(), "job_id": "j", "digest": "a" * 64}
    assert sorted(p.name for p in (root / "uses").iterdir()) == (["j.json"] if kept else [])


def test_progress_not_on_a_terminal_is_one_line_per_node() -> None:
    import io

    from ptcluster.cli.console import terminal
    from ptcluster.cli.venvs_cmd import ProgressLine
    from ptcluster.venvs.ship import BUILDING, SENDING, Progress

    out = io.StringIO()
    shown = ProgressLine(terminal(file=out, width=200), ["n1", "n2"])
    for p in (Progress("n1", SENDING, "missing: 2 of 2 wheels to send", 0, 10),
              Progress("n2", "up to date", "environment up to date", final=True),
              Progress("n1", SENDING, "5 of 10 sent", 5, 10),
              Progress("n1", BUILDING, "2 wheels sent; building", 10, 10),
              Progress("n1", "built", "2 wheels (0.0 MB) sent; environment built in 1.0 s", 10,
                       10, final=True)):
        shown(p)
    assert out.getvalue().splitlines() == [
        "ptcluster: environment: n2: environment up to date",
        "ptcluster: environment: n1: 2 wheels (0.0 MB) sent; environment built in 1.0 s"]
    assert shown.states == {"n1": "built", "n2": "up to date"}


def test_an_unchanged_environment_is_expected_from_what_the_head_remembers(tmp_path) -> None:
    """``run``'s launch without asking: every node remembered with the digest wanted now is
    given it (ranks on its python, the guard told to check it); one node unknown, or known
    without that digest (a changed lock), and the head asks every node first (None)."""
    from ptcluster.cluster.load import load_cluster_file
    from ptcluster.launch.api import prepare
    from ptcluster.launch.options import RunOptions
    from ptcluster.launch.plan import Target
    from ptcluster.venvs.known import KnownNodes
    from ptcluster.venvs.runenv import GUARD, Environment, expect, with_environment

    (tmp_path / "c.yaml").write_text("nodes: [{host: a}, {host: b}]\npython: /opt/py/bin/python\n")
    spec = load_cluster_file(tmp_path / "c.yaml")
    known = KnownNodes(tmp_path / "known")
    want, other = resolved(), resolved(python="3.12")
    facts = {"python": "3.11", "machine": "x86_64", "glibc": "2.36", "torch": "2.13.0+cpu",
             "free": 1}
    assert expect(spec, lambda p: want, known) is None  # nothing remembered: ask first
    known.put(spec.nodes[0], "~/.ptcluster", facts, want.digest)
    known.put(spec.nodes[1], "~/.ptcluster", facts, other.digest)
    assert expect(spec, lambda p: want, known) is None  # b never had it
    known.put(spec.nodes[1], "~/.ptcluster", facts, want.digest)
    assert known.get(spec.nodes[1], "~/.ptcluster").digests == (want.digest, other.digest)
    assert expect(spec, lambda p: want, known, root="/elsewhere") is None  # another root
    got = expect(spec, lambda p: want, known)
    assert got is not None and set(got.nodes) == {"a", "b"} and got.envs == {want.digest: want}
    used = with_environment(spec, got)
    python = f"~/.ptcluster/envs/{want.digest}/bin/python"
    assert [(n.python, n.rank_python) for n in used.nodes] == [("/opt/py/bin/python", python)] * 2
    assert Environment(used, got, "req.txt").expected
    assert Environment(used, got, "req.txt").to_json()["nodes"]["a"]["checked_by"] == GUARD
    plan = prepare(used, Target(script="train.py"))
    cfg = plan.nodes[1].guard_config(plan, RunOptions())
    assert cfg["environment"] == {"digest": want.digest, "root": "~/.ptcluster",
                                  "torch": "2.13.0+cpu"}  # (the guard checks it is still so)
    assert plan.nodes[1].python == "/opt/py/bin/python"  # the guard's: the environment's base
    assert cfg["argv"][0] == python and cfg["argv"][cfg["argv"].index("--no-python") + 1] == python


def test_the_guard_refuses_a_missing_or_incomplete_environment_by_name(tmp_path) -> None:
    """Before anything is leased: a missing environment, or one without the manifest its build
    writes last (a folder that is not a complete build), is ``error {environment}``; a
    complete one gives its site-packages (where ``-m`` modules are looked for too)."""
    from ptcluster.node.guard.prechecks import project_environment
    from ptcluster.node.guard.refusal import GuardError
    from ptcluster.node.venv_store import MANIFEST

    digest = "d" * 64
    cfg = {"environment": {"digest": digest, "root": str(tmp_path)}}
    assert project_environment({}) == ""
    with pytest.raises(GuardError) as refused:
        project_environment(cfg)
    assert refused.value.environment == "missing" and digest[:12] in refused.value.problem
    site = tmp_path / "envs" / digest / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    with pytest.raises(GuardError) as refused:
        project_environment(cfg)
    assert refused.value.environment == "changed" and MANIFEST in refused.value.problem
    manifest = tmp_path / "envs" / digest / MANIFEST
    manifest.write_text(json.dumps({"files": {}, "resolved": {"platform": {"python": "2.7"}}}))
    with pytest.raises(GuardError) as refused:  # (this node's python: changed since)
        project_environment(cfg)
    assert refused.value.environment == "changed"
    assert refused.value.code == "guard.environment-not-ready"
    assert refused.value.fields["state"] == "changed" and "2.7" in refused.value.fields["why"]
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    manifest.write_text(json.dumps({"files": {}, "resolved": {"platform": {"python": here}}}))
    assert project_environment(cfg) == str(site)
    assert (tmp_path / "envs" / f".used-{digest}").exists()  # its last use, for --prune
    # launched without asking: the torch the head checked the lock against must still be the
    # node's (setup may have changed it since): else changed, and the head ships (and checks)
    with pytest.raises(GuardError) as refused:
        project_environment({"environment": {**cfg["environment"], "torch": "0.0.1"}})
    assert refused.value.environment == "changed" and "torch 0.0.1" in refused.value.problem
    from ptcluster.node.guard.prechecks import versions
    same = versions().get("torch", "")
    assert project_environment({"environment": {**cfg["environment"], "torch": same}}) == \
        str(site)

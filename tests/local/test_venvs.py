"""The project's environment on local "nodes" (each its own ptcluster directory): the real node
program over real channels, real uv (or pip), real wheels the tests make."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ptcluster.cluster.load import local_cluster
from ptcluster.launch.api import prepare
from ptcluster.launch.plan import Target
from ptcluster.launch.runner import Runner
from ptcluster.remote.connect import transports
from ptcluster.remote.group import Member
from ptcluster.remote.transport import LocalTransport
from ptcluster.venvs import nodes
from ptcluster.venvs.resolved import ResolvedEnv, Wheel
from ptcluster.venvs.runenv import use_environment
from ptcluster.venvs.ship import BUILT, FAILED, REBUILT, SENDING, UP_TO_DATE, Progress, ship
from tests.support.wheels import make_wheel, resolved, uv_wheel, wheel_of

UV = uv_wheel()


class Wheels:
    """A folder of wheels made for a test, and the locate function the head's store would be."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.paths: dict[str, Path] = {}
        if UV is not None:
            self.paths[wheel_of(UV, "uv", UV.name.split("-")[1]).sha256] = UV

    def make(self, name: str, version: str, **kw: object) -> Wheel:
        path = make_wheel(self.folder, name, version, **kw)  # type: ignore[arg-type]
        wheel = wheel_of(path, name, version)
        self.paths[wheel.sha256] = path
        return wheel

    def env(self, *wheels: Wheel, uv: bool = True) -> ResolvedEnv:
        return resolved({w: self.paths[w.sha256] for w in wheels}, UV if uv else None)

    def locate(self, wheel: Wheel) -> Path:
        return self.paths[wheel.sha256]


def local_nodes(tmp: Path, *hosts: str) -> list[Member]:
    return [Member(h, LocalTransport(h), sys.executable, {"root": str(tmp / f"root-{h}")})
            for h in hosts]


def in_env(python: str, code: str) -> str:
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                          timeout=60, cwd="/").stdout.strip()


@pytest.fixture
def wheels(tmp_path: Path) -> Wheels:
    (tmp_path / "wheels").mkdir()
    return Wheels(tmp_path / "wheels")


@pytest.mark.skipif(UV is None, reason="no uv wheel at hand (PTC_UV_WHEEL)")
def test_built_then_noop_then_one_package_then_changed_file_rebuilt(tmp_path, wheels) -> None:
    a, b = wheels.make("tinya", "1.0"), wheels.make("tinyb", "2.0")
    env = wheels.env(a, b)
    members = local_nodes(tmp_path, "n1", "n2")
    said: list[Progress] = []
    first = ship(members, lambda p: env, wheels.locate, on_event=said.append)
    assert first.ok, first.failed
    assert {n.state for n in first.nodes.values()} == {BUILT}
    everything = sum(w.size for w in (*env.wheels, *env.tools))
    assert first.bytes_sent == 2 * everything  # each wheel to each node once
    python = first.nodes["n1"].python
    assert python == str(tmp_path / "root-n1" / "envs" / env.digest / "bin" / "python")
    # the project's packages first, setup's (here the test's venv: torch, ptcluster) beneath
    got = in_env(python, "import sys, tinya, tinyb, ptcluster; print(tinya.VERSION, "
                 "tinyb.VERSION, sys.executable, sys.path.index(tinya.__path__[0].rsplit('/', 1)"
                 "[0]) < sys.path.index(ptcluster.__path__[0].rsplit('/', 1)[0]))")
    assert got.split() == ["1.0", "2.0", python, "True"]
    assert not list((tmp_path / "root-n1" / "envs").glob(".build-*"))
    # uv hard-links from a cache of the build's own, removed after: no file is shared (a file
    # changed by hand, below, changes nothing another build would take)
    installed = Path(python).parents[1] / "lib"
    assert {f.stat().st_nlink for f in installed.glob("python*/site-packages/tiny*/*")} == {1}
    # each node: its wheels on their way, then built: one final event each
    assert [(p.host, p.state) for p in said if p.final] in (
        [("n1", BUILT), ("n2", BUILT)], [("n2", BUILT), ("n1", BUILT)])
    n2 = [p for p in said if p.host == "n2"]
    assert n2[0].state == SENDING and n2[0].total == everything and n2[-1].final
    assert "built in" in n2[-1].text and n2[-1].sent == everything

    second = ship(members, lambda p: env, wheels.locate)
    assert {n.state for n in second.nodes.values()} == {UP_TO_DATE} and second.bytes_sent == 0

    b2 = wheels.make("tinyb", "2.1")
    newer = wheels.env(a, b2)
    third = ship(members, lambda p: newer, wheels.locate)
    assert third.ok and {n.wheels_sent for n in third.nodes.values()} == {1}
    assert third.bytes_sent == 2 * b2.size  # the changed package and nothing else
    assert in_env(str(third.nodes["n2"].python), "import tinyb; print(tinyb.VERSION)") == "2.1"

    site = Path(python).parents[1] / "lib"
    (init,) = site.glob("python*/site-packages/tinya/__init__.py")
    init.write_text('VERSION = "hacked"\n')
    checked = nodes.check(members, lambda p: env)
    (found,) = checked["n1"].answer["findings"]  # the file, its package and both hashes
    assert found["code"] == "venvs.file-changed" and found["fields"]["owner"] == "tinya 1.0"
    assert found["fields"]["path"].endswith("site-packages/tinya/__init__.py"), found
    assert found["fields"]["was"] != found["fields"]["now"]
    assert checked["n2"].answer["findings"] == []
    fourth = ship(members, lambda p: env, wheels.locate)
    assert fourth.nodes["n1"].state == REBUILT and "tinya/__init__.py" in fourth.nodes["n1"].why
    assert fourth.nodes["n2"].state == UP_TO_DATE and fourth.bytes_sent == 0
    assert in_env(python, "import tinya; print(tinya.VERSION)") == "1.0"


def test_pip_where_no_uv_came_and_a_version_mismatch_found(tmp_path, wheels) -> None:
    a = wheels.make("tinya", "1.0")
    env = wheels.env(a, uv=False)
    (node,) = local_nodes(tmp_path, "n1")
    got = ship([node], lambda p: env, wheels.locate)
    assert got.ok, got.failed
    assert in_env(str(got.nodes["n1"].python), "import tinya; print(tinya.VERSION)") == "1.0"
    other = wheels.env(wheels.make("tinya", "1.1"), uv=False)
    env_dir = Path(str(got.nodes["n1"].python)).parents[1]
    # the lock says 1.1 where 1.0 is installed: the check names the package and both versions
    (env_dir.parent / other.digest).symlink_to(env_dir)
    found = nodes.check([node], lambda p: other)["n1"].answer["findings"]
    assert [(f["code"], f["fields"]) for f in found] == [("venvs.package-differs", {
        "name": "tinya", "have": "1.0", "version": "1.1",
        "env": str(env_dir.parent / other.digest)})], found


def test_a_request_the_node_fails_on_is_answered_as_a_problem(tmp_path) -> None:
    """The agent answers a request it fails on in one line, in the shape the head reads a
    node's problem in (``Problem.received``): a check never passes for want of findings."""
    from ptcluster.errors import Problem
    from ptcluster.node.wire import Kind

    (node,) = local_nodes(tmp_path, "n1")
    answer = nodes.ask([node], Kind.CHECK, lambda host, platform: {})["n1"].answer  # no digest
    assert answer["ok"] is False and "findings" not in answer, answer
    assert Problem.received("n1", answer) == Problem("n1", "KeyError: 'digest'", "report this bug")


def test_damaged_wheel_refused_partial_removed_other_node_kept(tmp_path, wheels) -> None:
    a = wheels.make("tinya", "1.0")
    env = wheels.env(a, uv=False)
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"x" * a.size)
    members = local_nodes(tmp_path, "n1")
    got = ship(members, lambda p: env, lambda w: bad)
    problem = got.nodes["n1"].problem
    assert got.nodes["n1"].state == FAILED and problem is not None
    assert problem.who == "n1" and problem.code == "file.damaged", problem
    got_sha = hashlib.sha256(bad.read_bytes()).hexdigest()
    assert problem.fields == {"name": a.sha256, "got": got_sha[:12], "want": a.sha256[:12]}
    store = tmp_path / "root-n1" / "store" / "sha256"
    assert list(store.iterdir()) == [] and not list((tmp_path / "root-n1" / "envs").glob(
        ".build-*"))


def test_wrong_python_refused_before_a_byte(tmp_path, wheels) -> None:
    a = wheels.make("tinya", "1.0")
    env = resolved({a: wheels.locate(a)}, None, python="3.2")
    got = ship(local_nodes(tmp_path, "n1"), lambda p: env, wheels.locate)
    problem = got.nodes["n1"].problem
    assert problem is not None and problem.code == "venvs.python-differs"
    assert problem.fields["want"] == "3.2"
    assert got.bytes_sent == 0


def test_prune_keeps_the_one_in_use(tmp_path, wheels) -> None:
    members = local_nodes(tmp_path, "n1")
    envs = [wheels.env(wheels.make("tinya", v), uv=False) for v in ("1.0", "2.0")]
    for env in envs:
        assert ship(members, lambda p, e=env: e, wheels.locate).ok
    uses = tmp_path / "root-n1" / "uses"
    older = envs[0].digest  # used by a "job" whose pid lives (this test's)
    (uses / "job1.json").write_text(json.dumps({"pid": os.getpid(), "job_id": "job1",
                                                "digest": older}))
    listed = nodes.listing(members)["n1"].answer["envs"]
    assert [e["digest"] for e in listed] == [envs[1].digest, older]
    assert listed[1]["in_use"] == ["job1"] and listed[0]["in_use"] == []
    pruned = nodes.prune(members, keep=0, max_bytes=0, grace=0)["n1"].answer
    assert [(e["digest"], e["why"]) for e in pruned["kept"]] == [(older, "in use by job1")]
    assert [e["digest"] for e in pruned["removed"]] == [envs[1].digest]
    assert sorted(p.name for p in (tmp_path / "root-n1" / "envs").iterdir()
                  if not p.name.startswith(".")) == [older]
    assert pruned["wheels_removed"] == 1


@pytest.mark.slow
def test_run_ranks_in_the_environment(tmp_path, wheels, no_leftovers) -> None:
    env = wheels.env(wheels.make("tinya", "3.0"), uv=UV is not None)
    spec = local_cluster(2)
    home = tmp_path / "home"
    root = str(home / ".ptcluster")
    used = use_environment(spec, lambda p: env, wheels.locate, source="requirements.txt",
                           root=root)
    python = str(Path(root) / "envs" / env.digest / "bin" / "python")
    assert [n.rank_python for n in used.spec.nodes] == [python]
    script = tmp_path / "job.py"
    out = tmp_path / "out"
    out.mkdir()
    script.write_text("import os, sys, tinya, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      f"open(os.path.join({str(out)!r}, os.environ['RANK']), 'w').write("
                      "tinya.VERSION + ' ' + sys.executable)\n"
                      "dist.destroy_process_group()\n")
    plan = prepare(used.spec, Target(script=str(script)))
    no_leftovers.append(plan.job_id)
    result = Runner(plan, transports(used.spec), tmp_path / "run",
                    environment=used.to_json()).run()
    assert result.ok, result.failures
    assert {(out / r).read_text() for r in ("0", "1")} == {f"3.0 {python}"}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["environment"]["digest"] == env.digest
    assert ResolvedEnv.from_json(summary["environment"]["resolved"][env.digest]) == env
    assert summary["environment"]["python"] == {"0": python, "1": python}
    time.sleep(0.2)  # (the guard's use record is gone with it)
    assert list((Path(root) / "uses").iterdir()) == []


def test_two_jobs_build_one_digest_at_once(tmp_path, wheels) -> None:
    import threading

    env = wheels.env(wheels.make("tinya", "1.0"), uv=False)
    members = local_nodes(tmp_path, "n1")
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(
        ship(members, lambda p: env, wheels.locate))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    states = sorted(r.nodes["n1"].state for r in got)  # type: ignore[attr-defined]
    # one built it; the other waited on its lock and found it done (or found it at `have`)
    assert states == [BUILT, UP_TO_DATE], states
    assert [p.name for p in (tmp_path / "root-n1" / "envs").iterdir()
            if not p.name.startswith(".")] == [env.digest]


SLOW_UV = """#!/bin/sh
# a stand-in for uv whose `venv` step never ends: the build is stopped in the middle
for last; do :; done
mkdir -p "$last/bin"
echo $$ > "$last/pid"
exec sleep 300
"""


def test_head_gone_mid_build_partial_removed_no_process_left(tmp_path, wheels) -> None:
    from ptcluster.node import VENVS
    from ptcluster.node.wire import Kind
    from ptcluster.remote.group import Group
    from ptcluster.venvs.ship import node_record
    from tests.support.wheels import slow_tool_wheel

    tool = slow_tool_wheel(wheels.folder, SLOW_UV)
    wheels.paths[tool.sha256] = wheels.folder / tool.filename
    a = wheels.make("tinya", "1.0")
    env = ResolvedEnv("requirements.txt", "requirements", resolved({}, None).platform, (a,),
                      (tool,))
    members = local_nodes(tmp_path, "n1")
    group = Group(members, VENVS, answer=Kind.BUILD)
    envs = tmp_path / "root-n1" / "envs"
    try:
        for w in (a, tool):
            group.send("n1", Kind.BLOB, {"sha256": w.sha256, "size": w.size})
            group.channels["n1"].send_raw(wheels.locate(w).read_bytes())
        group.send("n1", Kind.BUILD, {"digest": env.digest, "resolved": node_record(env)})
        deadline = time.monotonic() + 30
        while not list(envs.glob(".build-*/pid")) and time.monotonic() < deadline:
            time.sleep(0.05)
        (pid_file,) = envs.glob(".build-*/pid")
        pid = int(pid_file.read_text())
    finally:
        group.close()  # EOF without bye: the head is gone (Ctrl-C)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (list(envs.glob(".build-*")) or _alive(pid)):
        time.sleep(0.05)
    assert not list(envs.glob(".build-*")) and not (envs / env.digest).exists()
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_venvs_command_lists_and_prunes(tmp_path, wheels) -> None:
    from tests.support.head import run_head

    home = tmp_path / "home"
    home.mkdir()
    root = home / ".ptcluster"  # the default root, in this test's own home
    member = Member("localhost", LocalTransport(), sys.executable, {"root": str(root)})
    envs = [wheels.env(wheels.make("tinya", v), uv=False) for v in ("1.0", "2.0")]
    for env in envs:
        assert ship([member], lambda p, e=env: e, wheels.locate).ok
    code, head = run_head(["venvs", "--json"], cwd=tmp_path, env={"HOME": str(home)},
                          timeout=60)
    assert code == 0, head.output()
    listed = json.loads("\n".join(head.lines))["localhost"]["envs"]
    assert [e["digest"] for e in listed] == [envs[1].digest, envs[0].digest]
    assert listed[0]["source"] == "requirements.txt" and listed[0]["packages"] == 1
    code, head = run_head(["venvs", "--prune", "--keep", "1"], cwd=tmp_path,
                          env={"HOME": str(home)}, timeout=60)
    assert code == 0, head.output()  # both were given to a job moments ago: kept
    assert f"localhost: kept {envs[0].digest[:12]}: given to a job moments ago" in head.output()
    for env in envs:  # an hour later
        used = root / "envs" / f".used-{env.digest}"
        os.utime(used, (used.stat().st_mtime - 3600 - (env is envs[0]),) * 2)
    code, head = run_head(["venvs", "--prune", "--keep", "1"], cwd=tmp_path,
                          env={"HOME": str(home)}, timeout=60)
    assert code == 0, head.output()
    assert f"localhost: removed {envs[0].digest[:12]}" in head.output()
    assert f"localhost: kept {envs[1].digest[:12]}: among the 1 most recently used" \
        in head.output()
    assert not (root / "envs" / envs[0].digest).exists()


def test_changed_under_a_running_job_refused_not_removed(tmp_path, wheels) -> None:
    env = wheels.env(wheels.make("tinya", "1.0"), uv=False)
    members = local_nodes(tmp_path, "n1")
    first = ship(members, lambda p: env, wheels.locate)
    python = Path(str(first.nodes["n1"].python))
    (tmp_path / "root-n1" / "uses" / "job7.json").write_text(json.dumps(
        {"pid": os.getpid(), "job_id": "job7", "digest": env.digest}))
    (init,) = python.parents[1].glob("lib/python*/site-packages/tinya/__init__.py")
    init.write_text('VERSION = "by hand"\n')
    again = ship(members, lambda p: env, wheels.locate)
    problem = again.nodes["n1"].problem
    assert problem is not None and problem.code == "venvs.changed-in-use", again.nodes
    assert problem.fields["users"] == "job job7" and "tinya/__init__.py" in problem.fields["why"]
    assert init.read_text() == 'VERSION = "by hand"\n'  # the running job's files stay


def test_a_node_that_cannot_start_is_named_the_other_built(tmp_path, wheels) -> None:
    env = wheels.env(wheels.make("tinya", "1.0"), uv=False)
    good, bad = local_nodes(tmp_path, "n1", "n2")
    bad = Member("n2", LocalTransport("n2"), str(tmp_path / "no-python"), bad.config)
    got = ship([good, bad], lambda p: env, wheels.locate)
    assert got.nodes["n1"].state == BUILT
    problem = got.nodes["n2"].problem
    assert got.nodes["n2"].state == FAILED and problem is not None and problem.who == "n2"
    assert "no-python" in problem.what, problem


@pytest.mark.slow
def test_cli_run_doctor_env_venvs_end_to_end(tmp_path, no_leftovers) -> None:
    """The user's path, through the installed command: a project whose requirements.txt names a
    package no environment here has, wheels in a folder (a head without registry access), and a
    HOME of its own (the head's store and the node's environments both under it). The ranks
    import it from the environment `env` names; the second run sends nothing; doctor checks it,
    `venvs` lists it; a file that is none of the four kinds is exit 2 before any node."""
    from tests.support.wheelmaker import make_wheel as make_named
    project, home = tmp_path / "proj", tmp_path / "home"
    (project / "wheels").mkdir(parents=True)
    home.mkdir()
    make_named(project / "wheels", "tinypkg", "1.0")
    (project / "requirements.txt").write_text("tinypkg==1.0\n")
    (project / "train.py").write_text(
        "import os, sys, tinypkg\nprint('RANKSAYS', os.environ['RANK'], tinypkg.VERSION, "
        "sys.executable)\n")
    command = str(Path(sys.executable).with_name("ptcluster"))
    env = {**os.environ, "HOME": str(home)}
    flags = ["--requirements", "requirements.txt", "--find-links", "wheels"]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([command, *args], cwd=project, env=env, capture_output=True,
                              text=True, timeout=300)

    shown = cli("env", "--nproc", "2", *flags)
    assert shown.returncode == 0, shown.stderr
    digest = next(w for w in shown.stdout.split() if w.startswith(str(home))
                  or "/envs/" in w).split("/envs/")[1].split("/")[0]
    first = cli("run", "--nproc", "2", *flags, "train.py")
    assert first.returncode == 0, first.stderr + first.stdout
    says = sorted(line.split("RANKSAYS ")[1] for line in first.stdout.splitlines()
                  if "RANKSAYS" in line)
    python = str(home / ".ptcluster" / "envs" / digest / "bin" / "python")
    assert says == [f"0 1.0 {python}", f"1 1.0 {python}"]
    assert "sent" in first.stderr
    second = cli("run", "--nproc", "2", *flags, "train.py")
    assert second.returncode == 0
    assert "up to date" in second.stderr and "sent" not in second.stderr
    summary = json.loads(next((project / "ptcluster-runs").glob("*/summary.json")).read_text())
    assert summary["environment"]["digest"] == digest
    assert summary["environment"]["python"] == {"0": python, "1": python}
    doctor = cli("doctor", "--nproc", "2", "--skip-allreduce", "--json", *flags)
    checks = {c["check"]: c["status"] for c in json.loads(doctor.stdout)["findings"]}
    assert checks.get("environment") == "ok", doctor.stdout
    listed = cli("venvs", "--json")
    assert listed.returncode == 0 and digest in listed.stdout
    (project / "deps.cfg").write_text("tinypkg\n")
    bad = cli("run", "--nproc", "2", "--requirements", "deps.cfg", "train.py")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert not (home / ".ptcluster" / "envs").joinpath("deps").exists()


def test_a_lock_pinning_another_torch_is_refused_before_a_byte(tmp_path, cli,
                                                                monkeypatch) -> None:
    """A requirements file that pins a torch the nodes do not have (here, with --find-links,
    where uv's resolution leaves torch out) is exit 2 naming both versions, before any wheel is
    sent or environment made; the nodes' own torch pinned is fine."""
    import importlib.metadata

    from tests.support.wheelmaker import make_wheel as make_named
    project, home = tmp_path / "proj", tmp_path / "home"
    (project / "wheels").mkdir(parents=True)
    home.mkdir()
    make_named(project / "wheels", "tinypkg", "1.0")
    (project / "train.py").write_text("import tinypkg\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(project)
    have = importlib.metadata.version("torch")
    (project / "requirements.txt").write_text("tinypkg\ntorch==1.13.1 ; python_version > '3'\n")
    code, _, err = cli("run", "--nproc", "1", "--requirements", "requirements.txt",
                       "--find-links", "wheels", "train.py")
    assert code == 2 and cli.problem.code == "venvs.torch-differs", err
    assert cli.problem.fields == {"version": "1.13.1", "node_torch": have,
                                  "node_release": have.split("+")[0]}
    assert "Traceback" not in err
    assert not (home / ".ptcluster" / "store").exists() or \
        not any((home / ".ptcluster" / "store").rglob("*.whl"))
    assert not (home / ".ptcluster" / "envs").exists() or \
        not [p for p in (home / ".ptcluster" / "envs").iterdir() if not p.name.startswith(".")]
    (project / "requirements.txt").write_text(f"tinypkg\ntorch=={have.split('+')[0]}\n")
    command = str(Path(sys.executable).with_name("ptcluster"))  # (the installed command)
    env = {**os.environ, "HOME": str(home)}
    ok = subprocess.run([command, "run", "--nproc", "1", "--requirements", "requirements.txt",
                         "--find-links", "wheels", "train.py"], cwd=project, env=env,
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr


@pytest.mark.slow
def test_prune_keeps_an_environment_a_warm_pool_forks_from(tmp_path, wheels, no_leftovers,
                                                           monkeypatch) -> None:
    """A warm pool (``run --warm``) whose interpreter is an environment's: prune keeps that
    environment while the pool lives (its next ranks would import from it), and says why."""
    from ptcluster.launch.options import RunOptions
    from ptcluster.node.warm import pools

    runtime = tempfile.mkdtemp(prefix="pr", dir="/tmp")  # (its pools' folder; a short path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    env = wheels.env(wheels.make("tinya", "4.0"), uv=UV is not None)
    root = str(tmp_path / "home" / ".ptcluster")
    used = use_environment(local_cluster(1), lambda p: env, wheels.locate,
                           source="requirements.txt", root=root)
    script = tmp_path / "job.py"
    script.write_text("import tinya\nprint(tinya.VERSION)\n")
    plan = prepare(used.spec, Target(script=str(script)))
    no_leftovers.append(plan.job_id)
    try:
        result = Runner(plan, transports(used.spec), tmp_path / "run",
                        options=RunOptions(warm=60.0), environment=used.to_json()).run()
        assert result.ok, result.failures
        (pool,) = pools.listed()
        assert pool["python"] == str(Path(root) / "envs" / env.digest / "bin" / "python")
        member = Member("localhost", LocalTransport("localhost"), sys.executable,
                        {"root": root})
        pruned = nodes.prune([member], keep=0, max_bytes=0, grace=0)["localhost"].answer
        assert [(e["digest"], e["why"]) for e in pruned["kept"]] == [
            (env.digest, f"in use by warm pool {pool['pid']}")]
        assert pruned["removed"] == []
    finally:
        pools.stop()
        left = pools.listed()
        shutil.rmtree(runtime, ignore_errors=True)
    assert left == []
    pruned = nodes.prune([member], keep=0, max_bytes=0, grace=0)["localhost"].answer
    assert [e["digest"] for e in pruned["removed"]] == [env.digest]

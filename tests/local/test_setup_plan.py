"""setup's pure parts: the torch resolver, the per-node plan, the /etc/hosts block; the password
file rule and the askpass channel; the wheel of ptcluster itself; what sync copies."""

from __future__ import annotations

import copy
import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ptcluster.errors import UsageError
from ptcluster.node.guard.prechecks import node_python
from ptcluster.remote.sync import project_files, remote_dir, tar_pipe
from ptcluster.remote.transport import remote_command
from ptcluster.setup import plan as P
from ptcluster.setup import steps as S
from ptcluster.setup.secret import Askpass, Secret, read_password_file
from ptcluster.setup.torch_choice import GpuNode, choose_torch
from ptcluster.setup.wheels import build_self_wheel

# -- torch resolver -----------------------------------------------------------------------------
CPU = GpuNode("a", 0)


@pytest.mark.parametrize("nodes, variant, why", [
    ([CPU, GpuNode("b", 0)], "cpu", "no node has an NVIDIA GPU"),
    ([GpuNode("a", 8, "580.65.06", ("9.0",) * 8)], "cu130", "580"),
    ([GpuNode("a", 1, "590.1", ("8.0",)), GpuNode("b", 1, "570.86.15", ("8.9",))], "cu128",
     "570.86.15 (b)"),
    ([GpuNode("a", 1, "525.60.13", ("7.5",))], "cu128", "525.60.13"),
    # one old GPU decides for the whole cluster, whatever the drivers
    ([GpuNode("a", 1, "580.1", ("9.0",)), GpuNode("b", 1, "580.1", ("7.0",))], "cu126",
     "b (sm_70)"),
    ([GpuNode("a", 1, "550.54.14", ("6.1",))], "cu126", "sm_61"),
    # CPU-only nodes next to GPU nodes do not pull the cluster to +cpu
    ([CPU, GpuNode("b", 2, "560.35.03", ("8.6", "8.6"))], "cu128", "560.35.03"),
])
def test_torch_resolver(nodes: list[GpuNode], variant: str, why: str) -> None:
    choice = choose_torch("2.13.0+cpu", nodes)
    assert choice.variant == variant
    assert why in choice.why
    assert choice.requirement == f"torch==2.13.0+{variant}"
    assert choice.index_url == f"https://download.pytorch.org/whl/{variant}"


@pytest.mark.parametrize("nodes, problem", [
    ([GpuNode("a", 1, "520.61.05", ("8.0",))], "older than 525.60.13"),
    ([GpuNode("a", 1, "580.1", ("8.0",)), GpuNode("b", 2, None)], "without an NVIDIA driver on b"),
])
def test_torch_resolver_blocks(nodes: list[GpuNode], problem: str) -> None:
    choice = choose_torch("2.13.0", nodes)
    assert choice.variant is None and choice.problem is not None
    assert problem in choice.problem.what and choice.problem.fix and choice.problem.who is None


def test_torch_backend_override() -> None:
    assert choose_torch("2.13.0", [GpuNode("a", 1, "580.1", ("9.0",))], "cpu").variant == "cpu"
    with pytest.raises(ValueError):
        choose_torch("2.13.0", [], "rocm6")


# -- the plan -----------------------------------------------------------------------------------
CF = S.ClusterFacts(pubkey="ssh-ed25519 AAAAkey head", torch=choose_torch("2.13.0", []),
                    self_version="0.1.0+gabc", python="3.11",
                    addrs={"n0": "10.0.0.1", "n1": "10.0.0.2", "n2": "10.0.0.3"},
                    hostnames={"n0": "node0", "n1": "node1", "n2": "node2"},
                    master_addr="n0", master_port=29500)
FRESH = {  # a fresh Ubuntu node, as node/setup_agent.py reports it
    "user": "u", "uid": 1000, "home": "/home/u", "hostname": "node1", "python": "3.11",
    "sudo": {"mode": "password"}, "key_authorized": False,
    "os": {"ID": "ubuntu", "ID_LIKE": "debian", "PRETTY_NAME": "Ubuntu 24.04"},
    "gpu": {"count": 0, "driver": None, "compute_capability": []},
    "packages": {"python3-venv": False, "python3-dev": True, "build-essential": True,
                 "rsync": True},
    "venv": {"exists": False},
    "firewall": {"kind": "ufw", "active": True, "rules": ["ufw allow 22/tcp"]},
    "hosts": "127.0.0.1 localhost\n127.0.1.1 node1\n",
    "env_file": None, "interface": "eth0", "workdir": {"path": "/home/u/w", "exists": False},
}


def converged(facts: dict, cf: S.ClusterFacts = CF) -> dict:
    """``facts`` after every step of its plan ran."""
    done = copy.deepcopy(facts)
    done["key_authorized"] = True
    done["packages"] = {p: True for p in done["packages"]}
    done["venv"] = {"exists": True, "ok": True, "python": "3.11",
                    "dists": {"torch": "2.13.0+cpu", "ptcluster": "0.1.0+gabc",
                              "scikit_learn": "1.9.1"}}
    done["firewall"]["rules"] += ["ufw allow from 10.0.0.1 proto tcp",
                                  "ufw allow from 10.0.0.3 proto tcp"]
    done["hosts"] = P.hosts_with_block(facts["hosts"], [
        ("10.0.0.1", ["node0", "n0"]), ("10.0.0.2", ["node1", "n1"]),
        ("10.0.0.3", ["node2", "n2"])], facts["hostname"])
    done["env_file"] = P.env_file_text("n1", done, cf)
    done["workdir"]["exists"] = True
    return done


def by_name(steps: list[S.Step]) -> dict[str, S.Step]:
    return {s.name: s for s in steps}


def test_plan_of_a_fresh_node() -> None:
    steps = by_name(P.plan_node("n1", FRESH, CF))
    assert [s for s in P.STEPS if steps[s].status == S.OK] == ["sudo", "os", "gpu driver"]
    assert steps["apt packages"].actions[0].root
    assert "python3-venv" in steps["apt packages"].commands()[0]
    assert "rsync" not in steps["apt packages"].commands()[0]  # installed already
    # the firewall opens TCP to the other nodes' addresses only: not anywhere, not the subnet
    assert steps["firewall"].commands() == ["sudo ufw allow from 10.0.0.1 proto tcp",
                                            "sudo ufw allow from 10.0.0.3 proto tcp"]
    hosts = steps["/etc/hosts"].problem  # issue 12: the 127.0.1.1 trap, its name taken off
    assert hosts is not None and (hosts.code, hosts.fields) == (
        "setup.hosts-trap", {"state": "is missing", "hostname": "node1"})
    assert steps["/etc/hosts"].to_json()["code"] == "setup.hosts-trap"
    torch = steps["torch + ptcluster"].problem
    assert torch is not None and torch.code == "setup.torch-install"
    assert torch.fields["lacks"] == "torch missing, ptcluster missing, scikit-learn missing"
    pip = shlex.split(steps["torch + ptcluster"].commands()[0])
    assert pip[:4] == ["~/.ptcluster/venv/bin/python", "-m", "pip", "install"], pip
    at = pip.index("--no-index")
    assert pip[at:at + 4] == ["--no-index", "--find-links", "~/.ptcluster/wheelhouse",
                              "torch==2.13.0+cpu"], pip


def test_plan_is_the_step_registry_in_order() -> None:
    # plan_node is STEP_DEFS' functions in their order, each planning the step it is declared as
    no_sudo = {**FRESH, "sudo": {"mode": "none"}}
    assert len(set(P.STEPS)) == len(P.STEPS) == 12
    for facts in (FRESH, converged(FRESH), no_sudo):
        steps = P.plan_node("n1", facts, CF)
        assert [s.name for s in steps] == [d.name for d in P.STEP_DEFS] == list(P.STEPS)
        assert [d.plan("n1", facts, CF) for d in P.STEP_DEFS] == steps
        # a step with no facts of its own for apply to re-read only reports: never a change
        assert [d.name for d, s in zip(P.STEP_DEFS, steps, strict=True)
                if not d.sections and s.status == S.CHANGE] == []


def test_plan_is_all_ok_once_converged() -> None:
    steps = P.plan_node("n1", converged(FRESH), CF)
    assert [(s.name, s.status) for s in steps if s.status != S.OK] == []
    assert not P.pending(steps)


def test_the_report_gives_codes_fields_and_counts() -> None:
    """``setup --json``: each step's and each stopped node's code and fields beside the words,
    the changes made and the nodes with a change pending."""
    from ptcluster.setup import problems as R
    from ptcluster.setup.login import NodeFailure
    from ptcluster.setup.report import NodeSetupOutcome, SetupReport

    refused = NodeFailure.of(R.NO_ANSWER, seconds="60", kind="facts").problem
    report = SetupReport({
        "n1": NodeSetupOutcome("n1", before=P.plan_node("n1", FRESH, CF),
                               applied=[("ssh key", "changed", ""), ("os", "skipped", "")]),
        "n2": NodeSetupOutcome("n2", problem=refused)}, [], None, dry_run=False)
    said = report.to_json()
    assert (said["changes"], said["pending"], said["converged"]) == (1, ["n1"], False)
    n1, n2 = said["nodes"]
    plan = {s["step"]: s for s in n1["plan"]}
    assert (plan["workdir"]["code"], plan["workdir"]["fields"]) == (
        "setup.workdir-missing", {"path": "/home/u/w"})
    assert (plan["os"]["code"], plan["os"]["fields"]) == (None, {})  # ok: words only
    assert (n2["code"], n2["fields"]) == ("setup.no-answer", {"seconds": "60", "kind": "facts"})
    assert (n2["problem"], n2["fix"]) == (refused.what, refused.fix)  # the words stay


def test_plan_without_sudo_blocks_root_steps_with_admin_commands() -> None:
    facts = copy.deepcopy(FRESH)
    facts["sudo"] = {"mode": "none", "why": "u is not in the sudoers file"}
    facts["firewall"]["rules"] = None  # cannot be read without root
    steps = by_name(P.plan_node("n1", facts, CF))
    for name in ("sudo", "apt packages", "firewall", "/etc/hosts", "python venv", "wheels",
                 "torch + ptcluster"):
        assert steps[name].status == S.BLOCKED, name
    codes = {n: s.problem.code for n, s in steps.items() if s.problem is not None}
    assert {n: codes[n] for n in ("sudo", "apt packages", "firewall", "python venv", "wheels",
                                  "torch + ptcluster")} == {
        "sudo": "setup.no-sudo", "apt packages": "setup.needs-root",
        "firewall": "setup.firewall-unreadable", "python venv": "setup.venv-needs-packages",
        "wheels": "setup.wheels-no-venv", "torch + ptcluster": "setup.torch-no-venv"}
    fields = {n: s.problem.fields for n, s in steps.items() if s.problem is not None}
    assert fields["sudo"] == {"why": "u is not in the sudoers file"}
    assert fields["apt packages"] == {"why": "missing: python3-venv",
                                      "why_not": "u is not in the sudoers file"}
    # the one rendering: the reason of a blocked step, as the plan shows it
    assert steps["apt packages"].why == ("missing: python3-venv; needs root (u is not in the "
                                         "sudoers file): an admin can run the commands below")
    assert steps["apt packages"].commands()[0].startswith("sudo env DEBIAN_FRONTEND")
    assert steps["firewall"].commands()  # what an admin can run
    # what needs no root still happens
    for name in ("ssh key", "env file", "workdir"):
        assert steps[name].status == S.CHANGE, name


@pytest.mark.parametrize("change, step, status", [
    ({"os": {"ID": "fedora", "ID_LIKE": "rhel", "PRETTY_NAME": "Fedora 40"}}, "os", S.BLOCKED),
    ({"gpu": {"count": 2, "driver": None, "compute_capability": []}}, "gpu driver", S.BLOCKED),
    ({"python": "3.12"}, "python venv", S.BLOCKED),
    ({"firewall": {"kind": None, "active": False, "rules": []}}, "firewall", S.OK),
    ({"firewall": {"kind": "ufw", "active": False, "rules": []}}, "firewall", S.OK),
])
def test_plan_cases(change: dict, step: str, status: str) -> None:
    facts = {**converged(FRESH), **change}
    assert by_name(P.plan_node("n1", facts, CF))[step].status == status


def test_drift_is_a_change_again() -> None:
    facts = converged(FRESH)
    facts["env_file"] = None
    facts["firewall"]["rules"].remove("ufw allow from 10.0.0.3 proto tcp")
    pending = [s for s in P.plan_node("n1", facts, CF) if s.status != S.OK]
    assert [s.name for s in pending] == ["firewall", "env file"]
    assert pending[0].commands() == ["sudo ufw allow from 10.0.0.3 proto tcp"]


def test_wheels_copied_only_when_missing_or_different() -> None:
    facts = converged(FRESH)
    facts["venv"]["dists"]["ptcluster"] = "0.1.0+gold"
    facts["wheelhouse"] = {"torch.whl": "aa", "ptcluster-old.whl": "bb"}
    cf = S.ClusterFacts(**{**CF.__dict__, "manifest": {"torch.whl": "aa", "ptc.whl": "cc"}})
    steps = by_name(P.plan_node("n1", facts, cf))
    assert steps["wheels"].actions[0].argv == ("ptc.whl",)
    assert steps["torch + ptcluster"].status == S.CHANGE


@pytest.mark.parametrize("current, own, expect", [
    # Ubuntu's trap: the own name on 127.0.1.1 goes, localhost stays, the block is appended
    ("127.0.0.1 localhost\n127.0.1.1 node1\n", "node1",
     "127.0.0.1 localhost\n\nBLOCK"),
    # other names on the 127.0.1.1 line stay
    ("127.0.0.1 localhost\n127.0.1.1 node1 node1.lan other\n", "node1",
     "127.0.0.1 localhost\n127.0.1.1 node1.lan other\n\nBLOCK"),
    # an old block is replaced, everything else (comments, other entries) untouched
    (f"# mine\n10.9.9.9 db\n\n{P.HOSTS_BEGIN}\n1.2.3.4 old\n{P.HOSTS_END}\n::1 ip6-lo\n",
     "node1", "# mine\n10.9.9.9 db\n\n::1 ip6-lo\n\nBLOCK"),
])
def test_hosts_block(current: str, own: str, expect: str) -> None:
    entries = [("10.0.0.1", ["node0"]), ("10.0.0.2", ["node1", "n1"])]
    block = f"{P.HOSTS_BEGIN}\n10.0.0.1 node0\n10.0.0.2 node1 n1\n{P.HOSTS_END}\n"
    got = P.hosts_with_block(current, entries, own)
    assert got == expect.replace("BLOCK", block)
    assert P.hosts_with_block(got, entries, own) == got  # idempotent


# -- password -----------------------------------------------------------------------------------
def test_password_file_must_be_private(tmp_path: Path) -> None:
    f = tmp_path / "pw"
    f.write_text("s3cret\nignored\n")
    os.chmod(f, 0o640)
    with pytest.raises(UsageError, match="readable by group or others.*chmod 600"):
        read_password_file(str(f))
    os.chmod(f, 0o600)
    secret = read_password_file(str(f))
    assert secret.reveal() == "s3cret" and "s3cret" not in repr(secret) + str(secret)


def test_askpass_answers_ssh_without_the_secret_in_argv_env_or_files() -> None:
    askpass = Askpass(Secret("pa ss:word"))
    try:
        env = askpass.env()
        assert "pa ss:word" not in "".join(env.values())
        assert "pa ss:word" not in askpass.helper.read_text()
        out = subprocess.run([str(askpass.helper), "user@host's password: "], env=env,
                             capture_output=True, text=True, timeout=10)
        assert out.stdout == "pa ss:word\n"
    finally:
        askpass.close()
    assert not askpass.dir.exists()
    askpass._thread.join(timeout=5)
    assert not askpass._thread.is_alive()  # close() ended the thread that answers


# -- python: auto, ptcluster's own wheel, sync -------------------------------------------------
def test_auto_python_prefers_setups_venv_then_the_heads_path() -> None:
    cmd = remote_command(["auto", "-u", "-c", "print(1)", "probe"])
    assert cmd.startswith('p=$HOME/.ptcluster/venv/bin/python; [ -x "$p" ] || p=')
    assert sys.executable in cmd and cmd.endswith("exec \"$p\" -u -c 'print(1)' probe")
    argv = node_python(["auto", "-m", "torch.distributed.run", "--no-python", "~/x/python", "-c",
                        "auto"])
    assert argv == [sys.executable, "-m", "torch.distributed.run", "--no-python",
                    os.path.expanduser("~/x/python"), "-c", "auto"]


def test_self_wheel_is_reproducible(tmp_path: Path) -> None:
    a = build_self_wheel(tmp_path / "a")
    b = build_self_wheel(tmp_path / "b")
    assert a.version == b.version and "+g" in a.version
    digest = [hashlib.sha256(w.path.read_bytes()).hexdigest() for w in (a, b)]
    assert digest[0] == digest[1]
    import zipfile

    names = zipfile.ZipFile(a.path).namelist()
    assert "ptcluster/node/setup_agent.py" in names
    assert f"ptcluster-{a.version}.dist-info/METADATA" in names
    # the nodes get ptcluster[digits]: pip installs an extra's requirements only when the
    # wheel says it provides it
    import email

    meta = email.message_from_bytes(
        zipfile.ZipFile(a.path).read(f"ptcluster-{a.version}.dist-info/METADATA"))
    assert "digits" in meta.get_all("Provides-Extra", [])
    assert 'scikit-learn>=1.2; extra == "digits"' in meta.get_all("Requires-Dist", [])


def test_the_wheel_download_says_where_it_comes_from() -> None:
    from ptcluster.setup.wheels import sources

    torch = choose_torch("2.13.0", [], "cpu")
    assert sources(torch, {}) == \
        f"torch's from {torch.index_url} alone, the rest from PyPI (or pip.conf's index)"
    assert sources(torch, {"PIP_INDEX_URL": "https://mirror/simple"}) == \
        f"torch's from {torch.index_url} alone, the rest from https://mirror/simple"
    assert sources(torch, {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/w /v"}) == \
        "no index (PIP_NO_INDEX), /w (PIP_FIND_LINKS), /v (PIP_FIND_LINKS)"


def test_sync_lists_what_git_would_track(tmp_path: Path) -> None:
    from ptcluster.rundir import IGNORE_ALL, runs_parent

    (tmp_path / "sub").mkdir()
    for name in ("a.py", "sub/b.txt", "skip.log", "sub/c.py"):
        (tmp_path / name).write_text(name)
    (tmp_path / ".gitignore").write_text("*.log\n")
    # a runs folder ptcluster makes ignores itself whole (it was copied by every run --sync);
    # one the user made is left as it is
    for made in ("ptcluster-runs", "runs/deeper"):
        os.close(runs_parent(tmp_path / made))
        (tmp_path / made / "job" / "rank0.log").parent.mkdir(0o700)
        (tmp_path / made / "job" / "plan.json").write_text("{}")
    assert (tmp_path / "ptcluster-runs" / ".gitignore").read_text() == IGNORE_ALL
    (tmp_path / "mine").mkdir()
    os.close(runs_parent(tmp_path / "mine"))
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    assert not (tmp_path / "mine" / ".gitignore").exists()
    # not a checkout: the directory less what .gitignore excludes
    assert project_files(tmp_path) == [".gitignore", "a.py", "mine/notes.txt", "sub/b.txt",
                                       "sub/c.py"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "a.py"], check=True)
    (tmp_path / "a.py").write_text("changed")
    files = project_files(tmp_path)
    assert files == [".gitignore", "a.py", "mine/notes.txt", "sub/b.txt", "sub/c.py"]
    assert not any(f.startswith(".git/") for f in files)


def test_sync_tar_with_a_long_listing(tmp_path: Path) -> None:
    # more names than a pipe holds (64 KiB) and more data: tar reads names as it archives, so
    # feeding all the names before anything drains tar's output deadlocks
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "d").mkdir(parents=True)
    dest.mkdir()
    files = [f"d/{'n' * 80}-{i:05d}.py" for i in range(1500)]
    for name in files:
        (src / name).write_text(name)
    listing = "\0".join(files).encode() + b"\0"
    assert len(listing) > 1 << 17
    proc = tar_pipe(src, listing, ["tar", "-C", str(dest), "-xf", "-"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*.py")) == files
    assert (dest / files[-1]).read_text() == files[-1]
    # a receiver that fails: its status, and no tar left behind (tar_pipe waited for it)
    bad = tar_pipe(src, listing, ["sh", "-c", "exit 3"], timeout=60)
    assert bad.returncode == 3


def test_a_failed_sync_is_said_also_under_quiet(cli, tmp_path: Path, monkeypatch) -> None:
    # -q skips status lines, never errors: `run --sync` must not exit 1 without a word
    import socket

    with socket.socket() as s:  # a port on loopback that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"nodes: [{{host: 127.0.0.1}}]\nssh: {{port: {port}, options: "
                       "{BatchMode: 'yes', ConnectTimeout: 5}}\n")
    (tmp_path / "t.py").write_text("print('never')\n")
    monkeypatch.chdir(tmp_path)
    for args in (("-q", "run", "--cluster", str(cluster), "--sync", "t.py"),
                 ("-q", "sync", "--cluster", str(cluster))):
        code, out, err = cli(*args)
        assert code == 1, err
        assert "sync failed on 127.0.0.1" in err and "Fix:" in err
        assert "never" not in out


def test_setup_closes_a_session_it_gave_up_on() -> None:
    # a node whose setup program stopped answering fails with "no answer within..." before its
    # session is kept: its ssh and node program must still be ended with the others
    from ptcluster.cluster import parse_cluster_text
    from ptcluster.remote.transport import LocalTransport
    from ptcluster.setup.apply import Setup
    from ptcluster.setup.options import SetupOptions

    spec = parse_cluster_text("nodes: [{host: n1}]\n", "c.yaml")
    setup = Setup(spec, SetupOptions(dry_run=True), password=lambda: None)
    setup.targets, setup.pubkey = {"n1": ("127.0.0.1", 22)}, ""
    session = setup.open_session(spec.nodes[0], LocalTransport(host="n1"))  # the real node program
    assert session.channel.proc is not None and not session.channel.closed
    setup.close_sessions("bye")
    assert session.channel.closed and session.channel.proc.poll() is not None


def test_the_real_node_programs_facts_pass_the_heads_check() -> None:
    # every reply setup asks for is checked at the ask (remote/replies.py, H1): what the real
    # node program sends here, every section and Slurm's, must pass it whole
    from ptcluster.cluster import parse_cluster_text
    from ptcluster.remote.transport import LocalTransport
    from ptcluster.setup.apply import Setup
    from ptcluster.setup.options import SetupOptions

    spec = parse_cluster_text("nodes: [{host: n1}]\n", "c.yaml")
    setup = Setup(spec, SetupOptions(dry_run=True), password=lambda: None)
    setup.targets, setup.pubkey = {"n1": ("127.0.0.1", 22)}, "ssh-ed25519 AAAAnot-there x"
    session = setup.open_session(spec.nodes[0], LocalTransport(host="n1"))
    try:
        first = session.facts(["sudo"], 60)
        facts = session.facts(["all", "slurm"], 120)
    finally:
        setup.close_sessions("bye")
    assert set(first) == {"user", "uid", "home", "hostname", "python", "python_path", "sudo"}
    assert {"slurm", "gpu", "os", "hosts", "venv", "packages"} <= set(facts)
    assert facts["hostname"] == os.uname()[1]


def test_apply_replans_only_the_step_it_applies(monkeypatch, tmp_path: Path) -> None:
    # before each pending step apply re-reads the facts STEP_DEFS declares for it, then plans
    # that step alone from them (not every step for every step)
    from dataclasses import replace

    from ptcluster.cluster import parse_cluster_text
    from ptcluster.setup.apply import Setup
    from ptcluster.setup.options import SetupOptions

    planned: list[str] = []

    def counted(d: S.StepDef) -> S.StepDef:
        def plan(host: str, facts: dict, cf: S.ClusterFacts) -> S.Step:
            planned.append(d.name)
            return d.plan(host, facts, cf)
        return replace(d, plan=plan)

    defs = tuple(counted(d) for d in P.STEP_DEFS)
    monkeypatch.setattr(P, "STEP_DEFS", defs)
    asked: list[tuple[str, dict]] = []

    class Session:  # the node answers every fact request with "unchanged"
        def facts(self, only: list[str], timeout: float) -> dict:
            asked.append(("facts", {"only": only}))
            return {}

    spec = parse_cluster_text("nodes: [{host: n1}]\n", "c.yaml")
    setup = Setup(spec, SetupOptions(), password=lambda: None)
    setup.cluster, setup.facts["n1"] = CF, FRESH
    setup.use_wheelhouse(tmp_path, {"torch.whl": "aa"})  # the head's, prepared already
    setup.sessions["n1"] = Session()  # type: ignore[assignment]
    setup.outcomes["n1"].before = P.plan_node("n1", FRESH, CF)
    acted: list[S.StepAction] = []
    monkeypatch.setattr(setup, "_act", lambda node, session, a: (acted.append(a), (True, ""))[1])
    planned.clear()
    setup.apply_phase(spec.nodes[0])

    pending = [d for d, s in zip(defs, setup.outcomes["n1"].before, strict=True)
               if s.status != S.OK]
    assert [d.name for d in pending] == [n for n in P.STEPS
                                         if n not in ("sudo", "os", "gpu driver")]
    # one plan per step applied; the wheels twice: again once the manifest is known
    assert planned == [n for d in pending for n in [d.name] * (2 if d.wheelhouse else 1)]
    assert asked == [("facts", {"only": list(d.sections)}) for d in pending]
    assert asked[0] == ("facts", {"only": ["key"]})
    applied = setup.outcomes["n1"].applied
    assert [(n, r) for n, r, _ in applied] == [(d.name, "changed") for d in pending]
    assert acted[3] == S.StepAction(("torch.whl",), kind="copy")  # the wheel the node lacks


@pytest.mark.parametrize("workdir, dest", [("~", "."), ("~/p", "p"), ("/srv/p", "/srv/p")])
def test_sync_remote_dir(workdir: str, dest: str) -> None:
    assert remote_dir(workdir) == dest


# -- usage errors (exit 2, one line) -------------------------------------------------------------
def test_setup_usage_errors(cli, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("nodes: [a, b]\n")
    pw = tmp_path / "pw"
    pw.write_text("x\n")
    os.chmod(pw, 0o644)
    for args, words in [
        (["--password-file", str(pw)], "readable by group or others"),
        (["--password-file", str(tmp_path / "none")], "--password-file"),
        (["--torch-backend", "rocm"], "is not auto, cpu or cuXYZ"),
        (["--node", "c"], "--node c: not in"),
        (["--timeout", "-5"], "--timeout"),
    ]:
        code, out, err = cli("setup", "--cluster", str(cfg), *args)
        assert code == 2, (args, out, err)
        assert words in err and err.count("error:") == 1 and "Traceback" not in err
    code, _, err = cli("setup")  # no cluster file: the local cluster has nothing to set up
    assert code == 2 and cli.problem.code == "cli.setup-without-cluster", err


# -- the node program, run here as a node would run it ------------------------------------------
def test_setup_node_program_facts_and_run(tmp_path: Path) -> None:
    import json

    from ptcluster.node import wire
    from ptcluster.remote.bootstrap import BOOTSTRAP, pack_source, preamble
    from ptcluster.setup.apply import SETUP

    # (what it may import is checked with every shipped program's: test_shipped.py)
    compile(pack_source(SETUP), "setup", "exec")
    config = {"pubkey": "ssh-ed25519 AAAAnot-there x", "venv": str(tmp_path / "venv"),
              "wheelhouse": str(tmp_path), "env_file": str(tmp_path / "env"),
              "packages": ["dpkg", "surely-not-a-package"], "master_addr": "127.0.0.1",
              "workdir": str(tmp_path / "w")}
    (tmp_path / "a.whl").write_bytes(b"wheel")
    requests = b"".join([
        wire.encode("facts", {"only": ["key", "apt", "venv", "wheels", "env", "workdir"]}),
        wire.encode("run", {"id": 1, "argv": ["sh", "-c", "cat; echo done"], "input": "in\n"}),
        wire.encode("bye")])
    proc = subprocess.run([sys.executable, "-u", "-c", BOOTSTRAP, "setup", "-"],
                          input=preamble(SETUP, config) + requests, capture_output=True,
                          timeout=60)
    frames = [wire.split(line) for line in proc.stdout.decode().splitlines()]
    assert [k for k, _ in frames] == ["hello", "facts", "done"], proc.stderr
    facts = json.loads(frames[1][1])
    assert facts["key_authorized"] is False and facts["venv"] == {"exists": False}
    assert facts["packages"] == {"dpkg": True, "surely-not-a-package": False}
    assert facts["wheelhouse"] == {"a.whl": hashlib.sha256(b"wheel").hexdigest()}
    assert facts["workdir"] == {"path": str(tmp_path / "w"), "exists": False}
    assert facts["env_file"] is None and facts["interface"] == "lo"
    assert json.loads(frames[2][1]) == {"id": 1, "rc": 0, "out": "in\ndone\n"}


def test_setup_node_program_starts_nothing_once_stopped() -> None:
    """After the head's stop (or EOF) no command starts, and one started in that moment ends."""
    import time

    from ptcluster.node.facts.setup_facts import Commands

    commands = Commands()
    assert commands.run(["true"]) == (0, "")
    commands.stop()
    t0 = time.monotonic()
    code, out = commands.run(["sleep", "30"])
    assert code == 130 and "not started" in out
    assert time.monotonic() - t0 < 5 and not commands.running


def test_venv_facts_read_without_a_second_interpreter_match_the_interpreters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A venv of the very Python that runs the setup program is read from its files (no second
    interpreter start, ~60 ms of a node's CPU), and says what its own interpreter would."""
    from ptcluster.node.facts import setup_facts as node

    # the interpreter asked inherits this env: a PYTHONPATH (a checkout's src) would show it a
    # ptcluster that the venv's files do not have
    monkeypatch.delenv("PYTHONPATH", raising=False)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = str(venv / "bin" / "python")
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    for name, version in [("torch", "2.13.0+cpu"), ("ptcluster", "0.1.0+gabc"),
                          ("typing_extensions", "4.1")]:
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                       f"Version: {version}\n\nVersion: not this\n")
    (site / "hack.pth").write_text("# a comment\nimport os\n")  # as setuptools' distutils hack
    here = node._venv_here(str(venv), py)
    assert here == node._venv_probe(py) == node._venv(str(venv))
    assert here is not None and here["dists"] == {"torch": "2.13.0+cpu",
                                                  "ptcluster": "0.1.0+gabc", "pip": None,
                                                  "scikit_learn": None}
    # a directory added by a .pth file: only the interpreter can say what it finds there
    extra = tmp_path / "extra"
    (extra / "pip-1.0.dist-info").mkdir(parents=True)
    (extra / "pip-1.0.dist-info" / "METADATA").write_text("Name: pip\nVersion: 1.0\n")
    (site / "extra.pth").write_text(f"{extra}\n")
    assert node._venv_here(str(venv), py) is None
    assert node._venv(str(venv))["dists"]["pip"] == "1.0"
    # another interpreter behind bin/python: asked, and a broken one is said to be broken
    os.unlink(py)
    os.symlink("/bin/false", py)
    assert node._venv_here(str(venv), py) is None
    assert node._venv(str(venv)) == {"exists": True, "ok": False, "why": ""}


@pytest.mark.parametrize("answers, mode, rules, calls", [
    # the right password: ufw's rules are its check, one password check in all
    ([(0, "ufw allow from 10.0.0.2 proto tcp\n")], "password",
     ["ufw allow from 10.0.0.2 proto tcp"], 1),
    # a wrong one: said at once (sudo's refusal costs seconds), ufw never asked without root
    ([(1, "Sorry, try again.\nsudo: 1 incorrect password attempt\n")], "wrong-password",
     None, 1),
    # ufw failed, not sudo: the plain check says sudo works, ufw's failure is the firewall's
    ([(1, "ERROR: problem running\n"), (0, ""), (1, "ERROR: problem running\n")], "password",
     None, 3),
])
def test_the_password_is_checked_once_with_ufws_rules(monkeypatch, answers, mode, rules,
                                                      calls) -> None:
    from ptcluster.node import setup_agent as node
    from ptcluster.node.facts import firewall, setup_facts

    ran: list[list[str]] = []
    replies = iter(answers)

    def run(argv: list[str], *, stdin: str | None = None, timeout: float = 30.0,
            env: dict[str, str] | None = None) -> tuple[int, str]:
        assert argv[:3] == ["sudo", "-n", "true"]
        return 1, "sudo: a password is required\n"

    def sudo(argv: list[str], password: str, *, stdin: str | None = None,
             timeout: float = 30.0, env: dict[str, str] | None = None) -> tuple[int, str]:
        assert password == "pw" and stdin is None  # (at sudo's prompt: Commands.sudo)
        ran.append(argv)
        return next(replies)

    for module in (node, setup_facts):  # (each module imported `run` from setup_facts)
        monkeypatch.setattr(module, "run", run)
    monkeypatch.setattr(setup_facts.COMMANDS, "sudo", sudo)
    for module in (node, firewall):
        monkeypatch.setattr(module, "ufw_enabled", lambda: True)
    monkeypatch.setattr(node.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(node.shutil, "which", lambda name: f"/usr/bin/{name}")
    agent = node.Node({})
    agent.password = "pw"
    facts = agent.facts(["firewall"])
    assert facts["sudo"]["mode"] == mode and facts["firewall"]["rules"] == rules
    assert len(ran) == calls and ran[0] == list(node.UFW_ADDED), ran
    assert not agent.ran


def test_every_fact_section_a_step_asks_for_is_one_fact_of_the_table() -> None:
    """The node's fact functions are keyed by the names the steps use (pyinfra's facts): a step
    that asks for a section the node does not know would re-check nothing before it acts."""
    from ptcluster.node.facts import setup_facts

    asked = {s for d in P.STEP_DEFS for s in d.sections}
    assert asked <= set(setup_facts.SECTIONS), asked - set(setup_facts.SECTIONS)
    assert setup_facts.sections(["pip", "wheels"]) == ["venv", "wheels"]
    assert "wheels" not in setup_facts.sections(None)  # hashing: only when asked by name
    assert setup_facts.sections(["all"]) == setup_facts.sections(None)


def test_one_firewall_model_for_setup_and_the_doctor(monkeypatch) -> None:
    """node/facts/firewall.py: the manager, whether it is on and our rules (as root), and the rule
    counts the doctor adds; without root the rules are None and said why."""
    from ptcluster.node.facts import firewall

    def run(argv: list[str]) -> tuple[int, str]:
        return {"nft": (0, "table inet f {\n chain input {\n  tcp dport 29500 drop\n"
                           "  ip saddr 10.0.0.2 accept\n }\n}\n"),
                "iptables": (0, "-P INPUT ACCEPT\n-A INPUT -j DROP\n"),
                "firewall-cmd": (0, "running\n")}[argv[0]]

    monkeypatch.setattr(firewall.shutil, "which", lambda name: f"/usr/bin/{name}"
                        if name == "firewall-cmd" else None)
    monkeypatch.setattr(firewall.os.path, "exists", lambda path: False)
    assert firewall.firewall_state(run, None) == {"kind": "firewalld", "active": True,
                                                  "rules": None}
    root = firewall.firewall_state(run, lambda argv: (0, "10.0.0.2 10.0.0.3\n"))
    assert root["rules"] == ["10.0.0.2", "10.0.0.3"]
    assert firewall.rule_counts(run) == {"nft_rules": 2, "nft_drop": 1, "iptables_rules": 1}

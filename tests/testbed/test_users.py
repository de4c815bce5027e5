"""A cluster that two people share, for real: bare nodes (each its own /etc/passwd, /home and
/run) with the users alice and bob, each with their own ssh key; each user's jobs reach the
nodes as that user (``ssh: {user: alice}`` in that user's cluster file), so every guard, torchrun
and rank runs under that user's uid on the node, and the kernel, not ptcluster, keeps them apart.

The head runs as root on this machine for both users (this machine has no alice or bob: it stands
for each user's own workstation). What decides "the user" is the node side: the uid the guard
runs as over ssh (lease records, ``ps``'s "mine", the kernel's EPERM for ``kill``); the head's
local identity matters only for its own registry of heads, so each user's heads get their own
(``XDG_STATE_HOME``), as on separate machines. The nodes run one venv (the pinned torch) from a
path every node has, as a team's nodes run one from a shared file system. No node has had
``ptcluster setup``'s root steps beyond /etc/hosts: each /run/lock is as boot makes it (root's,
1777), and nothing else is needed for users' jobs to lease there.

One bed for the module (2 nodes, 2+1 slots): the tests build on nothing but it and each ends
its jobs; every check of "no process left" reads the nodes' own process tables.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import socket
import stat
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ptcluster.node.guard.refusal import UNLEASED_FIX
from tests.support import bare
from tests.support import testbed as tb
from tests.support.bare import BareNode, BareOptions
from tests.support.head import Head, job_id_when_started, run_head

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
USERS = ("alice", "bob")
SLOTS = (2, 1)

JOB = textwrap.dedent("""
    import os, pwd, socket, sys, time, torch, torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"ready user={pwd.getpwuid(os.getuid()).pw_name} host={socket.gethostname()} "
          f"cvd={os.environ.get('CUDA_VISIBLE_DEVICES')} port={os.environ['MASTER_PORT']} "
          f"sum={t.item():.0f}", flush=True)
    hold = sys.argv[1] if len(sys.argv) > 1 else ""
    for _ in range(3000):  # until the test releases it (a file on this node), at most 600 s
        if not hold or os.path.exists(hold):
            break
        time.sleep(0.2)
    dist.all_reduce(t)
    print("finished", flush=True)
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def bed() -> Iterator[tb.Testbed]:
    users = tuple((u, f"pw-{u}-{os.urandom(4).hex()}") for u in USERS)
    b = tb.bring_up("bare-node testbed", tb.available() or bare.available(), lambda: tb.Testbed(
        len(SLOTS), bare=BareOptions(nodes=tuple(
            BareNode(sudo="none", extra_users=users) for _ in SLOTS))))
    try:
        b.trust_host_keys()
        for node in b.nodes:  # what setup's /etc/hosts step makes: every node by its address
            hosts = b.root_exec(node, "sh", "-c", "cat > /etc/hosts", input=b.hosts_text)
            assert hosts.returncode == 0, hosts.stderr
        yield b
    finally:
        b.close()


class User:
    """One user of the shared cluster: a key on every node, a project in its home there, a
    cluster file, and a head machine of its own (its own registry of heads)."""

    def __init__(self, bed: tb.Testbed, name: str, root: Path) -> None:
        self.name, self.bed = name, bed
        self.dir = root / name
        self.dir.mkdir(mode=0o700)
        (self.dir / "state").mkdir(mode=0o700)
        self.key = self.dir / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)],
                       check=True, timeout=30)
        pub = (self.dir / "id_ed25519.pub").read_text()
        for node in bed.nodes:
            home = f"/home/{name}"
            ok = bed.root_exec(node, "sh", "-c",
                               f"install -d -m 700 -o {name} -g {name} {home}/.ssh {home}/proj"
                               f" && cat > {home}/.ssh/authorized_keys && chown {name}:{name} "
                               f"{home}/.ssh/authorized_keys && chmod 600 "
                               f"{home}/.ssh/authorized_keys", input=pub)
            assert ok.returncode == 0, ok.stderr
            ok = bed.root_exec(node, "sh", "-c", f"cat > {home}/proj/job.py && chown "
                               f"{name}:{name} {home}/proj/job.py", input=JOB)
            assert ok.returncode == 0, ok.stderr
        self.python = bare.node_venv()
        self._n = 0

    def uid(self, node: tb.Node) -> int:
        """The user's uid on ``node`` (its own /etc/passwd)."""
        for line in (self.bed.node_root(node) / "etc/passwd").read_text().splitlines():
            fields = line.split(":")
            if fields[0] == self.name:
                return int(fields[2])
        raise AssertionError(f"no {self.name} on {node.name}")

    def cluster(self, slots: tuple[int, ...] = SLOTS, extra: str = "gpus: auto\n") -> str:
        self._n += 1
        path = self.dir / f"cluster{self._n}.yaml"
        lines = ["nodes:"] + [f"  - {{host: {n.name}, slots: {s}}}"
                              for n, s in zip(self.bed.nodes, slots, strict=False)]
        lines += [f"python: {self.python}", "workdir: ~/proj", "master: {port: auto}",
                  f"ssh: {{user: {self.name}, identity_file: {self.key}, config_file: "
                  f"{self.bed.ssh_config}, options: {{ServerAliveInterval: 2, "
                  "ServerAliveCountMax: 3}}"]
        path.write_text("\n".join(lines) + "\n" + extra)
        return str(path)

    @property
    def env(self) -> dict[str, str]:
        """The user's head machine: its own registry of heads, its own name."""
        return {"XDG_STATE_HOME": str(self.dir / "state"), "USER": self.name,
                "LOGNAME": self.name}

    def start(self, *args: str, cluster: str | None = None) -> tuple[Head, str]:
        runs = self.dir / f"runs-{time.monotonic_ns()}"
        head = Head(["run", "--cluster", cluster or self.cluster(), "--run-dir", str(runs),
                     *args], cwd=self.dir, env=self.env)
        return head, job_id_when_started(runs)

    def ptc(self, *args: str, cluster: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 90) -> tuple[int, Head]:
        return run_head([args[0], "--cluster", cluster or self.cluster(), *args[1:]],
                        cwd=self.dir, timeout=timeout, env={**self.env, **(env or {})})


    def ps_json(self, *args: str) -> tuple[int, dict]:
        code, head = self.ptc("ps", "--json", *args)
        return code, json.loads("\n".join(head.lines)) if code == 0 else \
            {"output": head.output()}


@pytest.fixture(scope="module")
def users(bed: tb.Testbed, tmp_path_factory: pytest.TempPathFactory) -> dict[str, User]:
    root = tmp_path_factory.mktemp("users")
    return {u: User(bed, u, root) for u in USERS}


def hold_file(tag: str) -> str:
    return f"/tmp/hold-{tag}"


def release(bed: tb.Testbed, tag: str) -> None:
    """Let a held job's ranks finish: its hold file on every node (each node's own /tmp)."""
    for node in bed.nodes:
        (bed.node_root(node) / hold_file(tag).lstrip("/")).write_text("go\n")


def on_nodes(bed: tb.Testbed, job_id: str, wait: float = 0.0) -> dict[str, list[tuple[int, int]]]:
    """(pid, uid) of the job's live processes, per node, from each node's own process table
    (its network namespace's pids): torchrun and the ranks carry PTCLUSTER_JOB_ID, the guard's
    command line ends with the job id."""
    needle = f"PTCLUSTER_JOB_ID={job_id}".encode()
    deadline = time.monotonic() + wait
    while True:
        found: dict[str, list[tuple[int, int]]] = {}
        for node in bed.nodes:
            for pid in node.pids():
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                state = next(ln.split()[1] for ln in status.splitlines()
                             if ln.startswith("State:"))
                uid = int(next(ln.split()[1] for ln in status.splitlines()
                               if ln.startswith("Uid:")))
                tagged = raw.rstrip(b"\0").endswith((b"\0" + job_id.encode(),
                                                     b" " + job_id.encode()))
                if (needle in env or tagged) and state != "Z":
                    found.setdefault(node.name, []).append((pid, uid))
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def ready_lines(head: Head) -> dict[str, dict[str, str]]:
    """``[host:rank]`` -> the fields of the job's ``ready ...`` line."""
    out = {}
    for line in head.lines:
        prefix, _, rest = line.partition("] ")
        if rest.startswith("ready "):
            out[prefix.lstrip("[")] = dict(f.split("=", 1) for f in rest.split()[1:])
    return out


def end(*heads: Head) -> None:
    for h in heads:
        if h.proc.poll() is None:
            h.signal(signal.SIGINT)
            try:
                h.wait(timeout=60)
            except subprocess.TimeoutExpired:
                h.kill()


def assert_none_left(bed: tb.Testbed, *job_ids: str) -> None:
    for job in job_ids:
        left = on_nodes(bed, job, wait=30)
        assert left == {}, f"job {job} left processes on the nodes: {left}"


# -- the tests ----------------------------------------------------------------------------------
def test_two_users_jobs_at_once_get_disjoint_gpus_own_ports_and_both_finish(
        bed: tb.Testbed, users: dict[str, User]) -> None:
    """alice's and bob's jobs on the same nodes at once, ``gpus: auto`` and ``master.port:
    auto``: every process of each job runs as its user on every node; disjoint GPU indices
    (leased and set in CUDA_VISIBLE_DEVICES on these CPU nodes), distinct ports; ``ps`` as bob
    shows only bob's job, ``--all-users`` both with their users; the leases are ``ptcluster-*``
    files in the nodes' own /run/lock (setup never made anything for them), each its holder's
    own; both finish, exit 0."""
    alice, bob = users["alice"], users["bob"]
    a, job_a = alice.start("job.py", hold_file("a1"))
    heads, jobs = [a], [job_a]
    try:
        a.wait_for("ready ", count=3, timeout=180)
        b, job_b = bob.start("job.py", hold_file("b1"))
        heads.append(b)
        jobs.append(job_b)
        b.wait_for("ready ", count=3, timeout=180)
        got = {u: ready_lines(h) for u, h in (("alice", a), ("bob", b))}
        n0, n1 = (n.name for n in bed.nodes)
        cvd = {u: {k.split(":")[0]: v["cvd"] for k, v in lines.items()}
               for u, lines in got.items()}
        assert cvd == {"alice": {n0: "0,1", n1: "0"}, "bob": {n0: "2,3", n1: "1"}}, got
        for u, lines in got.items():
            assert {v["user"] for v in lines.values()} == {u}, lines
            assert {v["sum"] for v in lines.values()} == {"3"}, lines
        ports = {u: {v["port"] for v in lines.values()} for u, lines in got.items()}
        assert len(ports["alice"]) == len(ports["bob"]) == 1, ports
        assert ports["alice"] != ports["bob"], ports
        for user, job in ((alice, job_a), (bob, job_b)):  # the node side is the user's
            procs = on_nodes(bed, job)
            assert set(procs) == {n0, n1}, procs
            for node in bed.nodes:
                assert {uid for _, uid in procs[node.name]} == {user.uid(node)}, (user.name,
                                                                                procs)
        # ps: bob's own by default, everyone's with --all-users
        code, ps = bob.ps_json()
        assert code == 0, ps
        assert [(r["job_id"], r["user"]) for r in ps["jobs"]] == [(job_b, "bob")], ps
        code, everyone = bob.ps_json("--all-users")
        assert code == 0, everyone
        rows = {r["job_id"]: r for r in everyone["jobs"]}
        assert {j: r["user"] for j, r in rows.items()} == {job_a: "alice", job_b: "bob"}
        assert rows[job_a]["gpus"] == {n0: [0, 1], n1: [0]} and rows[job_a]["ranks"] == 3
        assert rows[job_b]["gpus"] == {n0: [2, 3], n1: [1]} and not rows[job_a]["mine"]
        assert str(rows[job_a]["port"]) in ports["alice"], rows
        check_lease_dirs(bed, users, {job_a: "alice", job_b: "bob"})
        release(bed, "a1")
        release(bed, "b1")
        codes = [h.wait(timeout=120) for h in heads]
        assert codes == [0, 0], "\n\n".join(h.output() for h in heads)
        for h in heads:
            assert sum(line.endswith("] finished") for line in h.lines) == 3, h.output()
        for node in bed.nodes:  # each guard removed its files as it ended
            left = [p.name for p in (bed.node_root(node) / "run/lock").glob("ptcluster-*")
                    if any(j in p.name for j in jobs)]
            assert left == [], (node.name, left)
    finally:
        end(*heads)
    assert_none_left(bed, *jobs)


def check_lease_dirs(bed: tb.Testbed, users: dict[str, User], jobs: dict[str, str]) -> None:
    """On every node: /run/lock is root's, mode 1777 (as boot made it: nothing of ptcluster's
    changed it or made a directory in it); every ``ptcluster-*`` file in it belongs to the user
    its record names (records ``NAME.UID.RAND.json`` world-readable, lock files created by their
    holders), and each job's leases are there."""
    for node in bed.nodes:
        d = bed.node_root(node) / "run/lock"
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o1777, oct(st.st_mode)
        assert st.st_uid == 0
        assert not (d / "ptcluster").exists()
        names = {u.uid(node): name for name, u in users.items()}
        records = {}
        ours = sorted(e for e in os.listdir(d) if e.startswith("ptcluster-"))
        for entry in ours:
            st = os.lstat(d / entry)
            assert stat.S_ISREG(st.st_mode), entry
            assert st.st_uid in names, (node.name, entry, st.st_uid)
            if entry.endswith(".json"):
                # NAME.UID.RAND.json (a lease's record, unpredictable: L1) or NAME.UID.json
                named = re.fullmatch(r"(?P<name>.+?)\.(?P<uid>\d+)(?:\.[0-9a-f]+)?\.json", entry)
                assert named is not None and int(named["uid"]) == st.st_uid, entry
                assert stat.S_IMODE(st.st_mode) == 0o644, (entry, oct(st.st_mode))
                record = json.loads((d / entry).read_text())
                assert record["user"] == names[st.st_uid] == jobs[record["job_id"]], record
                records[named["name"]] = st.st_uid
        for entry in ours:
            if entry.endswith(".lock"):  # held now: made by the holder, whose record is beside
                assert records[entry[:-len(".lock")]] == os.lstat(d / entry).st_uid, entry
        for job in jobs:
            assert f"ptcluster-job-{job}@{node.name}" in records, (node.name, sorted(records))


def test_explicit_gpus_that_alice_holds_refuse_bobs_job_before_any_rank_or_wait_for_them(
        bed: tb.Testbed, users: dict[str, User]) -> None:
    """bob asks for the GPU alice's running job leased: refused before any rank starts (no
    process of bob's job on any node), naming alice and her job; with ``run --wait`` bob's job
    says for whom it waits, starts once alice's job ends, and finishes."""
    alice, bob = users["alice"], users["bob"]
    one = (1, 1)
    a, job_a = alice.start("job.py", hold_file("a2"), cluster=alice.cluster(one, "gpus: [1]\n"))
    heads, jobs = [a], [job_a]
    try:
        a.wait_for("ready ", count=2, timeout=180)
        theirs = bob.cluster(one, "gpus: [1]\n")
        runs = bob.dir / "runs-refused"
        code, refused = run_head(["run", "--cluster", theirs, "--run-dir", str(runs),
                                  "job.py"], cwd=bob.dir, timeout=120, env=bob.env)
        (run,) = [p for p in runs.iterdir() if p.is_dir()]
        jobs.append(run.name)
        err = "\n".join(refused.err)
        assert code == 1, refused.output()
        assert f"1 GPU(s) asked for, 0 free: GPU 1 is in use by job {job_a} (alice, python " \
            "job.py, since " in err, err  # (the program, never its arguments)
        assert "run --wait" in err, err
        summary = json.loads((run / "summary.json").read_text())
        cause = summary["root_cause"]
        assert (cause["code"], cause["fields"]["ask"]) == ("guard.gpus-busy", ", or ask alice"), \
            cause
        assert all(r["status"] == "not started" for r in summary["ranks"]), summary["ranks"]
        assert not any(":0] " in line for line in refused.lines), refused.output()
        assert on_nodes(bed, run.name) == {}
        w, job_w = bob.start("--wait", "job.py", cluster=theirs)
        heads.append(w)
        jobs.append(job_w)
        deadline = time.monotonic() + 90
        while not any("waiting (--wait, no queue): " in line and job_a in line
                      for line in w.err):
            assert time.monotonic() < deadline and w.proc.poll() is None, w.output()
            time.sleep(0.2)
        assert not any("ready " in line for line in w.lines)
        release(bed, "a2")
        assert a.wait(timeout=120) == 0, a.output()
        assert w.wait(timeout=180) == 0, w.output()
        assert {v["user"] for v in ready_lines(w).values()} == {"bob"}, w.output()
        assert {v["cvd"] for v in ready_lines(w).values()} == {"1"}, w.output()
    finally:
        end(*heads)
    assert_none_left(bed, *jobs)


def test_kill_by_bob_is_refused_and_by_alice_ends_her_job_on_every_node(
        bed: tb.Testbed, users: dict[str, User]) -> None:
    """``ptcluster kill ALICES_JOB`` run by bob (his cluster file, his head machine): one line,
    exit 1, her job untouched. Run by alice from a machine that is not her head's (her own
    cluster file, a registry without the head): each node's guard of the job is signalled, her
    head reports who ended it and exits 143, and the nodes' process tables hold nothing of it."""
    alice, bob = users["alice"], users["bob"]
    a, job_a = alice.start("job.py", hold_file("a3"))
    try:
        a.wait_for("ready ", count=3, timeout=180)
        before = on_nodes(bed, job_a)
        code, killer = bob.ptc("kill", job_a)
        assert code == 1, killer.output()
        said = [line for line in killer.err if line.strip()]
        assert said == [f"ptcluster: job {job_a} is alice's: only alice or root may end it "
                        f"(on {', '.join(n.name for n in bed.nodes)})"], killer.output()
        assert not killer.lines, killer.output()
        time.sleep(1)
        assert a.proc.poll() is None and on_nodes(bed, job_a) == before
        elsewhere = alice.dir / "another-machine"
        elsewhere.mkdir(mode=0o700, exist_ok=True)
        code, killer = alice.ptc("kill", job_a, env={"XDG_STATE_HOME": str(elsewhere)})
        assert code == 0, killer.output()
        assert f"job {job_a}: SIGTERM to its guard on " in "\n".join(killer.lines), \
            killer.output()
        assert a.wait(timeout=90) == 143, a.output()
        assert f"ended by `ptcluster kill` from {socket.gethostname()} (alice)" in \
            "\n".join(a.err), a.output()
    finally:
        end(a)
    assert_none_left(bed, job_a)
    assert pwd.getpwuid(os.getuid()).pw_name == "root"  # (the heads ran as root throughout)


def test_a_run_lock_that_is_not_roots_refuses_a_users_job_in_one_line_unless_opted_out(
        bed: tb.Testbed, users: dict[str, User]) -> None:
    """A node whose /run/lock is alice's (sticky, 1777, but hers: she could take or drop every
    lease in it): her job is refused before any rank starts, in one line that says why, that
    root must make it root's 1777 and names the unsafe ``--no-leases``; nothing is made. One
    that is root's but not sticky and open to all is refused the same way. With ``run
    --no-leases`` the job runs, and says on every node that it is unleased."""
    alice = users["alice"]
    n1 = bed.nodes[1]
    theirs = bed.root_exec(n1, "chown", "alice:alice", "/run/lock")
    assert theirs.returncode == 0, theirs.stderr
    jobs: list[str] = []
    runs = alice.dir / "runs-unleased"

    def newest_summary(runs: Path) -> dict:
        return json.loads((runs / jobs[-1] / "summary.json").read_text())

    def run_alice(*opts: str) -> tuple[int, Head]:
        code, head = run_head(["run", *opts, "--cluster", alice.cluster(), "--run-dir",
                               str(runs), "job.py"], cwd=alice.dir, timeout=180, env=alice.env)
        jobs.extend(p.name for p in runs.iterdir() if p.is_dir() and p.name not in jobs)
        return code, head

    ours = bed.node_root(n1) / "run/lock"
    before = set(ours.glob("ptcluster*"))
    try:
        code, refused = run_alice()
        assert code == 1, refused.output()
        said = [line for line in refused.err if line.startswith("Root cause") and
                "no lease directory to trust" in line]  # (one line, as every refusal)
        assert len(said) == 1 and f"{n1.name}: no lease directory" in said[0], refused.output()
        assert f"/run/lock belongs to uid {alice.uid(n1)}, not to root" in said[0], said
        cause = newest_summary(runs)["root_cause"]
        assert (cause["code"], cause["host"]) == ("guard.lease-dir-untrusted", n1.name), cause
        assert cause["fix"] == UNLEASED_FIX and "unsafe" in said[0], said  # (in its one line)
        assert not any("ready " in line for line in refused.lines), refused.output()
        assert set(ours.glob("ptcluster*")) == before  # (nothing made, nothing removed)
        back = bed.root_exec(n1, "sh", "-c", "chown root:root /run/lock && chmod 755 /run/lock")
        assert back.returncode == 0, back.stderr
        code, refused = run_alice()
        cause = newest_summary(runs)["root_cause"]
        assert code == 1 and cause["code"] == "guard.lease-dir-untrusted", refused.output()
        assert cause["fields"] == {"error": "/run/lock has mode 755, not 1777"}, cause
        code, unleased = run_alice("--no-leases")
        assert code == 0, unleased.output()
        assert sum(line.endswith("] finished") for line in unleased.lines) == 3
        notes = [line for line in unleased.err if "no leases (run --no-leases" in line]
        assert {n.name for n in bed.nodes if any(f"{n.name}: no leases" in x for x in notes)} \
            == {n.name for n in bed.nodes}, unleased.output()
    finally:
        made = bed.root_exec(n1, "sh", "-c", "chown root:root /run/lock && chmod 1777 /run/lock")
        assert made.returncode == 0, made.stderr
    assert_none_left(bed, *jobs)

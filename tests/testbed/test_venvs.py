"""The project's environment on bare nodes (each its own root, no network, no registry): wheels
the test makes, shipped over ssh to each node that lacks them, built there by the uv that
travels with them, layered on the nodes' venv (the pinned torch, as setup's would be).

One bed for the module (2 nodes, 1 slot each, the user alice with a key); the tests build on
nothing but it. The jobs run through the launcher as a library with the spec ``use_environment``
returns (``run --requirements`` is that plus env-A's resolver, which these tests stand in for
with a set of wheels of their own).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ptcluster.cluster.load import load_cluster_file
from ptcluster.cluster.model import ClusterSpec
from ptcluster.doctor.checks import FAIL, OK
from ptcluster.doctor.diagnose import check_environment
from ptcluster.launch.api import prepare
from ptcluster.launch.plan import Target
from ptcluster.launch.result import RunResult
from ptcluster.launch.runner import Runner
from ptcluster.node.blobs import PART_PREFIX
from ptcluster.remote.connect import transports
from ptcluster.remote.group import Member
from ptcluster.venvs import nodes
from ptcluster.venvs.known import KnownNodes
from ptcluster.venvs.resolved import Platform, ResolvedEnv, Wheel
from ptcluster.venvs.runenv import reship, use_environment
from ptcluster.venvs.ship import BUILT, FAILED, REBUILT, UP_TO_DATE, ShipResult, ship
from tests.support import bare
from tests.support import testbed as tb
from tests.support.bare import BareNode, BareOptions
from tests.support.wheels import make_wheel, resolved, uv_wheel, wheel_of

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
USER = "alice"
UV = uv_wheel()
JOB = """
import os, sys, time, tinya, tinyb, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"VENV rank={os.environ['RANK']} tinya={tinya.VERSION} tinyb={tinyb.VERSION} "
      f"sum={t.item():.0f} python={sys.executable}", flush=True)
hold = sys.argv[1] if len(sys.argv) > 1 else ""
for _ in range(600):
    if not hold or os.path.exists(hold):
        break
    time.sleep(0.2)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def bed() -> Iterator[tb.Testbed]:
    if UV is None:
        pytest.skip("no uv wheel at hand (PTC_UV_WHEEL)")
    b = tb.bring_up("bare-node testbed", tb.available() or bare.available(), lambda: tb.Testbed(
        2, bare=BareOptions(nodes=tuple(BareNode(sudo="none", extra_users=((USER, "pw-a"),))
                                        for _ in range(2)))))
    try:
        b.trust_host_keys()
        for node in b.nodes:
            hosts = b.root_exec(node, "sh", "-c", "cat > /etc/hosts", input=b.hosts_text)
            assert hosts.returncode == 0, hosts.stderr
        yield b
    finally:
        b.close()


class Project:
    """alice's key on every node, her job in ~/proj there, her cluster file, wheels made here."""

    def __init__(self, bed: tb.Testbed, root: Path) -> None:
        self.bed, self.root = bed, root
        key = root / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                       check=True, timeout=30)
        home = f"/home/{USER}"
        for node in bed.nodes:
            ok = bed.root_exec(node, "sh", "-c",
                               f"install -d -m 700 -o {USER} -g {USER} {home}/.ssh {home}/proj"
                               f" && cat > {home}/.ssh/authorized_keys && chown {USER}:{USER} "
                               f"{home}/.ssh/authorized_keys && chmod 600 "
                               f"{home}/.ssh/authorized_keys", input=(root / "id_ed25519.pub")
                               .read_text())
            assert ok.returncode == 0, ok.stderr
            ok = bed.root_exec(node, "sh", "-c", f"cat > {home}/proj/job.py && chown "
                               f"{USER}:{USER} {home}/proj/job.py", input=JOB)
            assert ok.returncode == 0, ok.stderr
        cluster = root / "cluster.yaml"
        cluster.write_text("nodes:\n" + "".join(f"  - {{host: {n.name}, slots: 1}}\n"
                                                 for n in bed.nodes)
                           + f"python: {bare.node_venv()}\nworkdir: ~/proj\n"
                           "master: {port: auto}\nbackend: gloo\n"
                           f"ssh: {{user: {USER}, identity_file: {key}, config_file: "
                           f"{bed.ssh_config}}}\n")
        self.spec: ClusterSpec = load_cluster_file(cluster, trusted=True)
        (root / "wheels").mkdir()
        self.paths: dict[str, Path] = {wheel_of(UV, "uv", UV.name.split("-")[1]).sha256: UV} \
            if UV else {}

    def wheel(self, name: str, version: str, padding: int = 0) -> Wheel:
        path = make_wheel(self.root / "wheels", name, version, padding=padding)
        w = wheel_of(path, name, version)
        self.paths[w.sha256] = path
        return w

    def given(self, path: Path) -> Wheel:
        """A wheel made elsewhere (its name and version from its file name)."""
        name, version = path.name.split("-")[:2]
        w = wheel_of(path, name, version)
        self.paths[w.sha256] = path
        return w

    def choose(self, *wheels: Wheel) -> object:
        def choose(platform: Platform) -> ResolvedEnv:
            return resolved({w: self.paths[w.sha256] for w in wheels}, UV, python=platform.python)
        return choose

    def locate(self, wheel: Wheel) -> Path:
        return self.paths[wheel.sha256]


@pytest.fixture(scope="module")
def project(bed: tb.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Project:
    return Project(bed, tmp_path_factory.mktemp("venvs"))


def run_job(spec: ClusterSpec, env: dict, run_dir: Path, *args: str,
            lines: list[str] | None = None) -> RunResult:
    plan = prepare(spec, Target(script="job.py", args=args))
    seen = lines if lines is not None else []
    return Runner(plan, transports(spec), run_dir, environment=env,
                  on_line=lambda host, rank, text: seen.append(text)).run()


def test_run_in_it_then_noop_then_changed_file_found_and_rebuilt(project: Project,
                                                                 tmp_path: Path) -> None:
    a, b = project.wheel("tinya", "1.0"), project.wheel("tinyb", "1.0", padding=2 << 20)
    choose = project.choose(a, b)
    begun = time.monotonic()
    first = use_environment(project.spec, choose, project.locate, source="requirements.txt")
    took = time.monotonic() - begun
    shipped = first.shipped
    assert shipped.ok and {n.state for n in shipped.nodes.values()} == {BUILT}, shipped
    (digest,) = shipped.envs
    env = shipped.envs[digest]
    total = sum(w.size for w in (*env.wheels, *env.tools))
    assert shipped.bytes_sent == 2 * total  # each wheel to each node once
    lines: list[str] = []
    result = run_job(first.spec, first.to_json(), tmp_path / "run1", lines=lines)
    assert result.ok, (result.failures, lines[-20:])
    python = f"/home/{USER}/.ptcluster/envs/{digest}/bin/python"
    said = sorted(line for line in lines if line.startswith("VENV "))
    assert said == [f"VENV rank={r} tinya=1.0 tinyb=1.0 sum=2 python={python}" for r in (0, 1)]
    summary = json.loads((tmp_path / "run1" / "summary.json").read_text())
    assert summary["environment"]["digest"] == digest
    assert summary["environment"]["python"] == {"0": python, "1": python}

    begun = time.monotonic()
    second = use_environment(project.spec, choose, project.locate, source="requirements.txt")
    again = time.monotonic() - begun
    assert {n.state for n in second.shipped.nodes.values()} == {UP_TO_DATE}
    assert second.shipped.bytes_sent == 0
    print(f"environment: first {took:.2f} s ({total / 1e6:.1f} MB to each of 2 nodes), "
          f"unchanged {again:.2f} s")

    n1 = project.bed.nodes[1]
    init = f"/home/{USER}/.ptcluster/envs/{digest}/lib/python3.11/site-packages/tinya/__init__.py"
    hand = project.bed.root_exec(n1, "sh", "-c", f"echo 'VERSION = \"by hand\"' > {init}")
    assert hand.returncode == 0, hand.stderr
    found = check_environment(project.spec, choose)  # doctor's environment check
    bad = [f for f in found if f.status == FAIL]
    assert len(bad) == 1 and bad[0].host == n1.name, found
    assert bad[0].problem.code == "venvs.file-changed", bad  # (its own code, its fields)
    assert bad[0].problem.fields["owner"] == "tinya 1.0"
    assert bad[0].problem.fields["path"].endswith("site-packages/tinya/__init__.py"), bad
    assert [f.status for f in found if f.host == project.bed.nodes[0].name] == [OK]

    third = use_environment(project.spec, choose, project.locate, source="requirements.txt")
    assert third.shipped.nodes[n1.name].state == REBUILT
    assert third.shipped.nodes[project.bed.nodes[0].name].state == UP_TO_DATE
    lines = []
    result = run_job(third.spec, third.to_json(), tmp_path / "run2", lines=lines)
    assert result.ok and sum("tinya=1.0" in line for line in lines) == 2, lines[-20:]


def test_two_environments_at_once_and_prune_keeps_those_in_use(project: Project,
                                                               tmp_path: Path) -> None:
    a1, a2, b = (project.wheel("tinya", "1.0"), project.wheel("tinya", "2.0"),
                 project.wheel("tinyb", "1.0", padding=2 << 20))
    one = use_environment(project.spec, project.choose(a1, b), project.locate, source="one")
    two = use_environment(project.spec, project.choose(a2, b), project.locate, source="two")
    assert two.shipped.bytes_sent == 2 * a2.size  # tinyb and uv were there already
    hold = f"/tmp/hold-{os.getpid()}"
    results: dict[str, RunResult] = {}
    lines: dict[str, list[str]] = {"one": [], "two": []}
    runs = [threading.Thread(target=lambda name=name, used=used: results.__setitem__(
        name, run_job(used.spec, used.to_json(), tmp_path / name, hold, lines=lines[name])))
        for name, used in (("one", one), ("two", two))]
    for t in runs:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while sum(line.startswith("VENV ") for v in lines.values() for line in v) < 4:
            assert time.monotonic() < deadline, lines
            time.sleep(0.2)
        pruned = nodes.prune(nodes.members(project.spec), keep=0, max_bytes=0, grace=0)
        for host, got in pruned.items():
            assert got.problem is None, got.problem
            kept = {e["digest"]: e["why"] for e in got.answer["kept"]}
            assert set(kept) == set(one.shipped.envs) | set(two.shipped.envs), (host, got.answer)
            assert all(why.startswith("in use by ") for why in kept.values()), kept
    finally:
        for node in project.bed.nodes:
            project.bed.root_exec(node, "touch", hold)
        for t in runs:
            t.join(120)
    assert results["one"].ok and results["two"].ok
    assert sum("tinya=1.0" in line for line in lines["one"]) == 2
    assert sum("tinya=2.0" in line for line in lines["two"]) == 2
    listed = nodes.listing(nodes.members(project.spec))
    for host, got in listed.items():
        assert all(e["in_use"] == [] for e in got.answer["envs"]), (host, got.answer)
    pruned = nodes.prune(nodes.members(project.spec), keep=1, max_bytes=1 << 40, grace=0)
    for host, got in pruned.items():
        assert len(got.answer["kept"]) == 1 and got.answer["removed"], (host, got.answer)


def test_full_disk_on_one_node_named_partial_removed_other_built(project: Project) -> None:
    n0, n1 = project.bed.nodes
    store = f"/home/{USER}/.ptcluster/store"
    ids = project.bed.root_exec(n0, "sh", "-c", f"id -u {USER}; id -g {USER}")
    uid, gid = ids.stdout.split()
    mount = project.bed.root_exec(n0, "mount", "-t", "tmpfs", "-o",
                                  f"size=1m,uid={uid},gid={gid},mode=700", "tiny", store)
    assert mount.returncode == 0, mount.stderr
    try:
        choose = project.choose(project.wheel("tinya", "3.0"),
                                project.wheel("tinyb", "3.0", padding=2 << 20))
        shipped = ship_all(project, choose)
        problem = shipped.nodes[n0.name].problem
        assert problem is not None and problem.who == n0.name, shipped.nodes
        assert problem.what.startswith(f"the disk is full at {store}/sha256/{PART_PREFIX}"), \
            problem
        assert problem.code == "venvs.disk-full" and int(problem.fields["free"]) >= 0, problem
        assert problem.fields["path"].startswith(f"{store}/sha256/{PART_PREFIX}"), problem
        left = project.bed.root_exec(n0, "sh", "-c", f"ls -A {store}/sha256; ls -A "
                                     f"/home/{USER}/.ptcluster/envs")
        assert PART_PREFIX not in left.stdout and ".build-" not in left.stdout, left.stdout
        assert shipped.nodes[n1.name].state == BUILT  # the other node's work goes on
    finally:
        project.bed.root_exec(n0, "umount", store)


def test_unchanged_launches_at_once_and_a_removed_one_is_shipped_on_one_node(
        project: Project, tmp_path: Path) -> None:
    """Over ssh, 2 nodes: with the head's records, an unchanged environment is launched without
    a ship session (each guard checks it); removed from one node, that node's guard names it
    (no rank starts anywhere), the head ships it there (0 wheels: its store has them), and the
    same job runs on both in it."""
    a, b = project.wheel("tinya", "4.0"), project.wheel("tinyb", "4.0")
    choose = project.choose(a, b)
    known = KnownNodes(tmp_path / "known")
    first = use_environment(project.spec, choose, project.locate, source="r.txt", known=known)
    assert not first.expected and {n.state for n in first.shipped.nodes.values()} == {BUILT}
    (digest,) = first.shipped.envs
    again = use_environment(project.spec, choose, project.locate, source="r.txt", known=known)
    assert again.expected and again.shipped.facts == {}  # nothing asked of the nodes
    n1 = project.bed.nodes[1]
    gone = project.bed.root_exec(n1, "rm", "-rf", f"/home/{USER}/.ptcluster/envs/{digest}")
    assert gone.returncode == 0, gone.stderr
    target = Target(script="job.py")
    plan = prepare(again.spec, target)
    lines: list[str] = []
    notes: list[str] = []
    result = Runner(plan, transports(again.spec), tmp_path / "run", environment=again.to_json(),
                    on_line=lambda host, rank, text: lines.append(text), on_status=notes.append,
                    reship=reship(project.spec, lambda: use_environment(
                        project.spec, choose, project.locate, source="r.txt"), target)).run()
    assert result.ok, (result.failures, notes, lines[-20:])
    python = f"/home/{USER}/.ptcluster/envs/{digest}/bin/python"
    said = sorted(line for line in lines if line.startswith("VENV "))
    assert said == [f"VENV rank={r} tinya=4.0 tinyb=4.0 sum=2 python={python}" for r in (0, 1)]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["environment"]["reshipped"] == {n1.name: "guard.environment-not-ready"}
    nodes_said = summary["environment"]["nodes"]
    assert nodes_said[n1.name]["state"] == BUILT and nodes_said[n1.name]["wheels_sent"] == 0
    assert nodes_said[project.bed.nodes[0].name]["state"] == UP_TO_DATE
    assert len(summary["attempts"]) == 1 and summary["job_id"] == plan.job_id


def ship_all(project: Project, choose: object) -> ShipResult:
    return ship(nodes.members(project.spec), choose, project.locate)  # type: ignore[arg-type]


def test_a_node_cut_off_mid_build_is_named_and_its_build_ends_there(project: Project) -> None:
    """Issue 42's node lost during the build, over ssh: n1's link is cut while its build holds
    (a uv stand-in that sleeps while ~/.ptcluster/hold exists). The head names n1 (ssh's
    keepalive ends the channel); on n1, which sees silence and never EOF (its sshd keeps the
    session), the node program stops the build, removes its folder and ends, the build's
    process with it; the digest is never in place there."""
    from tests.local.test_venvs_lost import HELD_UV
    from tests.support.wheels import slow_tool_wheel

    n1 = project.bed.nodes[1]
    tool = slow_tool_wheel(project.root / "wheels", HELD_UV.replace("REAL_UV", "false"))
    project.paths[tool.sha256] = project.root / "wheels" / tool.filename
    package = project.wheel("tinyheld", "1.0")
    digests: list[str] = []

    def choose(platform: Platform) -> ResolvedEnv:
        env = ResolvedEnv("requirements.txt", "requirements", platform, (package,), (tool,))
        digests.append(env.digest)
        return env

    home = f"/home/{USER}/.ptcluster"
    held = project.bed.root_exec(n1, "sh", "-c", f"install -d -m 700 -o {USER} {home} && "
                                 f"touch {home}/hold && chown {USER} {home}/hold")
    assert held.returncode == 0, held.stderr
    (member,) = [m for m in nodes.members(project.spec) if m.host == n1.name]
    got: list[ShipResult] = []
    shipping = threading.Thread(target=lambda: got.append(ship([member], choose,
                                                              project.locate)), daemon=True)
    shipping.start()
    try:
        deadline = time.monotonic() + 120
        while project.bed.root_exec(n1, "sh", "-c", f"ls {home}/envs/.build-*/pid").returncode:
            assert time.monotonic() < deadline and shipping.is_alive(), "the build never held"
            time.sleep(0.2)
        project.bed.cut_link(n1)
        shipping.join(90)
        assert got, "the head did not give up on the cut node"
        lost = got[0].nodes[n1.name]
        assert lost.state == FAILED and lost.problem is not None and \
            lost.problem.who == n1.name, lost
        deadline = time.monotonic() + 60
        while (left := _users_processes(n1)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"still on {n1.name} after the head went silent: {left}"
        envs = project.bed.root_exec(n1, "ls", "-A", f"{home}/envs").stdout.split()
        assert not [e for e in envs if e.startswith(".build-")], envs
        assert digests[0] not in envs, envs  # (its lock file stays: .lock-DIGEST)
    finally:
        project.bed.restore_link(n1)
        project.bed.root_exec(n1, "rm", "-f", f"{home}/hold")
        for pid, _ in _users_processes(n1):
            os.kill(pid, 9)  # (this test's own leftovers, whatever happened above)


def _users_processes(node: tb.Node) -> list[tuple[int, str]]:
    """The processes of the node's user in ``node`` other than sshd's (its session ends only
    when TCP gives up on the cut link)."""
    out = []
    for pid in node.pids():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        uid = int(status.split("\nUid:")[1].split()[0])
        if uid != 0 and comm != "sshd":
            out.append((pid, comm))
    return out


@pytest.fixture(scope="module")
def relay_bed() -> Iterator[tb.Testbed]:
    """3 namespace nodes (this machine's files, each node its own ptcluster directory): the
    relay's chain head -> n0 -> n1 -> n2 over their own links."""
    if UV is None:
        pytest.skip("no uv wheel at hand (PTC_UV_WHEEL)")
    yield from tb.namespace_bed(3)


def relay_members(bed: tb.Testbed, tmp: Path) -> list[Member]:
    """The bed's 3 nodes, each its ptcluster directory in ``tmp`` (a folder for wheels too)."""
    (tmp / "wheels").mkdir()
    return tb.members(bed, tmp, 3, lambda i: {"root": str(tmp / f"root-{i}")})


def test_relay_the_middle_node_cut_mid_ship_is_named_the_others_build(
        relay_bed: tb.Testbed, tmp_path: Path) -> None:
    """The wheels relay (3 nodes: the head sends each once, to the first); the middle node's
    link is cut in the middle of a wheel (its program held by SIGSTOP until the link is down,
    so that the set cannot have passed it). The head names it; the node after it, whose
    upstream is gone (the kernel's probes: ``node.data_relay``), gets what it lacks from the
    head and builds, as the first node does; the cut node's program ends itself (silence)."""
    from tests.testbed.test_push import all_ended, cut_mid_file

    bed = relay_bed
    cut = bed.nodes[1]
    members = relay_members(bed, tmp_path)
    assert UV is not None
    paths = {wheel_of(UV, "uv", UV.name.split("-")[1]).sha256: UV}
    made = [wheel_of(make_wheel(tmp_path / "wheels", f"big{i}", "1.0", padding=16 << 20),
                     f"big{i}", "1.0") for i in range(4)]  # 64 MiB
    for w in made:
        paths[w.sha256] = tmp_path / "wheels" / w.filename
    env = resolved({w: paths[w.sha256] for w in made}, UV)
    everything = sum(w.size for w in (*env.wheels, *env.tools))
    got: list[ShipResult] = []
    shipping = threading.Thread(target=lambda: got.append(ship(
        members, lambda p: env, lambda w: paths[w.sha256])), daemon=True)
    shipping.start()
    with cut_mid_file(bed, cut, tmp_path / "root-1" / "store", shipping.is_alive) as agents:
        cut_at = time.monotonic()
        shipping.join(180)
        assert got, "the ship did not end"
        done = got[0]
        print(f"middle node cut: the ship ended {time.monotonic() - cut_at:.1f} s after")
        assert done.chain == [m.host for m in members]
        assert set(done.failed) == {cut.name}, done.failed
        lost = done.nodes[cut.name].problem
        assert lost is not None and lost.who == cut.name
        for m in (members[0], members[2]):
            assert done.nodes[m.host].state == BUILT, done.nodes[m.host]
            assert Path(str(done.nodes[m.host].python)).exists()
        # the set once to the first node, then to the last what the cut left out
        assert everything < done.bytes_sent <= 2 * everything, (done.bytes_sent, everything)
        assert all_ended(agents, 60), "the cut node's program did not end"
        assert not (tmp_path / "root-1" / "envs" / env.digest).exists()


def test_relay_the_head_sends_each_wheel_once(relay_bed: tb.Testbed, tmp_path: Path) -> None:
    """3 nodes that lack the environment: what the head's interface sent (its bridge's
    counters) is the wheels once plus ssh's and the frames' overhead, not three times."""
    from tests.testbed.test_push import tx_bytes

    bed = relay_bed
    members = relay_members(bed, tmp_path)
    big = make_wheel(tmp_path / "wheels", "bigone", "1.0", padding=24 << 20)
    env = resolved({wheel_of(big, "bigone", "1.0"): big}, UV)
    assert UV is not None
    paths = {w.sha256: big for w in env.wheels} | {w.sha256: UV for w in env.tools}
    everything = sum(w.size for w in (*env.wheels, *env.tools))
    before = tx_bytes(bed.bridge)
    done = ship(members, lambda p: env, lambda w: paths[w.sha256])
    egress = tx_bytes(bed.bridge) - before
    assert done.ok, done.failed
    assert done.chain == [m.host for m in members]
    assert done.bytes_sent == everything  # what the head wrote on its channels: each once
    assert egress <= 1.5 * everything, (egress, everything)
    print(f"relay 3 nodes: {everything} bytes of wheels, head egress {egress} "
          f"({egress / everything:.2f}x)")

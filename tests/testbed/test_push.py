"""``ptcluster push`` across testbed nodes: the relay over an 8-node namespace testbed (the
head's egress read from its bridge's counters), and the CLI onto bare nodes (each its own root
file system, so nothing is shared by accident): digests on every node, a second push < 1 MiB."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ptcluster.push.scan import scan
from ptcluster.push.send import PushResult, push
from ptcluster.remote.group import Member
from tests.support import bare
from tests.support import testbed as tb
from tests.support.bare import BareNode, BareOptions

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
USER = "alice"


def digests(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()
            and not p.name.startswith(".ptcluster")}


def dataset(root: Path, files: int, size: int) -> Path:
    src = root / "src"
    for i in range(files):
        path = src / f"shard-{i % 4}" / f"part-{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    return src


def tx_bytes(dev: str) -> int:
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


@pytest.fixture(scope="module")
def relay_bed() -> Iterator[tb.Testbed]:
    yield from tb.namespace_bed(8)


def relay_members(bed: tb.Testbed, tmp_path: Path) -> list[Member]:
    return tb.members(bed, tmp_path, 8, lambda i: {"dest": str(tmp_path / f"dest-{i}")})


def test_relay_on_8_nodes_head_egress_about_once(relay_bed: tb.Testbed, tmp_path: Path) -> None:
    bed = relay_bed
    members = relay_members(bed, tmp_path)
    src = dataset(tmp_path, files=16, size=2 << 20)  # 32 MiB
    before = tx_bytes(bed.bridge)
    done = push(members, scan(src))
    egress = tx_bytes(bed.bridge) - before
    assert done.ok, done.failed
    assert len(done.chain) == 8
    for i in range(8):
        assert digests(tmp_path / f"dest-{i}") == digests(src)
    size = done.size
    assert done.bytes_sent == size
    # what the head's interface sent: the set once, plus ssh's and the frames' overhead
    assert egress <= 1.5 * size, (egress, size)
    print(f"relay 8 nodes: {size} bytes, head egress {egress} ({egress / size:.2f}x)")
    before = tx_bytes(bed.bridge)
    again = push(members, scan(src))
    assert again.ok and again.bytes_sent == 0
    assert tx_bytes(bed.bridge) - before < 1 << 20


def test_relay_a_node_cut_off_mid_push(relay_bed: tb.Testbed, tmp_path: Path) -> None:
    """A middle node of the chain loses its link in the middle of a file (held by SIGSTOP
    until its link is down, so that the set cannot have passed it): no FIN reaches its
    neighbours. The node after it hears nothing and the one before it cannot send: the kernel's
    probes (``node.data_relay``) drop the cut peer for both, the head names the node (ssh's
    keepalive) and sends the nodes after it what they lack itself, and every other node has
    the set; on the cut node, which sees silence and never EOF, the program ends itself and
    removes its temp file."""
    bed = relay_bed
    cut = bed.nodes[3]
    members = relay_members(bed, tmp_path)
    src = dataset(tmp_path, files=8, size=8 << 20)  # 64 MiB
    got: list[PushResult] = []
    pushing = threading.Thread(target=lambda: got.append(push(members, scan(src))), daemon=True)
    pushing.start()
    with cut_mid_file(bed, cut, tmp_path / "dest-3", pushing.is_alive) as agents:
        cut_at = time.monotonic()
        pushing.join(180)  # (without the kernel's probes: 600 s, the relay's stream timeout)
        assert got, "the push did not end"
        done = got[0]
        print(f"node 3 cut: the push ended {time.monotonic() - cut_at:.1f} s after")
        assert set(done.failed) == {cut.name}, done.failed
        assert done.chain == [m.host for m in members]
        for i in range(8):
            if i != 3:
                assert digests(tmp_path / f"dest-{i}") == digests(src), i
        assert done.bytes_sent > done.size  # (the nodes after the cut: from the head)
        assert all_ended(agents, 60), "the cut node's program did not end"
        print(f"node 3's program ended by {time.monotonic() - cut_at:.1f} s after the cut")
        assert not list((tmp_path / "dest-3").rglob(".ptcluster-part-*"))


@contextlib.contextmanager
def cut_mid_file(bed: tb.Testbed, node: tb.Node, folder: Path,
                 going: Callable[[], bool]) -> Iterator[list[int]]:
    """``node``'s link cut once a file on its way to it shows in ``folder`` (a temp file), its
    node programs held (SIGSTOP) until the link is down, so that no more of it can have passed
    on: their pids. After: the link restored, any of them left killed."""
    agents: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not list(folder.rglob(".ptcluster-part-*")):
            assert time.monotonic() < deadline and going(), f"no file reached {node.name}"
            time.sleep(0.005)
        agents = [p for p in node.pids() if _comm(p).startswith("python")]
        assert agents, f"no node program on {node.name}"
        for pid in agents:
            os.kill(pid, signal.SIGSTOP)
        bed.cut_link(node)
        for pid in agents:
            os.kill(pid, signal.SIGCONT)
        yield agents
    finally:
        bed.restore_link(node)
        for pid in agents:
            if _alive(pid):  # (the test's own leftovers, whatever happened)
                os.kill(pid, signal.SIGKILL)


def all_ended(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while [p for p in pids if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.5)
    return not [p for p in pids if _alive(p)]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def bare_bed() -> Iterator[tb.Testbed]:
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


def test_cli_push_onto_bare_nodes_then_nothing_moves(bare_bed: tb.Testbed, tmp_path: Path,
                                                      cli, monkeypatch) -> None:
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True,
                   timeout=30)
    home = f"/home/{USER}"
    for node in bare_bed.nodes:
        ok = bare_bed.root_exec(node, "sh", "-c", f"install -d -m 700 -o {USER} -g {USER} "
                                f"{home}/.ssh && cat > {home}/.ssh/authorized_keys && chown "
                                f"{USER}:{USER} {home}/.ssh/authorized_keys && chmod 600 "
                                f"{home}/.ssh/authorized_keys",
                                input=(tmp_path / "id_ed25519.pub").read_text())
        assert ok.returncode == 0, ok.stderr
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("nodes:\n" + "".join(f"  - {{host: {n.name}, slots: 1}}\n"
                                             for n in bare_bed.nodes)
                       + "python: /usr/bin/python3\n"
                       f"ssh: {{user: {USER}, identity_file: {key}, config_file: "
                       f"{bare_bed.ssh_config}}}\n")
    src = dataset(tmp_path, files=12, size=1 << 20)
    dest = f"{home}/data"
    code, out, err = cli("push", "--cluster", str(cluster), str(src), "--to", dest)
    assert code == 0, err
    for node in bare_bed.nodes:  # each node's own root: its own copy
        assert digests(bare_bed.node_root(node) / dest.lstrip("/")) == digests(src)
    code, out, err = cli("push", "--json", "--cluster", str(cluster), str(src), "--to", dest)
    assert code == 0 and json.loads(out)["bytes_sent"] == 0, (out, err)
    (src / "shard-1" / "part-001.bin").write_bytes(os.urandom(1000))
    code, out, err = cli("push", "--json", "--cluster", str(cluster), str(src), "--to", dest)
    got = json.loads(out)
    assert code == 0 and got["bytes_sent"] == 1000 * len(bare_bed.nodes), (out, err)
    assert {n["files"] for n in got["nodes"]} == {1}, got  # (the changed file, on each)
    for node in bare_bed.nodes:
        assert digests(bare_bed.node_root(node) / dest.lstrip("/")) == digests(src)

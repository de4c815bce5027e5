"""``ptcluster push`` on local "nodes" (each its own folder): the real node program over real
channels; incremental by content, verified, temp names, bad input and a node lost mid-push."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ptcluster.push.scan import scan
from ptcluster.push.send import FAILED, PUSHED, UP_TO_DATE, Progress, PushResult, push
from ptcluster.remote.group import Member
from ptcluster.remote.transport import LocalTransport


def members(tmp: Path, *hosts: str, python: str = sys.executable) -> list[Member]:
    return [Member(h, LocalTransport(h), python, {"dest": str(tmp / f"dest-{h}" / "data")})
            for h in hosts]


def digests(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()
            and not p.name.startswith(".ptcluster")}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def dataset(root: Path, files: int = 12, size: int = 300_000) -> Path:
    src = root / "src"
    for i in range(files):
        path = src / f"shard-{i // 5}" / f"part-{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size + i))
    return src


def test_push_then_nothing_then_one_file_then_delete(tmp_path: Path) -> None:
    src = dataset(tmp_path)
    nodes = members(tmp_path, "n1", "n2", "n3")
    said: list[Progress] = []
    first = push(nodes, scan(src), on_event=said.append)
    assert first.ok, first.failed
    assert {n.state for n in first.nodes.values()} == {PUSHED}
    assert first.bytes_sent == 3 * first.size and first.files == 12
    for host in ("n1", "n2", "n3"):  # every file, by digest, on every node
        assert digests(tmp_path / f"dest-{host}" / "data") == digests(src)
        assert not list((tmp_path / f"dest-{host}").rglob(".ptcluster-part-*"))
    assert sorted(p.host for p in said if p.final) == ["n1", "n2", "n3"]

    second = push(nodes, scan(src))
    assert {n.state for n in second.nodes.values()} == {UP_TO_DATE}
    assert second.bytes_sent == 0

    changed = src / "shard-1" / "part-005.bin"
    changed.write_bytes(os.urandom(1000))
    (tmp_path / "dest-n2" / "data" / "extra.txt").write_text("the node's own\n")
    third = push(nodes, scan(src))
    assert third.ok and third.bytes_sent == 3 * 1000
    assert {n.files_sent for n in third.nodes.values()} == {1}
    assert (tmp_path / "dest-n2" / "data" / "extra.txt").exists()  # kept without --delete
    fourth = push(nodes, scan(src), delete=True)
    assert fourth.bytes_sent == 0 and fourth.nodes["n2"].deleted == 1
    assert digests(tmp_path / "dest-n2" / "data") == digests(src)


def test_a_copy_changed_on_a_node_is_sent_again(tmp_path: Path) -> None:
    src = dataset(tmp_path, files=3)
    nodes = members(tmp_path, "n1", "n2")
    assert push(nodes, scan(src)).ok
    damaged = tmp_path / "dest-n1" / "data" / "shard-0" / "part-001.bin"
    damaged.write_bytes(b"x" * damaged.stat().st_size)  # same size, a new mtime
    again = push(nodes, scan(src))
    assert again.ok and again.nodes["n1"].files_sent == 1 and again.nodes["n2"].files_sent == 0
    assert digests(tmp_path / "dest-n1" / "data") == digests(src)


def test_a_node_lost_mid_push_is_named_and_the_others_complete(tmp_path: Path) -> None:
    src = dataset(tmp_path, files=4, size=2_000_000)
    dying = tmp_path / "dying-python"  # the node's agent killed (SIGXFSZ) past its first MiB
    dying.write_text(f"#!/bin/sh\nulimit -f 1024\nexec {sys.executable} \"$@\"\n")
    dying.chmod(0o755)
    nodes = [*members(tmp_path, "n1", "n3"), *members(tmp_path, "n2", python=str(dying))]
    done = push(nodes, scan(src))
    assert set(done.failed) == {"n2"} and done.nodes["n2"].state == FAILED
    problem = done.nodes["n2"].problem
    assert problem is not None and problem.who == "n2"
    for host in ("n1", "n3"):
        assert digests(tmp_path / f"dest-{host}" / "data") == digests(src)
    n2 = tmp_path / "dest-n2" / "data"
    # (the killed agent's temp file may stay; never a partial file under its final name)
    finals = [p for p in n2.rglob("*.bin")]
    for p in finals:
        assert digests(n2)[p.relative_to(n2).as_posix()] == digests(src)[
            p.relative_to(n2).as_posix()]
    again = push(members(tmp_path, "n2"), scan(src))  # the next push removes its leftovers
    assert again.ok and not list(n2.rglob(".ptcluster-part-*"))
    assert digests(n2) == digests(src)


def test_cli_push_to_dest_then_nothing_moves(cli, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no cluster file: this machine, reached without ssh
    monkeypatch.delenv("PTCLUSTER_CLUSTER", raising=False)
    src = dataset(tmp_path, files=5)
    dest = tmp_path / "there"
    code, out, err = cli("push", str(src), "--to", str(dest))
    assert code == 0, err
    size = sum(p.stat().st_size for p in src.rglob("*.bin"))
    assert re.fullmatch(  # the one rendering of push's outcome (its --json: below)
        rf"ptcluster: push: 5 file\(s\), {size / 1e6:.1f} MB to 1 of 1 node\(s\); "
        r"[0-9]+ bytes sent in [0-9]+\.[0-9] s\n", out), out
    assert digests(dest) == digests(src)
    for args in (("--to", str(dest)), ()):  # (no --to: the same absolute path, here itself)
        code, out, err = cli("push", "--json", str(src), *args)
        assert code == 0 and err == "", err
        got = json.loads(out)
        assert (got["ok"], got["files"], got["bytes_sent"]) == (True, 5, 0), got
        assert [(n["host"], n["state"], n["files"]) for n in got["nodes"]] == [
            ("localhost", UP_TO_DATE, 0)], got


def test_cli_bad_input(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PTCLUSTER_CLUSTER", raising=False)
    code, out, err = cli("push", str(tmp_path / "nothing-here"), "--to", str(tmp_path / "d"))
    assert code == 2 and cli.problem.code == "push.src-missing", err
    assert cli.problem.fields == {"src": str(tmp_path / "nothing-here")}
    src = dataset(tmp_path, files=2)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    code, out, err = cli("push", str(src), "--to", str(blocker / "data"))
    assert code == 1 and f"{blocker / 'data'} is not writable here" in err, err
    code, out, err = cli("push", "--json", str(src), "--to", str(blocker / "data"))
    (node,) = json.loads(out)["nodes"]
    assert code == 1 and (node["state"], node["problem"]["code"]) == (
        FAILED, "push.dest-unwritable"), node
    assert node["problem"]["fields"]["dest"] == str(blocker / "data"), node


@pytest.mark.skipif(os.geteuid() != 0, reason="the full disk is a small tmpfs: root mounts it")
def test_cli_full_disk_names_path_and_free_space_and_keeps_the_old_version(
        cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PTCLUSTER_CLUSTER", raising=False)
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], check=True)
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "big.bin").write_bytes(os.urandom(500_000))
        code, out, err = cli("push", str(src), "--to", str(small / "data"))
        assert code == 0, err
        old = (small / "data" / "big.bin").read_bytes()
        (src / "big.bin").write_bytes(os.urandom(3_000_000))
        code, out, err = cli("push", str(src), "--to", str(small / "data"))
        assert code == 1 and f"the disk is full at {small / 'data'}" in err, err
        (node,) = push([Member("n1", LocalTransport("n1"), sys.executable,
                               {"dest": str(small / "data")})], scan(src)).failed.values()
        assert node.problem is not None and node.problem.code == "push.no-room"
        fields = node.problem.fields
        assert (fields["dest"], fields["need"]) == (str(small / "data"), "3000000")
        assert 0 <= int(fields["free"]) < 3_000_000
        assert (small / "data" / "big.bin").read_bytes() == old
        assert not list(small.rglob(".ptcluster-part-*"))
    finally:
        subprocess.run(["umount", str(small)], check=True)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_ctrl_c_leaves_no_partial_file_and_no_process(tmp_path: Path) -> None:
    from tests.support.head import Head

    src = dataset(tmp_path, files=6, size=15_000_000)
    dest = tmp_path / "there"
    head = Head(["push", str(src), "--to", str(dest)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not list(dest.rglob(".ptcluster-part-*")) and time.monotonic() < deadline:
            assert head.proc.poll() is None, head.output()
            time.sleep(0.01)
        agents = _children(head.proc.pid)
        assert agents, "the node program runs as the head's child"
        head.signal(signal.SIGINT)
        code = head.wait(60)
    finally:
        head.kill()
    assert code == 130, head.output()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in agents) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in agents if _alive(p)]
    assert not list(dest.rglob(".ptcluster-part-*"))
    theirs, ours = digests(dest), digests(src)
    assert len(theirs) < len(ours)  # interrupted: some files not there, and those there whole
    assert all(ours[p] == d for p, d in theirs.items())


def relay_members(tmp: Path, count: int, *, python: dict[str, str] | None = None) -> list[Member]:
    """Local nodes that reach each other on 127.0.0.1: the relay's chain among them."""
    return [Member(h, LocalTransport(h), (python or {}).get(h, sys.executable),
                   {"dest": str(tmp / f"dest-{h}" / "data"), "addr": "127.0.0.1"})
            for h in (f"n{i}" for i in range(1, count + 1))]


def test_relay_head_sends_each_byte_once_every_node_verified(tmp_path: Path) -> None:
    src = dataset(tmp_path, files=10, size=400_000)
    nodes = relay_members(tmp_path, 5)
    (tmp_path / "dest-n3" / "data").mkdir(parents=True)  # n3 has one file already
    first_file = sorted(digests(src))[0]
    (tmp_path / "dest-n3" / "data" / first_file).parent.mkdir(parents=True)
    (tmp_path / "dest-n3" / "data" / first_file).write_bytes((src / first_file).read_bytes())
    done = push(nodes, scan(src))
    assert done.ok, done.failed
    assert done.chain == ["n1", "n2", "n3", "n4", "n5"]
    assert done.bytes_sent == done.size  # the head's egress: once, to n1
    assert done.nodes["n1"].bytes_sent == done.size and done.nodes["n5"].bytes_sent == 0
    assert done.nodes["n3"].files == 9 and done.nodes["n5"].files == 10
    for i in range(1, 6):
        assert digests(tmp_path / f"dest-n{i}" / "data") == digests(src)
    again = push(nodes, scan(src))
    assert again.ok and again.bytes_sent == 0
    assert {n.state for n in again.nodes.values()} == {UP_TO_DATE}


def test_bytes_that_are_not_the_listed_digest_are_refused_on_every_node(tmp_path: Path) -> None:
    # 3 nodes relay by default. A file of several MiB (many chunks, streamed without a rest)
    # changed after the head hashed it: every node refuses it (no file under its name, no temp
    # file left), names it, and takes the rest; the head's resend after the chain refuses too.
    src = dataset(tmp_path, files=5, size=300_000)
    big = src / "shard-0" / "big.bin"
    big.write_bytes(os.urandom(6 << 20))
    listing = scan(src)
    with open(big, "r+b") as f:  # one byte of the fourth MiB, the size kept
        f.seek(3 << 20)
        byte = f.read(1)
        f.seek(3 << 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    (listed,) = [f.sha256 for f in listing.files if f.path == "shard-0/big.bin"]
    nodes = relay_members(tmp_path, 3)
    done = push(nodes, listing)
    assert done.chain == ["n1", "n2", "n3"]
    assert set(done.failed) == {"n1", "n2", "n3"}
    for host, node in done.nodes.items():
        assert node.problem is not None and node.problem.who == host
        assert node.problem.code == "file.damaged", node.problem
        assert node.problem.what.startswith("shard-0/big.bin: "), node.problem.what
        assert node.problem.fields == {"name": "big.bin", "got": sha256(big)[:12],
                                       "want": listed[:12]}
        dest = tmp_path / f"dest-{host}" / "data"
        assert not (dest / "shard-0" / "big.bin").exists()
        assert not list(dest.rglob(".ptcluster-part-*"))
        want = {p: d for p, d in digests(src).items() if p != "shard-0/big.bin"}
        assert digests(dest) == want


def test_relay_a_middle_node_lost_the_rest_get_it_from_the_head(tmp_path: Path) -> None:
    src = dataset(tmp_path, files=4, size=2_000_000)
    dying = tmp_path / "dying-python"  # n3's agent killed (SIGXFSZ) past its first MiB
    dying.write_text(f"#!/bin/sh\nulimit -f 1024\nexec {sys.executable} \"$@\"\n")
    dying.chmod(0o755)
    nodes = relay_members(tmp_path, 5, python={"n3": str(dying)})
    done = push(nodes, scan(src))
    assert set(done.failed) == {"n3"}, done.failed
    assert done.chain == ["n1", "n2", "n3", "n4", "n5"]
    for host in ("n1", "n2", "n4", "n5"):
        assert digests(tmp_path / f"dest-{host}" / "data") == digests(src), host
    # the head sent the set once to n1, then to n4 and n5 what the broken chain left out
    assert done.size < done.bytes_sent <= 3 * done.size


def test_relay_listener_refuses_a_stranger_and_a_wrong_secret(tmp_path: Path) -> None:
    from ptcluster.node.data_relay import Listener, connect

    listener = Listener("127.0.0.1", "s" * 64, "127.0.0.1")
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(listener.accept()))
    thread.start()
    wrong = connect("127.0.0.1", listener.port, "t" * 64)
    right = connect("127.0.0.1", listener.port, "s" * 64)
    thread.join(10)
    conn = got[0]
    assert conn is not None and listener.refused == 1
    wrong.settimeout(5)
    assert wrong.recv(1) == b""  # closed by the listener
    right.sendall(b"x")
    assert conn.recv(1) == b"x"  # type: ignore[attr-defined]
    for c in (wrong, right, conn):
        c.close()  # type: ignore[attr-defined]


REPO = Path(__file__).resolve().parents[2]


def pid_python(tmp: Path, host: str) -> str:
    """An interpreter for ``host``'s node program that leaves the program's pid in
    ``tmp/pid-HOST`` (``exec``: the same process)."""
    wrapper = tmp / f"python-{host}"
    wrapper.write_text(f"#!/bin/sh\necho $$ > {tmp / f'pid-{host}'}\n"
                       f"exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def _held(folder: Path, starts: float = 60.0) -> None:
    """Wait until a file is on its way into ``folder`` (its temp name is there)."""
    deadline = time.monotonic() + starts
    while not list(folder.rglob(".ptcluster-part-*")):
        assert time.monotonic() < deadline, f"no file began to arrive in {folder}"
        time.sleep(0.005)


def silent_head(tmp: str) -> None:
    """The head of the next test, in a process of its own: pushes ``tmp/src`` to n1, whose
    program gives up after 3 s of silence from the head."""
    root = Path(tmp)
    (member,) = members(root, "n1", python=pid_python(root, "n1"))
    member.config["silence"] = 3.0
    push([member], scan(root / "src"))


def test_a_push_whose_head_goes_silent_ends_without_eof(tmp_path: Path) -> None:
    """A link cut mid-push: the node sees silence, never EOF (its sshd keeps the session). n1's
    program is held (SIGSTOP) in the middle of a file and the head stopped (its pipes open, as
    behind a cut link); once n1 goes on it ends by itself after the silence, its temp file
    removed, the file never in place under its name."""
    dataset(tmp_path, files=1, size=200_000_000)
    head = subprocess.Popen([sys.executable, "-c", "import sys; from tests.local.test_push "
                             "import silent_head; silent_head(sys.argv[1])", str(tmp_path)],
                            cwd=REPO, start_new_session=True)
    dest = tmp_path / "dest-n1" / "data"
    agent = 0
    try:
        _held(dest)
        agent = int((tmp_path / "pid-n1").read_text())
        os.kill(agent, signal.SIGSTOP)
        os.kill(head.pid, signal.SIGSTOP)  # silent, its pipes open
        os.kill(agent, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while _alive(agent) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _alive(agent)
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(10)
        if agent and _alive(agent):  # (this test's own leftover, whatever happened above)
            os.kill(agent, signal.SIGKILL)
    assert not left, "n1's program still runs after 20 s of the head's silence"
    assert not list(dest.rglob(".ptcluster-part-*"))
    assert not (dest / "shard-0" / "part-000.bin").exists()


def test_a_stalled_relay_is_not_taken_for_a_silent_head(tmp_path: Path) -> None:
    """The heartbeats raise no false alarm: n3, the chain's last node, is held (SIGSTOP) for
    8 s in the middle of the set, while n1 and n2 give up after 3 s of silence from the head.
    n2 waits on its send to n3 and n1 on its send to n2 (the head on its write to n1), yet
    neither takes that for a silent head: the push completes on all three once n3 goes on."""
    src = dataset(tmp_path, files=3, size=16_000_000)
    nodes = relay_members(tmp_path, 3, python={"n3": pid_python(tmp_path, "n3")})
    for node in nodes:
        node.config["silence"] = 60.0 if node.host == "n3" else 3.0
    got: list[PushResult] = []
    pushing = threading.Thread(target=lambda: got.append(push(nodes, scan(src))), daemon=True)
    pushing.start()
    _held(tmp_path / "dest-n3" / "data")
    agent = int((tmp_path / "pid-n3").read_text())
    os.kill(agent, signal.SIGSTOP)
    try:
        time.sleep(8.0)  # (the hold itself: more than twice the others' silence)
    finally:
        os.kill(agent, signal.SIGCONT)
    pushing.join(120)
    assert got, "the push did not end"
    assert got[0].ok, got[0].failed
    assert got[0].chain == ["n1", "n2", "n3"]
    for host in ("n1", "n2", "n3"):
        assert digests(tmp_path / f"dest-{host}" / "data") == digests(src), host

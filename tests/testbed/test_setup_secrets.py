"""What a hostile or careless node gets from ``ptcluster setup``, on bare nodes with real sudo:
the password only where sudo asks for it, and only at sudo's prompt; nothing of a node's
hostname that is not a DNS name in any node's ``/etc/hosts``.

Five nodes: n0 sudoes without a password; n1 needs the password except for ``sh``, which its
sudoers lets run without one (a command that never reads a password prompt); n2 needs the
password (and knows the head's key); n3 says its hostname is ``n3`` and a second line (a
compromised node); n4 is no sudoer (and knows the head's key). Each node's ``python3`` is a
wrapper that keeps a copy of what the setup program reads on its stdin. Only the ``/etc/hosts``
step is planned and applied (the others are tested in test_setup.py).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ptcluster.cluster import parse_cluster_text
from ptcluster.setup import plan as P
from ptcluster.setup import steps as S
from ptcluster.setup.apply import run_setup
from ptcluster.setup.options import SetupOptions
from ptcluster.setup.report import NodeSetupOutcome
from ptcluster.setup.secret import Secret
from tests.support import bare
from tests.support import testbed as tb
from tests.support.bare import BareNode, BareOptions
from tests.support.testbed import available

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
EVIL = "n3\n10.6.6.6 mirror.example"
SPY = ("#!/bin/sh\n# a copy of what the setup program reads (its stdin)\n"
       "tee -a \"$HOME/agent-stdin.log\" 2>/dev/null | /usr/bin/python3 \"$@\"\n")


@pytest.fixture(scope="module")
def bed():
    b = tb.bring_up("bare-node testbed", available() or bare.available(), lambda: tb.Testbed(
        5, bare=BareOptions(nodes=(BareNode(sudo="nopasswd"), BareNode(sudo="password"),
                                   BareNode(sudo="password"), BareNode(sudo="password"),
                                   BareNode(sudo="none")))))
    try:
        for node in b.nodes:
            assert b.root_exec(node, "sh", "-c", "cat > /usr/local/bin/python3 && chmod 755 "
                               "/usr/local/bin/python3", input=SPY).returncode == 0
        n1 = b.nodes[1]
        # (named to sort after ptc-testbed, whose "ALL" needs the password: the last match wins)
        said = b.root_exec(n1, "sh", "-c", "umask 337 && cat > /etc/sudoers.d/ptc-z-sh",
                           input=f"{bare.USER} ALL=(root) NOPASSWD: /usr/bin/sh, /bin/sh\n")
        assert said.returncode == 0, said.stderr
        said = b.root_exec(b.nodes[3], "/usr/bin/python3", "-c", "import socket, sys; "
                           "socket.sethostname(sys.argv[1])", EVIL)  # (hostname(1) refuses)
        assert said.returncode == 0, said.stderr
        b.trust_host_keys()
        key = b.dir / "head_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                       check=True, timeout=30)
        for node in (b.nodes[2], b.nodes[4]):
            said = b.root_exec(node, "sh", "-c", f"d=/home/{bare.USER}/.ssh && mkdir -p $d && "
                               "cat > $d/authorized_keys && chmod 700 $d && chmod 600 "
                               f"$d/authorized_keys && chown -R {bare.USER} $d",
                               input=key.with_suffix(".pub").read_text())
            assert said.returncode == 0, said.stderr
        yield b
    finally:
        b.close()


def stdin_of(bed: tb.Testbed, i: int) -> bytes:
    path = bed.node_root(bed.nodes[i]) / "home" / bare.USER / "agent-stdin.log"
    return path.read_bytes() if path.exists() else b""


def setup(bed: tb.Testbed, tmp_path: Path, nodes: list[int], password: str,
          dry_run: bool = False) -> dict[int, NodeSetupOutcome]:
    """``ptcluster setup`` of ``nodes`` (the library: its own steps cut to /etc/hosts) with
    ``password`` given (as --password-file does); each node's outcome."""
    spec = parse_cluster_text(
        "nodes:\n" + "".join(f"  - host: {bed.nodes[i].name}\n" for i in nodes) +
        f"ssh: {{config_file: {bed.ssh_config}, identity_file: {bed.dir / 'head_key'}}}\n",
        str(tmp_path / "c.yaml"), trusted=True)  # (the testbed's own ssh config)
    report = run_setup(spec, SetupOptions(dry_run=dry_run), password=lambda: Secret(password),
                       known_password=Secret(password))
    return {i: report.nodes[bed.nodes[i].name] for i in nodes}


def test_the_password_goes_to_sudos_prompt_only_and_a_bad_hostname_nowhere(
        bed: tb.Testbed, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(P, "STEP_DEFS", tuple(d for d in P.STEP_DEFS if d.name == "/etc/hosts"))
    outcome = setup(bed, tmp_path, [0, 1, 2, 3], bare.PASSWORD)
    pw = bare.PASSWORD.encode()
    # n0 sudoes without a password: it never gets it; n1 and n2 (sudo asks) do
    assert [pw in stdin_of(bed, i) for i in range(3)] == [False, True, True]
    for i in range(3):
        assert outcome[i].problem is None and outcome[i].converged, (i, outcome[i].to_json())
        hosts = (bed.node_root(bed.nodes[i]) / "etc" / "hosts").read_text()
        # n1's sh ran without a prompt: before, the password was the first line of its input,
        # the new /etc/hosts
        assert bare.PASSWORD not in hosts, i
        assert f"{bed.nodes[1].addr} {bed.nodes[1].name}" in hosts
        # n3's name is not a DNS name: refused there, and no line of it anywhere
        assert "10.6.6.6" not in hosts and "mirror.example" not in hosts, hosts
    said = outcome[3].problem
    assert said is not None and said.code == "node.hostname-refused", said
    assert said.fields == {"hostname": EVIL}, said
    assert b"10.6.6.6" not in b"".join(
        (bed.node_root(n) / "etc" / "hosts").read_bytes() for n in bed.nodes[:3])
    assert os.path.exists(bed.node_root(bed.nodes[3]) / "etc" / "hosts")


def test_sudos_refusals_are_told_apart_at_its_prompt(bed: tb.Testbed, tmp_path: Path,
                                                    monkeypatch) -> None:
    # the password goes to sudo's prompt, not before it: a wrong one is still a wrong one, a
    # user who is no sudoer is still told so (key logins: the password is for sudo only)
    monkeypatch.setattr(P, "STEP_DEFS", tuple(d for d in P.STEP_DEFS if d.name in ("sudo",)))
    outcome = {**setup(bed, tmp_path, [2], "not-the-password", dry_run=True),
               **setup(bed, tmp_path, [4], bare.PASSWORD, dry_run=True)}
    sudo = {i: {s.name: s for s in o.before}["sudo"] for i, o in outcome.items()}
    assert outcome[2].connection == outcome[4].connection == "key"
    assert sudo[2].status == S.BLOCKED and sudo[2].why == "sudo refused the password"
    assert sudo[2].problem is not None and sudo[2].problem.code == "setup.sudo-refused-password"
    assert sudo[4].status == S.BLOCKED
    assert sudo[4].why == f"{bare.USER} is not in the sudoers file", sudo[4].why
    assert sudo[4].problem is not None and (sudo[4].problem.code, sudo[4].problem.fields) == (
        "setup.no-sudo", {"why": f"{bare.USER} is not in the sudoers file"})

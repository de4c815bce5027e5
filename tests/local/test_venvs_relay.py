"""The project's environment through the relay (issue 42, ``remote.relay``): from 3 nodes the
head sends each wheel once, to the chain's first node, and each node stores it and passes it on;
a node lost in the chain is named and the nodes after it get what they lack from the head.
Real node programs over real channels; local "nodes" (each its own ptcluster directory) that
reach each other on 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ptcluster.remote.group import Member
from ptcluster.remote.transport import LocalTransport
from ptcluster.venvs.ship import BUILT, UP_TO_DATE, ship
from tests.local.test_venvs import UV, Wheels, in_env

pytestmark = pytest.mark.skipif(UV is None, reason="no uv wheel at hand (PTC_UV_WHEEL)")


def relay_nodes(tmp: Path, *, python: dict[str, str] | None = None) -> list[Member]:
    return [Member(h, LocalTransport(h), (python or {}).get(h, sys.executable),
                   {"root": str(tmp / f"root-{h}"), "addr": "127.0.0.1"})
            for h in ("n1", "n2", "n3")]


@pytest.fixture
def wheels(tmp_path: Path) -> Wheels:
    (tmp_path / "wheels").mkdir()
    return Wheels(tmp_path / "wheels")


def test_the_head_sends_each_wheel_once_every_node_builds(tmp_path: Path, wheels) -> None:
    a, b = wheels.make("tinya", "1.0"), wheels.make("tinyb", "2.0", padding=3 << 20)
    members = relay_nodes(tmp_path)
    # n2 has tinya (and uv) already, from an environment of its own
    alone = ship(members[1:2], lambda p: wheels.env(a), wheels.locate)
    assert alone.ok and alone.chain == [], alone.failed
    kept = tmp_path / "root-n2" / "store" / "sha256" / a.sha256
    inode = kept.stat().st_ino
    env = wheels.env(a, b)
    everything = sum(w.size for w in (*env.wheels, *env.tools))
    first = ship(members, lambda p: env, wheels.locate)
    assert first.ok, first.failed
    assert first.chain == ["n1", "n2", "n3"]
    assert {n.state for n in first.nodes.values()} == {BUILT}
    # what the head wrote on its channels: each wheel's bytes once (to n1), none to n2 or n3
    assert first.bytes_sent == everything
    assert first.nodes["n1"].bytes_sent == everything
    assert first.nodes["n2"].wheels_sent == 0 and first.nodes["n2"].wheels == 1
    assert first.nodes["n3"].wheels_sent == 0 and first.nodes["n3"].wheels == 3
    assert kept.stat().st_ino == inode  # (a wheel n2 had: passed on, not written again)
    for host in ("n1", "n2", "n3"):
        python = str(first.nodes[host].python)
        assert in_env(python, "import tinya, tinyb; print(tinya.VERSION, tinyb.VERSION)") \
            == "1.0 2.0", host
        assert not list((tmp_path / f"root-{host}").rglob(".ptcluster-part-*"))
    again = ship(members, lambda p: env, wheels.locate)
    assert again.ok and again.bytes_sent == 0
    assert {n.state for n in again.nodes.values()} == {UP_TO_DATE}


def test_a_middle_node_lost_is_named_the_next_gets_its_wheels_from_the_head(
        tmp_path: Path, wheels) -> None:
    a, b = wheels.make("tinya", "1.0"), wheels.make("tinyb", "2.0", padding=3 << 20)
    env = wheels.env(a, b)
    everything = sum(w.size for w in (*env.wheels, *env.tools))
    # n2's node program killed (SIGXFSZ, which Python ignores unless told) past its first
    # half MiB written: in the middle of a wheel, a part of it passed on to n3 already
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n")
    dying = tmp_path / "dying-python"
    dying.write_text(f"#!/bin/sh\nulimit -f 1024\nPYTHONPATH={tmp_path / 'site'} exec "
                     f"{sys.executable} \"$@\"\n")
    dying.chmod(0o755)
    done = ship(relay_nodes(tmp_path, python={"n2": str(dying)}), lambda p: env, wheels.locate)
    assert done.chain == ["n1", "n2", "n3"]
    assert set(done.failed) == {"n2"}, done.failed
    lost = done.nodes["n2"]
    assert lost.problem is not None and lost.problem.who == "n2"
    for host in ("n1", "n3"):
        assert done.nodes[host].state == BUILT, done.nodes[host]
        assert in_env(str(done.nodes[host].python), "import tinyb; print(tinyb.VERSION)") \
            == "2.0"
    # the set once to n1, then to n3 what the broken chain left out (from the head)
    assert 0 < done.nodes["n3"].bytes_sent <= everything
    assert everything < done.bytes_sent <= 2 * everything
    assert not list((tmp_path / "root-n2" / "envs").glob(env.digest))

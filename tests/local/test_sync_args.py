"""``sync`` to a workdir whose name the node's shell would read as words: a real rsync through
a stand-in for ssh that does what sshd does with a command (hand it, joined, to the login
shell: ``sh -c``), on this machine."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ptcluster.cluster.model import NodeSpec
from ptcluster.remote.sync import sync_node

SSH = """#!/bin/sh
printf '%s\\n' "$*" >> "$NODE_LOG"
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break;;
    -o|-F|-i|-p|-l|-e) shift 2;;
    -*) shift;;
    *) break;;
  esac
done
shift
cd "$NODE_HOME" && exec sh -c "$*"
"""


def test_a_workdir_with_a_space_and_a_semicolon_is_a_name_not_a_command(
        tmp_path: Path, monkeypatch) -> None:
    # rsync < 3.2.4 (Ubuntu 22.04's 3.2.3, 20.04's 3.1.3) hands the remote path to the node's
    # shell; RSYNC_OLD_ARGS=1 makes this machine's rsync do the same. Before: `touch PWNED` ran
    # on the "node" and the project went to a directory named "d x".
    if shutil.which("rsync") is None:
        pytest.skip("no rsync here")
    bin_dir, home, project = tmp_path / "bin", tmp_path / "home", tmp_path / "project"
    for d in (bin_dir, home, project):
        d.mkdir()
    (bin_dir / "ssh").write_text(SSH)
    (bin_dir / "ssh").chmod(0o755)
    (project / "a.txt").write_text("hello\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("NODE_HOME", str(home))
    monkeypatch.setenv("NODE_LOG", str(tmp_path / "argv.log"))
    monkeypatch.setenv("RSYNC_OLD_ARGS", "1")
    workdir = "~/d x;touch PWNED #"
    node = NodeSpec(host="node1", python="python3", workdir=workdir)
    result = sync_node(node, project, ["a.txt"], timeout=60)
    assert result.problem is None, result.problem
    assert result.method == "rsync"
    assert not (home / "PWNED").exists()
    assert (home / "d x;touch PWNED #" / "a.txt").read_text() == "hello\n"
    assert sorted(os.listdir(home)) == ["d x;touch PWNED #"]

"""Files sent by digest (``node.blobs``): the temp files of a store that many programs share."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from ptcluster.node.blobs import PART_PREFIX, part_name, remove_parts


def test_a_program_removes_its_own_temp_files_and_the_deads_never_another_live_ones(
        tmp_path) -> None:
    """The wheel store is shared by every build program of the user: one that ends on the
    head's silence removes the file it was receiving; one that starts removes what this host's
    programs killed mid-file left; a live program's file is never touched, nor another host's
    (a home shared by several machines)."""
    dead = int(open("/proc/sys/kernel/pid_max").read()) + 1  # (never a live pid)
    mine = Path(part_name(str(tmp_path / "a.whl")))
    host = socket.gethostname()
    other = tmp_path / f"{PART_PREFIX}{os.getppid()}~{host}~0000~b.whl"  # (a live program's)
    gone = tmp_path / f"{PART_PREFIX}{dead}~{host}~0000~c.whl"
    elsewhere = tmp_path / f"{PART_PREFIX}{dead}~other-host~0000~e.whl"  # (a shared home)
    kept = tmp_path / "d.whl"
    for path in (mine, other, gone, elsewhere, kept):
        path.write_bytes(b"x")
    remove_parts(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [other.name, gone.name, elsewhere.name, "d.whl"])
    remove_parts(str(tmp_path), dead_too=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [other.name, elsewhere.name, "d.whl"])

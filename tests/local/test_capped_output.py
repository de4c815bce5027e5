"""What a node's side of a command prints is read with a cap (L4): `sync`'s and setup's tar
pipe and sync's ssh and rsync keep the last 64 KiB of each stream, whatever the node sends."""

from __future__ import annotations

import resource
from pathlib import Path

from ptcluster.remote import capped
from ptcluster.remote.sync import tar_pipe

MIB = 1 << 20


def test_a_receiver_that_streams_hundreds_of_mib_costs_the_head_64_kib(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    hostile = ["sh", "-c", "cat >/dev/null; head -c 268435456 /dev/zero; echo END; "
               "head -c 67108864 /dev/zero >&2; echo LAST >&2; exit 5"]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # (KiB)
    got = tar_pipe(tmp_path, b"f\0", hostile, timeout=120)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert got.returncode == 5
    assert len(got.stdout) == capped.CAP and got.stdout.endswith(b"\0END\n")
    assert len(got.stderr) == capped.CAP and got.stderr.endswith(b"LAST\n")
    assert grown * 1024 < 32 * MIB, f"the head grew by {grown} KiB"


def test_rsyncs_names_are_counted_whole_past_the_cap() -> None:
    names = "".join(f"d{i}/\nd{i}/file-{i}\n" for i in range(20_000)).encode()  # (~400 KB)
    got = capped.run(["cat"], timeout=60, stdin=names)
    assert got.returncode == 0 and got.stdout_lines == 20_000
    assert len(got.stdout) == capped.CAP


def test_input_goes_in_and_a_short_output_comes_back_whole() -> None:
    got = capped.run(["sh", "-c", "cat; echo err >&2"], timeout=60, stdin=b"a\nb/\n")
    assert (got.stdout, got.stderr, got.stdout_lines) == (b"a\nb/\n", b"err\n", 1)

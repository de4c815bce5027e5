"""The health gate on a real node (this machine): a workdir on a tiny tmpfs, filled up, is
refused before any rank starts, with its free space and the fix."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

from tests.support.head import only_run, run_head

pytestmark = pytest.mark.slow

HELLO = textwrap.dedent("""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print("started", flush=True)
    dist.destroy_process_group()
""")


@pytest.fixture
def full_tmpfs(tmp_path):
    """A 16 MiB tmpfs with the job's script on it, then filled to the last block (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "hello.py").write_text(HELLO)
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, b"\0" * (1 << 16)):
                pass
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_workdir_disk_is_refused_before_any_rank_starts(tmp_path, full_tmpfs,
                                                               no_leftovers) -> None:
    runs = tmp_path / "runs"
    code, head = run_head(["run", "--nproc", "2", "--run-dir", str(runs), "hello.py"],
                          cwd=full_tmpfs, timeout=120)
    job_id, summary = only_run(runs)
    no_leftovers.append(job_id)
    err = "\n".join(head.err)
    assert code == 1, head.output()
    cause = summary["root_cause"]
    assert (cause["kind"], cause["code"]) == ("unhealthy", "health.workdir-disk-full"), cause
    assert cause["fields"]["path"] == str(full_tmpfs) and cause["fields"]["free"] == "0 MiB"
    # the console says it once, as the one rendering (who: what. Fix: how), and its code
    assert f"Root cause (first observed failure): localhost: {cause['message']}. " \
           f"Fix: {cause['fix']}" in err, head.output()
    assert f"  code {cause['code']}" in head.err
    assert all(r["status"] == "not started" for r in summary["ranks"])
    assert "started" not in head.lines

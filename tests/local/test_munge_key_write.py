"""L6: root writes the munge key into a directory the munge account owns. The real program
setup runs (``setup.slurm_steps.KEY_ARGV``) is run here as root on a stand-in for ``/etc/munge``
(owned by ``nobody``, who plays a compromised munge account and plants links at every name it
can guess): the key lands, 0400 and the owner's, and no link is written through or
``chown``ed."""

from __future__ import annotations

import base64
import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from ptcluster.setup.slurm_steps import KEY_ARGV

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="root writes the key")
KEY = bytes(range(256)) * 4


def test_the_key_is_written_through_descriptors_never_a_planted_link(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    folder = tmp_path / "munge"
    folder.mkdir(mode=0o700)
    os.chown(folder, nobody.pw_uid, nobody.pw_gid)
    victim = tmp_path / "root-file"
    victim.write_text("root's\n")
    victim.chmod(0o600)
    for name in ("munge.key.ptcluster-new", ".munge.key.ptcluster-new", "munge.key.tmp"):
        (folder / name).symlink_to(victim)  # (the names a script would use)
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else shutil.which("python3")
    argv = [python, *KEY_ARGV[1:-2], str(folder), "nobody"]
    done = subprocess.run(argv, input=base64.b64encode(KEY).decode() + "\n", text=True,
                          capture_output=True, timeout=30, cwd=folder)
    assert done.returncode == 0, done.stderr
    st = (folder / "munge.key").stat(follow_symlinks=False)
    assert (folder / "munge.key").read_bytes() == KEY
    assert (st.st_uid, oct(st.st_mode & 0o777)) == (nobody.pw_uid, "0o400")
    vs = victim.stat()
    assert victim.read_text() == "root's\n" and (vs.st_uid, vs.st_gid) == (0, 0)
    leftovers = sorted(p.name for p in folder.iterdir())
    assert leftovers == [".munge.key.ptcluster-new", "munge.key", "munge.key.ptcluster-new",
                         "munge.key.tmp"], leftovers

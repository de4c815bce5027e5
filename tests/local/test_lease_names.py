"""L1: job ids are public, so another user (``nobody``, via ``setpriv``) may hold a job's
lease or plant its record's name. A job lease held by another user is busy (the job may
wait), never "already runs"; a record's name has a random part, so none can be planted
where the holder's record will go, and ``ps``/``kill`` still see the holder."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ptcluster.node.guard.prechecks import lease_job
from ptcluster.node.guard.refusal import GuardError
from ptcluster.node.sharing import leases
from tests.local.test_sharing import HOLD, NOBODY, OWNER, SRC, as_nobody, shared_dir

pytestmark = pytest.mark.skipif(os.getuid() != 0 or not os.path.exists("/usr/bin/setpriv"),
                                reason="needs root and setpriv (a second real user)")


@pytest.fixture
def lease_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = shared_dir("ptc-lease-names-")
    monkeypatch.setattr(leases, "LEASE_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_job_lease_another_user_holds_is_busy_not_already_running(lease_dir: Path) -> None:
    squatter = subprocess.Popen([*NOBODY, "-c", HOLD, str(lease_dir), "job-J7"], cwd="/",
                                env={"PYTHONPATH": str(SRC)}, stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "held"
        with pytest.raises(GuardError) as info:
            lease_job(dict(OWNER), leases.Leasing(str(lease_dir)))
        assert info.value.busy and info.value.code == "guard.job-lease-held", info.value.problem
        assert "nobody" in info.value.fields["holder"], info.value.fields
        mine = lease_job({**OWNER, "job_id": "J8"}, leases.Leasing(str(lease_dir)))
        with pytest.raises(GuardError, match="already runs") as again:
            lease_job({**OWNER, "job_id": "J8"}, leases.Leasing(str(lease_dir)))
        assert not again.value.busy
        mine.release()
    finally:
        squatter.kill()
        squatter.wait()


def test_a_record_name_cannot_be_planted_first(lease_dir: Path) -> None:
    """nobody plants a file at the name a record of uid 4242 had (``NAME.4242.json``): 4242's
    lease still writes its record, and it is the one believed."""
    name = leases.lease_name("gpu-0")
    plant = ("import os, sys\nfor n in sys.argv[2:]:\n"
             "    os.close(os.open(os.path.join(sys.argv[1], n), os.O_CREAT | os.O_WRONLY, 0o644))")
    made = as_nobody(plant, str(lease_dir), f"{name}.4242.json")  # (sticky: 4242 cannot
    # rename its record over nobody's file)
    assert isinstance(made, subprocess.CompletedProcess) and made.returncode == 0, made
    take = ("import json, os, sys; from ptcluster.node.sharing import leases; "
            "leases.LEASE_DIR = sys.argv[1]; held = leases.take('gpu-0', {'job_id': 'J9'}); "
            "print(json.dumps([held.info_path, leases.holder('gpu-0')]))")
    done = subprocess.run(["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups",
                           sys.executable, "-c", take, str(lease_dir)], cwd="/",
                          env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    path, holder = json.loads(done.stdout)
    assert holder and holder["job_id"] == "J9" and holder["uid"] == 4242, holder
    assert re.fullmatch(re.escape(f"{name}.4242.") + r"[0-9a-f]{16}\.json",
                        os.path.basename(path)), path
    assert socket.gethostname() in name


def test_ps_names_a_lease_held_by_an_unknown_holder(lease_dir: Path) -> None:
    """nobody makes a directory where gpu-0's lock goes (M1: that GPU is busy for all): the
    sampler's leases say so, the head takes the sample, and ``ps`` names it."""
    from ptcluster.cli.ps_cmd import unknown_holders
    from ptcluster.remote.replies import sample_reply

    made = as_nobody("import os, sys; os.mkdir(sys.argv[1])",
                     str(lease_dir / (leases.lease_name("gpu-0") + ".lock")))
    assert isinstance(made, subprocess.CompletedProcess) and made.returncode == 0, made
    mine = leases.take("gpu-1", dict(OWNER), str(lease_dir))
    try:
        found = leases.held_all(str(lease_dir), unknown=True)
        assert leases.held_all(str(lease_dir)) == [r for r in found if not r.get("unknown")]
        sample = {"hostname": "n0", "time": 1.0, "cpu_percent": 1.0, "cpus": 2,
                  "mem": {"used": 1, "total": 2}, "net": {"rx_bps": 0.0, "tx_bps": 0.0},
                  "gpus": [], "gpu_error": None, "leases": found, "jobs": {}, "user": "ann"}
        got = sample_reply(sample)["leases"]
        assert unknown_holders({"n0": ("n0", "ann", got)}) == [
            {"node": socket.gethostname(), "resource": "gpu-0"}]
    finally:
        assert mine is not None
        mine.release()

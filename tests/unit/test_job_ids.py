"""L5: a job id becomes a file's name on every node (a lease, a kill note, a guard's temp dir)
and on the head (a run directory, a registry entry). One check
(``node.sharing.records.valid_job_id``) holds it everywhere: an id copied from another user's
record, ``../../../../etc/x``, is refused before it names anything."""

from __future__ import annotations

import pytest

from ptcluster.control import registry
from ptcluster.node import kill
from ptcluster.node.guard.prechecks import lease_job
from ptcluster.node.guard.refusal import GuardError
from ptcluster.node.sharing import leases
from ptcluster.node.sharing.records import valid_job_id
from ptcluster.rundir import run_dir_for

BAD = ["../../x", "../../../../etc/x", ".hidden", "a/b", "job\n", "", "x" * 129, "a b"]


@pytest.mark.parametrize("job_id", ["20261201-093000-ab12cd", "J7", "a.b_c-d"])
def test_the_ids_ptcluster_makes_pass(job_id: str) -> None:
    assert valid_job_id(job_id) and registry.valid_job_id(job_id)


@pytest.mark.parametrize("job_id", BAD)
def test_an_id_that_is_a_path_is_refused_everywhere(job_id: str, tmp_path, monkeypatch) -> None:
    assert not valid_job_id(job_id)
    monkeypatch.setattr(leases, "LEASE_DIR", str(tmp_path))
    said = kill.end_job(job_id, "TERM", {"host": "h", "user": "root"})
    assert said["found"] is False and said.get("signalled") is None
    assert (said["problem"]["code"], said["problem"]["fields"]) == (
        "kill.not-a-job-id", {"job_id": repr(job_id[:80])})
    assert list(tmp_path.iterdir()) == []  # no kill note, wherever it would have gone
    assert not leases.well_formed({"pid": 1, "uid": 0, "since": 1.0, "job_id": job_id})
    with pytest.raises(ValueError, match="is not a job id"):
        run_dir_for(job_id, tmp_path)
    with pytest.raises(GuardError) as info:
        lease_job({"job_id": job_id}, leases.Leasing(off="test"))
    assert info.value.code == "guard.not-a-job-id" and not info.value.busy


@pytest.mark.parametrize("job_id", ["../../x", "../../../../etc/x", "a/b"])
def test_kill_of_an_id_that_is_a_path_is_a_usage_error(cli, job_id: str) -> None:
    code, out, err = cli("kill", job_id)
    assert code == 2, (out, err)
    assert cli.problem.code == "cli.not-a-job-id" and "Fix:" in err and out == ""
    assert cli.problem.fields == {"job_id": repr(job_id)}

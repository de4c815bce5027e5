"""A co-user holding thousands of real leases (L3): every reader of the lease directory
stays fast (``held_all`` finds each lease's records by bisection, not by a walk of every
entry), and the sampler's frame still fits the channel, so the monitor does not show the node
down."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ptcluster.node import sampler
from ptcluster.node.sharing import leases, records
from ptcluster.node.wire import MAX_FRAME, Kind, split
from ptcluster.remote.replies import sample_reply

LONG = "x" * records.MOST_TEXT


def _cpu_of(work) -> float:  # noqa: ANN001
    """The least of three runs' CPU seconds (this process's, user and system)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        work()
        best = min(best, time.process_time() - t0)
    return best


def test_held_all_with_5000_held_leases_is_linear(tmp_path: Path) -> None:
    """5x the leases cost about 5x the CPU, not 25x (the walk of every entry per lease was
    quadratic: 6.25 s here at 5,000). CPU time of this process, measured at 1,000 and at 5,000
    in the same test: other work on the machine moves neither much (the wall clock under load
    did: 2.6 s at load 6 against a 2 s bound before)."""
    lease_dir = tmp_path / "lock"
    lease_dir.mkdir()
    lease_dir.chmod(0o1777)
    held = [leases.take(f"gpu-{i}", {"job_id": f"j{i}", "command": "c"}, str(lease_dir))
            for i in range(1000)]
    try:
        assert all(held)
        small = _cpu_of(lambda: leases.held_all(str(lease_dir)))
        held += [leases.take(f"gpu-{i}", {"job_id": f"j{i}", "command": "c"}, str(lease_dir))
                 for i in range(1000, 5000)]
        assert all(held)
        found: list[dict] = []
        large = _cpu_of(lambda: found.__setitem__(slice(None), leases.held_all(str(lease_dir))))
        assert len(found) == 5000 and {r["job_id"] for r in found} == {f"j{i}" for i in
                                                                       range(5000)}
        print(f"held_all CPU: {small:.3f} s at 1,000 held leases, {large:.3f} s at 5,000")
        assert large < 12 * small, (small, large)  # linear: ~5x; quadratic: ~25x
    finally:
        for lease in held:
            if lease:
                lease.release()


def test_the_sampler_frame_fits_with_4096_records_of_long_text() -> None:
    record = {"pid": 1, "uid": 1000, "since": 1.0, "ranks": [0, 0], "job_id": "j",
              "resource": "job-j", "node": os.uname().nodename, "user": LONG[:32],
              **{f"k{i}": LONG for i in range(20)}}
    assert leases.well_formed(record)
    sample = {"hostname": "n0", "time": 1.0, "cpu_percent": 1.0, "cpus": 2,
              "mem": {"used": 1, "total": 2}, "net": {"rx_bps": 0.0, "tx_bps": 0.0},
              "gpus": [], "gpu_error": None, "leases": [record] * records.MAX_LEASES,
              "jobs": {}, "user": "ann"}
    assert len(json.dumps(sample)) > MAX_FRAME  # (what was sent before: the channel closed)
    frame = sampler.fitted(sample, MAX_FRAME)
    assert len(frame) <= MAX_FRAME
    kind, payload = split(frame.decode().rstrip("\n"))
    got = sample_reply(json.loads(payload))
    assert kind == Kind.SAMPLE and 0 < len(got["leases"]) < records.MAX_LEASES
    assert got["cpu_percent"] == 1.0

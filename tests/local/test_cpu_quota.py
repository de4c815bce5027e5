"""The guard's straggler meter sees a real CPU quota (``node.guard.schedstat``): a busy process
in a cgroup v1 ``cpu`` group of 20 % of a CPU is throttled in most of its periods, and the meter
says so as the node's ``cpu_throttled``; a process with no quota gives no such figure. (Its main
thread's run delay alone did not show a quota in a CI run on Linux 6.18: the reason for it.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ptcluster.node.guard.schedstat import (
    SchedstatMeter,
    cgroup_mounts,
    cpu_group,
    cpu_stat,
)
from tests.support.testbed import cpu_quota

SPIN = "import time\nwhile True:\n    pass\n"


def busy() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True)


def test_a_throttled_rank_makes_the_node_say_cpu_throttled() -> None:
    proc = busy()
    try:
        with cpu_quota(proc.pid, 20, f"{os.getpid()}-meter") as group:
            assert cpu_group(proc.pid, cgroup_mounts("cpu")) == str(group)
            meter = SchedstatMeter()
            meter.sample({0: proc.pid}, {}, time.monotonic())
            assert meter.throttled is None  # the first look has nothing to compare with
            time.sleep(1.0)
            meter.sample({0: proc.pid}, {}, time.monotonic())
            periods, throttled = cpu_stat(str(group)) or (0, 0)
            assert periods >= 5 and throttled >= 5, (periods, throttled)
            assert meter.throttled is not None and meter.throttled >= 0.8, meter.throttled
            assert meter.node()["cpu_throttled"] == meter.throttled
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_no_quota_no_figure() -> None:
    proc = busy()
    try:
        meter = SchedstatMeter()
        meter.sample({0: proc.pid}, {}, time.monotonic())
        time.sleep(0.5)
        meter.sample({0: proc.pid}, {}, time.monotonic())
        assert meter.throttled is None and "cpu_throttled" not in meter.node()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

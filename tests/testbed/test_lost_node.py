"""A lost node, explained (``launch.lost``): after the loss the head asks the node once more.
A node whose guard was SIGKILLed answers on the same boot ("is up; its guard ended"); a node
whose every process was killed and whose link is down does not answer. (A reboot cannot happen
in a namespace: its words are tested on given answers in ``tests/unit/test_health.py``.)

The powered-off node comes last: its sshd is killed with everything else of its namespace.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from ptcluster.launch.lost import PROBE_BOUND
from ptcluster.launch.options import RunOptions
from tests.support.head import only_run
from tests.support.procs import job_processes
from tests.testbed.test_run import IDLE, LOSS_MARGIN, SLEEPER, head_runs, is_guard, start

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
LOSS_BOUND = RunOptions().lost_within + LOSS_MARGIN
"""The most seconds from a node's cut to the head naming it (``RunOptions.lost_within``)."""


@pytest.fixture
def job_dir(tmp_path):
    for name, text in (("sleeper.py", SLEEPER), ("idle.py", IDLE)):
        (tmp_path / name).write_text(text)
    return tmp_path


def cause_of(head) -> tuple[str, dict]:
    """The head's stderr and its run's summary.json."""
    _, summary = only_run(head_runs(head))
    return "\n".join(head.err), summary


def test_a_node_whose_guard_was_killed_is_up_and_its_guard_ended(testbed, job_dir,
                                                                 no_leftovers) -> None:
    head, job_id = start(testbed, job_dir, ["idle.py"])
    no_leftovers.append(job_id)
    victim = testbed.nodes[2]
    try:
        head.wait_for("ready", count=4)
        (guard,) = [p for p, cmd in job_processes(job_id)
                    if testbed.node_of_pid(p) == victim and is_guard(cmd)]
        os.kill(guard, signal.SIGKILL)
        code = head.wait(timeout=60)
    finally:
        head.kill()
    assert code == 1, head.output()
    err, summary = cause_of(head)
    assert f"Root cause (first observed failure): {victim.name}: is up; its guard ended " \
           "(connection lost" in err, head.output()
    node = next(n for n in summary["nodes"] if n["host"] == victim.name)
    assert node["after_loss"]["answered"] is True and node["after_loss"]["guard_alive"] is False
    with open("/proc/sys/kernel/random/boot_id") as f:  # (one kernel for every namespace)
        assert node["after_loss"]["boot_id"] == f.read().strip()
    assert summary["root_cause"]["message"].startswith("is up; its guard ended (connection lost")
    assert "before:" not in summary["root_cause"]["message"]  # (the loss said once)


def test_a_node_powered_off_does_not_answer(testbed, job_dir, no_leftovers) -> None:
    victim = testbed.nodes[2]
    head, job_id = start(testbed, job_dir, ["sleeper.py"])
    no_leftovers.append(job_id)
    try:
        head.wait_for("ready", count=4)
        testbed.cut_link(victim)
        for pid in victim.pids():  # everything of the node: guard, ranks, its sshd
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        lost_at = time.monotonic()
        line = head.err_line(f"stopping the job on every node: {victim.name}: ", timeout=90)
        named = time.monotonic() - lost_at
        code = head.wait(timeout=90)
        took = time.monotonic() - lost_at
    finally:
        testbed.restore_link(victim)
        head.kill()
    assert code == 1, head.output()
    err, summary = cause_of(head)
    assert f"Root cause (first observed failure): {victim.name}: does not answer (powered off, " \
           "or its network is down) (before: " in err, head.output()
    node = next(n for n in summary["nodes"] if n["host"] == victim.name)
    assert node["after_loss"] == {"answered": False}
    assert summary["root_cause"]["kind"] == "lost"
    # Named within the head's loss budget (a correctness bound, not a speed figure: the node's
    # last byte came before the cut, so the head's silence rule names it within node_silence
    # and one tick of its checks; LOSS_MARGIN for a loaded machine), and the job ends after the
    # other nodes' stop and the probe of the lost one (<= PROBE_BOUND).
    print(f"named {named:.1f} s after the cut (bound {LOSS_BOUND:.1f} s), ended after "
          f"{took:.1f} s: {line}")
    assert named <= LOSS_BOUND, (named, LOSS_BOUND)
    assert took <= LOSS_BOUND + RunOptions().stop_deadline + PROBE_BOUND, took

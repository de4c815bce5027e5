"""The GPU driver's Xids, for real in the kernel's log: a line in the driver's format written
into ``/dev/kmsg`` (as root; TESTBED.md "The kernel's own view") by a rank with its own pid is
named as the cause when that rank then fails with a CUDA error; one with another process's pid
is a warning in a job that goes on; a fatal one before the launch keeps the node out of a job
that uses GPUs. There is no GPU here: the PCI address maps to no index, and is named as such.

Every line written here stays in the machine's log: the tests end by writing the driver's own
load line, which (as after a real driver reload) makes every earlier Xid history."""

from __future__ import annotations

import os
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ptcluster.node.facts.gpu_errors import ACT_HARDWARE, xid_fix
from ptcluster.node.facts.health import health, unfit
from ptcluster.node.facts.kernel_log import TEST_USER_LINES
from ptcluster.node.guard.machine import MachineWatch
from tests.support.head import only_run, run_head
from tests.support.nvml import H100, RecordedNvml

LOADED = ("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07  (written by ptcluster's "
          "tests: the Xids they wrote before are history)")

# No wait for the guard's cadence: a rank's own pid is its from its start record, the guard
# reads the log at a failed rank's exit and once more after the last rank's
FALLS_OFF = textwrap.dedent("""
    import os
    with open("/dev/kmsg", "w") as log:
        log.write(f"NVRM: Xid (PCI:0000:3b:00): 79, pid={os.getpid()}, name=pt_main_thread, "
                  "GPU has fallen off the bus.\\n")
    raise RuntimeError("CUDA error: unspecified launch failure")
""")

BYSTANDER = textwrap.dedent("""
    with open("/dev/kmsg", "w") as log:
        log.write("NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=someone-else, Graphics SM Warp "
                  "Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter\\n")
    print("still here", flush=True)
""")


@pytest.fixture
def kernel_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Root, with a writable ``/dev/kmsg``; afterwards the driver's load line (see above).
    Lines written from user space carry the ``user`` facility, which the readers skip but for
    the tests (``kernel_log.TEST_USER_LINES``, in this process's environment and so in the
    guards' it starts)."""
    if os.getuid() != 0 or not os.access("/dev/kmsg", os.W_OK):
        pytest.skip("writing the kernel's log needs root (TESTBED.md)")
    monkeypatch.setenv(TEST_USER_LINES, "1")
    try:
        yield
    finally:
        with open("/dev/kmsg", "w") as log:
            log.write(LOADED + "\n")


@pytest.mark.slow
def test_a_rank_whose_gpu_fell_off_the_bus_is_named_by_the_xid(tmp_path: Path, kernel_log,
                                                               no_leftovers) -> None:
    (tmp_path / "falls.py").write_text(FALLS_OFF)
    code, head = run_head(["run", "--nproc", "1", "--run-dir", "runs", "falls.py"],
                          cwd=tmp_path, timeout=120)
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    rc = summary["root_cause"]
    assert rc["kind"] == "gpu" and rc["rank"] == 0, rc
    (xid,) = rc["facts"]["xids"]
    assert (xid["xid"], xid["pci"], xid["rank"], xid["gpu"]) == (79, "0000:3b:00", 0, None)
    assert rc["code"] == "run.gpu-xid", rc
    assert {k: v for k, v in rc["fields"].items() if k not in ("at", "fix")} == {
        "how": "exited with code 1 (RuntimeError: CUDA error: unspecified launch failure)",
        "where": "the GPU at PCI 0000:3b:00 on localhost", "xid": "79", "more": "",
        "whose": f", in rank 0's process {xid['pid']}", "meaning": "the GPU has fallen off the bus"}
    assert rc["fields"]["fix"] == xid["fix"]  # (NVIDIA's action for it: "reboot the node; ...")
    # said as a warning too (while the job ran, or with the rank's exit, whichever came first)
    assert any(line.startswith("ptcluster: warning: the GPU at PCI 0000:3b:00 on localhost "
                               "reported Xid 79")
               for line in head.err), head.output()
    assert summary["nodes"][0]["gpu_errors"][0]["xid"] == 79


@pytest.mark.slow
def test_an_xid_of_another_process_is_a_warning_and_the_job_goes_on(tmp_path: Path, kernel_log,
                                                                     no_leftovers) -> None:
    (tmp_path / "bystander.py").write_text(BYSTANDER)
    code, head = run_head(["run", "--nproc", "1", "--run-dir", "runs", "bystander.py"],
                          cwd=tmp_path, timeout=120)
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 0, head.output()
    assert summary["ok"] and summary["root_cause"] is None
    (xid,) = summary["nodes"][0]["gpu_errors"]
    assert (xid["xid"], xid["pid"], xid["rank"], xid["action"]) == (13, 1, None, "job")
    warned = [line for line in head.err if line.startswith("ptcluster: warning: ")]
    assert warned == [
        "ptcluster: warning: the GPU at PCI 0000:3b:00 on localhost reported Xid 13 at "
        f"{xid['clock']}, in process 1 (someone-else: not one of the job's): graphics engine "
        "exception: a kernel used an illegal address or instruction; what to do: the job's own "
        "fault (its code or its data drove the GPU there): fix it and run again; the GPU "
        "itself is fine"], \
        head.output()


def test_a_fatal_xid_before_the_launch_keeps_the_node_out(tmp_path: Path, kernel_log) -> None:
    """The gate as the guard runs it, on this machine's real log (a job here cannot use GPUs:
    the local cluster's backend is gloo on a machine without them, so its guard does not ask;
    with backend nccl the gate asks, and also finds no GPU for the slot)."""
    with open("/dev/kmsg", "w") as log:
        log.write("NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has "
                  "fallen off the bus.\n")
    found = health({"workdir": str(tmp_path), "slots": 1, "backend": "nccl"})
    refusal = unfit(found)
    assert refusal is not None
    (driver,) = [f for f in found if f["check"] == "gpu-driver"]
    assert not driver["ok"] and driver["code"] == "health.xid-fatal"
    assert {k: driver["fields"][k] for k in ("name", "xid")} == {
        "name": "the GPU at PCI 0000:3b:00", "xid": "79"}, driver
    assert driver["fields"]["action"] == xid_fix(ACT_HARDWARE, None)
    assert driver["fix"] in refusal["fix"]
    # a gloo job on a node without GPUs is not asked; after a driver load, it is history
    assert [f["check"] for f in health({"workdir": str(tmp_path), "slots": 1})] == \
        ["disk", "memory"]
    with open("/dev/kmsg", "w") as log:
        log.write(LOADED + "\n")
    (driver,) = [f for f in health({"workdir": str(tmp_path), "slots": 1, "backend": "nccl"})
                 if f["check"] == "gpu-driver"]
    assert driver["ok"] and driver["what"].startswith("no fatal Xid since the driver loaded "
                                                      "(/dev/kmsg)"), driver


def test_the_guard_takes_nvml_events_on_a_thread_of_their_own() -> None:
    """NVML's Xid events (recorded answers: no GPU here) on the guard's own watch, beside the
    kernel's log it reads here."""
    nvml = RecordedNvml([H100, {**H100, "nvmlDeviceGetPciInfo_v3": [b"00000000:2A:00.0"]}],
                        events=[(1, 79)])
    watch = MachineWatch(gpus=[1], nvml=nvml)
    try:
        deadline = time.monotonic() + 5
        while not watch.xids and time.monotonic() < deadline:
            time.sleep(0.05)
        (xid,) = watch.new_xids()
    finally:
        watch.close()
    assert (xid["gpu"], xid["xid"], xid["rank"], xid["jobs_gpu"], xid["fatal"]) == \
        (1, 79, None, True, True)
    assert xid["fix"].startswith("reboot the node")
    assert watch.xids_of(0) == [xid]  # a rank that then fails on this node: the job's GPU

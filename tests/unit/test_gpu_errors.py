"""The GPU driver's word (``node.facts.gpu_errors``), the health gate's check of it
(``node.facts.health.check_gpu_driver``, ``gpu_warnings``) and how the head words an Xid
(``launch.supervise.machine_view``, ``verdict``): on the driver's own line formats (quoted in
../shared/research/machine-view.md from leptonai/gpud's test data) and on NVML answers recorded
in NVML's calling convention (there is no GPU here; ``scripts/gpu_check.sh`` asks a real one)."""

from __future__ import annotations

from typing import Any

import pytest

from ptcluster.launch.result import RankRecord
from ptcluster.launch.supervise.events import GpuError, RankExit, decode
from ptcluster.launch.supervise.machine_view import xid_named, xid_said
from ptcluster.launch.supervise.verdict import Raised, judge_rank
from ptcluster.node import wire
from ptcluster.node.facts.gpu_errors import (
    ACT_HARDWARE,
    ACT_RESET,
    NvmlXids,
    describe_xid,
    gpu_indices,
    nvml_state,
    open_fatal,
    parse_xid,
    pci_key,
    smi_indices,
    xid_fix,
    xids_in,
)
from ptcluster.node.facts.health import check_gpu_driver, gpu_warnings
from ptcluster.node.facts.health_facts import HealthFacts
from tests.support.health import driver, facts
from tests.support.nvml import H100, RecordedNvml

LINES = {
    119: "NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout after 6s of "
         "waiting for RPC response from GPU4 GSP! Expected function 103 (GSP_RM_ALLOC) "
         "(0x2081 0x4).",
    13: "NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp "
        "Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
    79: "NVRM: Xid (PCI:0000:05:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off "
        "the bus.",
    154: "NVRM: Xid (PCI:0009:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x4 "
         "(Drain and Reset)",
    109: "NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, "
         "errorString CTX SWITCH TIMEOUT, Info 0x58005",
}
LOADED = "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024"


def test_the_driver_lines_parse() -> None:
    assert parse_xid(LINES[119]) == {
        "pci": "0000:9b:00", "xid": 119, "pid": 2024380, "name": "nvidia-smi",
        "text": "Timeout after 6s of waiting for RPC response from GPU4 GSP! Expected function "
                "103 (GSP_RM_ALLOC) (0x2081 0x4)."}
    unknown = parse_xid(LINES[13])
    assert unknown is not None
    assert (unknown["pid"], unknown["name"]) == (0, "unknown")
    assert unknown["text"].startswith("Graphics SM Warp Exception")
    no_pid = parse_xid(LINES[154])
    assert no_pid is not None and no_pid["pci"] == "0009:01:00" and no_pid["pid"] == 0
    assert parse_xid("[  12.3] kernel: Out of memory: Killed process 42 (python)") is None
    # only at the start of a record's text (the log's records carry no stamp in their text;
    # dmesg's print of one is not read: M2)
    assert parse_xid("[Fri Aug 30 11:43:14 2024] " + LINES[109]) is None


@pytest.mark.parametrize("said, key", [
    ("0000:3b:00", "0000:3b:00"),          # the Xid line's
    ("00000000:3B:00.0", "0000:3b:00"),    # NVML's and nvidia-smi's
    ("3b:00.0", "0000:3b:00"),
    ("0009:01:00", "0009:01:00"),
])
def test_one_spelling_of_a_pci_address(said: str, key: str) -> None:
    assert pci_key(said) == key


@pytest.mark.parametrize("xid, text, action, fatal", [
    (13, "", "job", False), (31, "", "job", False), (79, "", "hardware", True),
    (48, "", "reset", True), (63, "", "watch", False), (92, "", "watch", False),
    (119, "", "reset", True), (146, "", "hardware", True),
    (154, "GPU recovery action changed from 0x0 (None) to 0x0 (None)", "watch", False),
    (154, "GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)", "reset", True),
    (154, "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", "reboot",
     True),
    (999, "", "watch", False),             # not in the catalog: named, not refused
])
def test_the_catalog(xid: int, text: str, action: str, fatal: bool) -> None:
    said = describe_xid(xid, text)
    assert (said["action"], said["fatal"]) == (action, fatal)
    assert said["meaning"]


def test_a_driver_load_clears_the_fatal_xids_before_it() -> None:
    records = [(10.0, LINES[79]), (11.0, LINES[13]), (20.0, LOADED), (30.0, LINES[109]),
               (31.0, LINES[13])]
    xids = xids_in(records)
    assert [(x["xid"], x["stale"]) for x in xids] == [(79, True), (13, True), (109, False),
                                                      (13, False)]
    assert [(x["xid"], x["at"]) for x in open_fatal(xids)] == [(109, 30.0)]


def ctx(records: list[tuple[float, str]], state: list[dict[str, Any]] | None = None,
        **more: Any) -> HealthFacts:
    """A node of two GPUs, its driver's word recorded (``records``, NVML's ``state``)."""
    return facts(**{"gpu_count": 2, "driver": driver(records, state), **more})


def test_a_fatal_xid_since_the_driver_loaded_refuses_the_node() -> None:
    (found,) = check_gpu_driver(ctx([(5.0, LOADED), (3600.0, LINES[79])])) or []
    assert not found["ok"] and found["code"] == "health.xid-fatal"
    assert found["fields"] == {"name": "GPU 1 (PCI 0000:05:00)", "xid": "79",
                               "meaning": "the GPU has fallen off the bus",
                               "at": "3600 s after boot", "action": xid_fix(ACT_HARDWARE, 1)}
    # the one rendering of it (a few sentences stay tested: the table's text, filled in)
    assert found["what"] == ("GPU 1 (PCI 0000:05:00) had Xid 79 (the GPU has fallen off the "
                             "bus) at 3600 s after boot, and the driver has not been reloaded "
                             "since")


def test_an_application_xid_or_an_old_one_lets_it_in() -> None:
    assert ok(check_gpu_driver(ctx([(1.0, LINES[13])])))
    assert ok(check_gpu_driver(ctx([(1.0, LINES[79]), (2.0, LOADED)])))
    # a CPU job on a node without GPUs is not asked
    assert check_gpu_driver(ctx([(1.0, LINES[79])], gpu_count=0)) is None
    # a log nobody may read: said, not refused
    (unread,) = check_gpu_driver(facts(gpu_count=2, driver=driver([], source=""))) or []
    assert unread["ok"] and unread["code"] is None


def ok(found: list[dict[str, Any]] | None) -> bool:
    return found is not None and all(f["ok"] for f in found)


@pytest.mark.parametrize("state, code, fix", [
    ({"ecc_uncorrected": 2}, "health.ecc-uncorrected", ACT_RESET),
    ({"remap_pending": True}, "health.remap-pending", ACT_RESET),
    ({"remap_failed": True, "remap_pending": True}, "health.remap-failed", ACT_HARDWARE),
    ({"retire_pending": True}, "health.retire-pending", ACT_RESET),
])
def test_nvml_counters_refuse_the_node(state: dict[str, Any], code: str, fix: str) -> None:
    (found,) = check_gpu_driver(ctx([], [{"index": 0, "pci": "0000:cb:00", **state}])) or []
    assert not found["ok"] and found["code"] == code, found
    assert found["fields"]["name"] == "GPU 0 (PCI 0000:cb:00)"
    assert found["fix"] == xid_fix(fix, 0)


def test_doctor_warns_of_a_narrow_link_slowdowns_and_wearing_memory() -> None:
    narrow = {"index": 0, "pci": "0000:cb:00", "pcie": (8, 16, 4, 4), "util": 0}
    idle_gen = {"index": 1, "pci": "0000:05:00", "pcie": (16, 16, 1, 4), "util": 0,
                "slowdowns": ["hardware thermal slowdown"]}
    busy_gen = {"index": 2, "pci": "0000:06:00", "pcie": (16, 16, 3, 5), "util": 90}
    warned = gpu_warnings(ctx([(7.0, "NVRM: Xid (PCI:0000:cb:00): 63, pid='<unknown>', "
                                     "name=<unknown>, Row Remapper: New row marked for "
                                     "remapping")], [narrow, idle_gen, busy_gen]))
    assert [(w["code"], w["fields"]) for w in warned] == [
        ("health.pcie-narrow", {"name": "GPU 0 (PCI 0000:cb:00)", "width": "8",
                                "max_width": "16"}),
        ("health.gpu-slowdown", {"name": "GPU 1 (PCI 0000:05:00)",
                                 "reasons": "hardware thermal slowdown"}),
        ("health.pcie-slow", {"name": "GPU 2 (PCI 0000:06:00)", "gen": "3", "max_gen": "5"}),
        ("health.xid-wear", {"name": "GPU 0 (PCI 0000:cb:00)", "xid": "63",
                             "at": "7 s after boot", "meaning": describe_xid(63)["meaning"]}),
    ]
    assert all(w["fix"] for w in warned)


def test_nvml_state_from_recorded_answers() -> None:
    sick = {**H100, "nvmlDeviceGetPciInfo_v3": [b"00000000:2A:00.0"],
            "nvmlDeviceGetTotalEccErrors": [3], "nvmlDeviceGetRemappedRows": [5, 1, 1, 0],
            "nvmlDeviceGetCurrPcieLinkWidth": [8],
            "nvmlDeviceGetCurrentClocksEventReasons": [0x40]}
    state = nvml_state(RecordedNvml([H100, sick]))
    assert state == [
        {"index": 0, "pci": "0000:18:00", "ecc_uncorrected": 0, "remap_pending": False,
         "remap_failed": False, "pcie": (16, 16, 5, 5), "util": 97, "slowdowns": []},
        {"index": 1, "pci": "0000:2a:00", "ecc_uncorrected": 3, "remap_pending": True,
         "remap_failed": False, "pcie": (8, 16, 5, 5), "util": 97,
         "slowdowns": ["hardware thermal slowdown"]},
    ]
    assert gpu_indices(RecordedNvml([H100, sick])) == {"0000:18:00": 0, "0000:2a:00": 1}
    found = check_gpu_driver(facts(slots=2, gpu_count=2, driver=driver(
        [], state, pci={s["pci"]: s["index"] for s in state})))
    assert [(f["code"], f["fields"].get("count")) for f in found or []] == [
        ("health.ecc-uncorrected", "3"), ("health.remap-pending", None)]


def test_nvml_xid_events_from_recorded_answers() -> None:
    """A user who cannot read the kernel's log: NVML's events name the GPU and the Xid."""
    nvml = RecordedNvml([H100, {**H100, "nvmlDeviceGetPciInfo_v3": [b"00000000:2A:00.0"]}],
                        events=[(1, 79), (0, 13)])
    events = NvmlXids(nvml)
    assert nvml.registered == [0, 1]
    assert events.wait(0) == [
        {"pci": "0000:2a:00", "gpu": 1, "xid": 79, "pid": 0, "name": "", "text": "(an NVML event)"},
        {"pci": "0000:18:00", "gpu": 0, "xid": 13, "pid": 0, "name": "", "text": "(an NVML event)"}]
    assert events.wait(0) == []
    events.close()
    events.close()  # (once)
    assert nvml.calls.count("nvmlShutdown") == 1 and nvml.calls.count("nvmlEventSetFree") == 1


def test_no_nvml_no_state() -> None:
    class Absent:
        def nvmlInit_v2(self) -> int:
            return 9  # NVML_ERROR_DRIVER_NOT_LOADED
    assert nvml_state(Absent()) == []


def test_nvidia_smi_indices() -> None:
    assert smi_indices("0, 00000000:18:00.0\n1, 00000000:2A:00.0\n") == {
        "0000:18:00": 0, "0000:2a:00": 1}


XID79: wire.XidFacts = {
    "pci": "0000:05:00", "gpu": 1, "xid": 79, "pid": 4242, "name": "pt_main_thread", "rank": 3,
    "text": "GPU has fallen off the bus.", "meaning": "the GPU has fallen off the bus",
    "action": "hardware", "fatal": True, "at": 1.0, "clock": "10:42:01", "jobs_gpu": True,
    "fix": "reboot the node; if it happens again, the GPU (or its slot, riser, NVLink) needs "
           "a hardware inspection"}


def test_the_head_words_an_xid() -> None:
    assert xid_said("n2", XID79) == (
        "GPU 1 on n2 reported Xid 79 at 10:42:01, in rank 3's process 4242: the GPU has fallen "
        "off the bus; what to do: reboot the node; if it happens again, the GPU (or its slot, "
        "riser, NVLink) needs a hardware inspection")
    other: wire.XidFacts = {**XID79, "rank": None, "pid": 77, "name": "nvidia-smi", "gpu": None,
                            "clock": ""}
    said = xid_named("n2", "exited with code 1", [other])
    assert said is not None and said.problem.code == "run.gpu-xid"
    assert {k: said.problem.fields[k] for k in ("where", "at", "whose")} == {
        "where": "the GPU at PCI 0000:05:00 on n2", "at": "",
        "whose": ", in process 77 (nvidia-smi: not one of the job's)"}
    assert xid_said("n2", other).startswith(  # (the same words as a warning)
        said.message.removeprefix("exited with code 1, after "))
    named = xid_named("n2", "exited with code 1", [XID79])
    assert named is not None and named.kind == "gpu" and named.problem.code == "run.gpu-xid"
    assert {k: named.problem.fields[k] for k in ("where", "xid", "fix")} == {
        "where": "GPU 1 on n2", "xid": "79", "fix": XID79["fix"]}
    assert named.fix.startswith(XID79["fix"])  # (NVIDIA's action, then where its catalog is)


def test_a_rank_that_died_after_its_gpu_failed_is_named_by_the_xid() -> None:
    record = RankRecord(rank=3, host="n2", local_rank=1, exit_code=1, ended_at=10.0)
    raised = Raised(at=9.9, text="RuntimeError: CUDA error: unspecified launch failure",
                    exc="RuntimeError")
    verdict = judge_rank(record, raised, False, None, None, [XID79])
    assert verdict is not None and str(verdict.kind) == "gpu"
    assert verdict.declared is not None and verdict.declared.code == "run.gpu-xid"
    assert verdict.declared.fields["how"] == \
        "exited with code 1 (RuntimeError: CUDA error: unspecified launch failure)"
    assert verdict.message == verdict.declared.what
    assert verdict.facts["xids"][0]["xid"] == 79
    # without an Xid it is the rank's own failure
    assert str(judge_rank(record, raised, False, None).kind) == "rank"


def test_the_frames_decode() -> None:
    event = decode("n2", wire.encode(wire.Kind.XID, dict(XID79)).decode().rstrip("\n"))
    assert event == GpuError("n2", XID79)
    exit_event = decode("n2", wire.encode(wire.Kind.REXIT, {
        "rank": 3, "code": 1, "t": 5.0, "xids": [dict(XID79)]}).decode().rstrip("\n"))
    assert isinstance(exit_event, RankExit) and exit_event.xids == (XID79,)


# -- M2: only the driver's own records are its word -------------------------------------------
FORGED = [  # kernel lines that carry text a user chose (review M2): an exec'd path, a group
    "process 'a.out' launched '/tmp/NVRM: Xid (PCI:0000:05:00): 79, x' with NULL argv: empty "
    "string added",
    "Memory cgroup stats for /user.slice/user-1000.slice/NVRM: Xid (PCI:0000:05:00): 48, y:",
]
FORGED_LOAD = ("process 'a.out' launched '/tmp/NVRM: loading NVIDIA UNIX x' with NULL argv: "
               "empty string added")


def test_a_forged_xid_inside_another_kernel_line_is_no_xid() -> None:
    assert [parse_xid(line) for line in FORGED] == [None, None]
    records = [(float(i), line) for i, line in enumerate(FORGED)]
    assert xids_in(records) == []
    assert ok(check_gpu_driver(ctx(records)))


def test_a_forged_driver_load_inside_another_line_leaves_a_fatal_xid_open() -> None:
    xids = xids_in([(1.0, LINES[79]), (2.0, FORGED_LOAD)])
    assert [(x["xid"], x["stale"]) for x in xids] == [(79, False)]
    assert not ok(check_gpu_driver(ctx([(1.0, LINES[79]), (2.0, FORGED_LOAD)])))


def test_kmsg_records_of_user_space_are_not_the_kernels(monkeypatch) -> None:
    """/dev/kmsg's records as it gives them, one per read (a SEQPACKET pair stands in): only
    facility kern (PRI >> 3 == 0) is read; the tests' own lines (user, 1) only when asked."""
    import socket

    from ptcluster.node.facts import kernel_log

    def records() -> list[tuple[float, str]]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours, theirs:
            for pri, text in ((3, LINES[79]), (14, "NVRM: Xid (PCI:0000:05:00): 48, logger"),
                              (12, "NVRM: Xid (PCI:0000:05:00): 79, root's echo")):
                theirs.send(f"{pri},1,5000000,-;{text}\n".encode())
            ours.setblocking(False)
            return kernel_log.read_kmsg(ours.fileno())

    monkeypatch.delenv(kernel_log.TEST_USER_LINES, raising=False)
    assert records() == [(5.0, LINES[79])]
    monkeypatch.setenv(kernel_log.TEST_USER_LINES, "1")
    assert [text[-6:] for _, text in records()] == [LINES[79][-6:], "logger", "s echo"]

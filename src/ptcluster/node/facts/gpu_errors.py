"""The GPU driver's own word on its GPUs: Xids in the kernel's log, NVML's error counters.

An Xid is the NVIDIA driver's report of an error, one kernel line each
(``NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=pt_main_thread, GPU has fallen off the bus.``):
the GPU by its PCI address (domain:bus:device, no function), the Xid, the process that made
the GPU fail where the driver knows it (``pid='<unknown>'`` where not), then its own words.
``XIDS`` is our reading of NVIDIA's catalog (docs.nvidia.com/deploy/xid-errors, its
"immediate resolution" column, as mirrored by leptonai/gpud and NVIDIA/NVSentinel; see
../shared/research/machine-view.md §2): what each means, whose fault it is, what to do, and
whether it keeps the node out of a job until the GPU is reset (``fatal``).

"Until the GPU is reset": the driver writes ``NVRM: loading NVIDIA UNIX ...`` when its module
loads (every boot, every reload): a fatal Xid before the last such line is history. A reset of
one GPU in place (``nvidia-smi -r``) is not seen in the log by this module: after one, reload
the driver or reboot for the gate to let the node in.

NVML's counters (``nvml_state``): uncorrectable ECC errors since the driver loaded, row
remapping pending or failed (Ampere and newer), retired pages pending (older GPUs), the PCIe
link against its maximum, the clock event reasons (thermal or power-brake slowdowns). Where
there is no GPU, the tests give recorded answers in NVML's own calling convention.

Standard library only; a part of the guard and of the doctor's facts program.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any, TypedDict

from ptcluster.node.facts.accel import load_nvml

XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F]{1,8}(?::[0-9a-fA-F]{1,2}){1,2})"
                      r"(?:\.[0-7])?\): (\d+),\s*(.*)")
XID_PID = re.compile(r"pid='?(\d+)'?")
XID_NAME = re.compile(r"name=([^,]*)")
DRIVER_LOADED = "NVRM: loading NVIDIA UNIX"
"""The driver's first line when its module loads: every GPU starts afresh.

Both are read at the start of a record's text only (``re.match``, ``startswith``): other kernel
lines carry text users choose (an exec'd path, a control group's name), which must never read
as the driver's word (review M2)."""
XID_RECOVERY = re.compile(r"recovery action changed from .* to 0x[0-9a-fA-F]+ \(([^)]*)\)")
"""Xid 154's text: the action the driver now asks for (``None``, ``GPU Reset Required``,
``Node Reboot Required``, ``Drain and Reset``)."""

ACT_JOB, ACT_WATCH, ACT_RESET = "job", "watch", "reset"
ACT_REBOOT, ACT_HARDWARE = "reboot", "hardware"
XID_ACTIONS = {
    ACT_JOB: "the job's own fault (its code or its data drove the GPU there): fix it and run "
         "again; the GPU itself is fine",
    ACT_WATCH: "nothing now; reset the GPU at the next chance and watch whether it comes back",
    ACT_RESET: "reset the GPU with nothing running on it (`nvidia-smi -r -i {gpu}`, then reload "
           "the driver) or reboot the node",
    ACT_REBOOT: "reboot the node",
    ACT_HARDWARE: "reboot the node; if it happens again, the GPU (or its slot, riser, NVLink) "
              "needs a hardware inspection",
}
"""What to do, by the kind of action NVIDIA's catalog gives (``{gpu}``: the GPU's index)."""
XID_CATALOG = "https://docs.nvidia.com/deploy/xid-errors/"

XIDS: dict[int, tuple[str, str, bool]] = {
    13: ("graphics engine exception: a kernel used an illegal address or instruction", ACT_JOB,
         False),
    31: ("GPU memory page fault: a kernel touched memory it does not own", ACT_JOB, False),
    43: ("the GPU stopped processing the job's work (its context was ended)", ACT_JOB, False),
    45: ("preemptive cleanup after an earlier error (the Xid before it says why)", ACT_JOB, False),
    48: ("double-bit ECC error in the GPU's memory", ACT_RESET, True),
    61: ("internal micro-controller breakpoint", ACT_REBOOT, True),
    62: ("internal micro-controller halt", ACT_RESET, True),
    63: ("a GPU memory row was remapped or a page retired after ECC errors", ACT_WATCH, False),
    64: ("remapping a GPU memory row (or retiring a page) failed", ACT_HARDWARE, True),
    68: ("video processor exception", ACT_JOB, False),
    74: ("NVLink error", ACT_HARDWARE, True),
    79: ("the GPU has fallen off the bus", ACT_HARDWARE, True),
    92: ("high rate of single-bit ECC errors", ACT_WATCH, False),
    94: ("contained ECC error: the process that touched the memory was ended", ACT_JOB, False),
    95: ("uncontained ECC error", ACT_RESET, True),
    109: ("context switch timeout", ACT_RESET, True),
    119: ("timeout waiting for the GPU's system processor (GSP)", ACT_RESET, True),
    120: ("error in the GPU's system processor (GSP)", ACT_RESET, True),
    140: ("unrecovered ECC error", ACT_RESET, True),
    **{n: ("NVLink error (NVLink5: see NVIDIA's decode sheet)", ACT_HARDWARE, True)
       for n in range(144, 151)},
    154: ("the driver changed the GPU's recovery action", ACT_WATCH, False),
}
"""Xid -> (what it means, ``XID_ACTIONS`` key, fatal: keeps the node out of jobs until the GPU is
reset). Xid 154 is read from its text (``describe``)."""
WARN_XIDS = (63, 92)
"""Not fatal, but doctor warns of them: the GPU's memory is wearing."""


class _Xid(TypedDict):
    pci: str
    """``pci_key``'s spelling."""
    xid: int
    pid: int
    """The process the driver blamed (0: it did not say)."""
    name: str
    text: str
    """The driver's words after the pid and name."""


class Xid(_Xid, total=False):
    """An Xid as the driver said it: a kernel line's (:func:`parse_xid`) or an NVML event's
    (:meth:`NvmlXids.wait`, with its ``gpu``); the guard adds what it means
    (``wire.XidFacts``)."""

    gpu: int | None


class KernelXid(Xid):
    """An Xid of the kernel's records (:func:`xids_in`): the health gate's and doctor's."""

    at: float
    """Seconds since boot."""
    stale: bool
    """The driver loaded again after it."""


class XidMeaning(TypedDict):
    """What an Xid means (:func:`describe_xid`)."""

    meaning: str
    action: str
    """``ACT_*``."""
    fatal: bool


def parse_xid(text: str) -> Xid | None:
    """A kernel line's Xid (no ``gpu``); None for any other line."""
    m = XID_LINE.match(text)  # at the start: see DRIVER_LOADED
    if m is None:
        return None
    rest = m.group(3)
    pid = XID_PID.match(rest)
    name = XID_NAME.search(rest) if rest.startswith("pid=") else None
    said = rest
    if rest.startswith("pid="):  # the words after "pid=..., name=..., "
        said = rest.split(", ", 2)[2] if rest.count(", ") >= 2 else ""
    return {"pci": pci_key(m.group(1)), "xid": int(m.group(2)),
            "pid": int(pid.group(1)) if pid else 0,
            "name": (name.group(1).strip() if name else "").strip("'<>"), "text": said.strip()}


def pci_key(bus_id: str) -> str:
    """A PCI address as one spelling: ``dddd:bb:dd`` in lower case, no function. The driver's
    Xid line says ``0000:3b:00``; NVML ``00000000:3B:00.0``; nvidia-smi the same as NVML."""
    parts = bus_id.lower().split(".")[0].split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    try:
        domain, bus, device = (int(p, 16) for p in parts[-3:])
    except ValueError:
        return bus_id.lower()
    return f"{domain:04x}:{bus:02x}:{device:02x}"


def describe_xid(xid: int, text: str = "") -> XidMeaning:
    """``{meaning, action, fatal}`` of an Xid (its text decides for Xid 154)."""
    meaning, action, fatal = XIDS.get(xid, (f"Xid {xid} (see NVIDIA's catalog: {XID_CATALOG})",
                                            ACT_WATCH, False))
    if xid == 154:
        m = XID_RECOVERY.search(text)
        wanted = m.group(1).lower() if m else ""
        if "reboot" in wanted:
            action, fatal = ACT_REBOOT, True
        elif "reset" in wanted:
            action, fatal = ACT_RESET, True
        meaning = f"{meaning} ({m.group(1)})" if m else meaning
    return {"meaning": meaning, "action": action, "fatal": fatal}


def xid_fix(action: str, gpu: int | None) -> str:
    return XID_ACTIONS.get(action, XID_ACTIONS[ACT_WATCH]).format(gpu="N" if gpu is None else gpu)


def xids_in(records: list[tuple[float, str]]) -> list[KernelXid]:
    """Every Xid of these kernel records, oldest first."""
    out: list[KernelXid] = []
    for at, text in records:
        if text.startswith(DRIVER_LOADED):
            for earlier in out:
                earlier["stale"] = True
            continue
        xid = parse_xid(text)
        if xid is not None:
            out.append({**xid, "at": at, "stale": False})
    return out


def open_fatal(xids: list[KernelXid]) -> list[KernelXid]:
    """The fatal Xids no driver load has cleared, the latest per GPU."""
    latest: dict[str, KernelXid] = {}
    for xid in xids:
        if not xid["stale"] and describe_xid(xid["xid"], xid["text"])["fatal"]:
            latest[xid["pci"]] = xid
    return list(latest.values())


# -- which GPU is where ---------------------------------------------------------------------

def gpu_indices(nvml: Any = None) -> dict[str, int]:
    """PCI address (``pci_key``) -> GPU index, from NVML (``nvml``: a loaded library, or
    recorded answers), else ``nvidia-smi``; {} where neither answers."""
    try:
        found = _nvml_indices(nvml if nvml is not None else load_nvml())
    except (RuntimeError, AttributeError, OSError):
        found = {}
    if found or shutil.which("nvidia-smi") is None:
        return found
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=5, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return {}
    return smi_indices(run.stdout) if run.returncode == 0 else {}


def smi_indices(text: str) -> dict[str, int]:
    """``nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader`` -> {pci: index}."""
    out = {}
    for line in text.splitlines():
        index, _, bus = line.partition(",")
        if index.strip().isdigit() and bus.strip():
            out[pci_key(bus.strip())] = int(index)
    return out


def _nvml_indices(nvml: Any) -> dict[str, int]:
    return dict(_nvml_each_gpu(nvml, lambda handle, index: (_nvml_pci_of(nvml, handle), index)))


def _nvml_pci_of(nvml: Any, handle: Any) -> str:
    """A GPU's PCI address (``pci_key``) from NVML."""
    import ctypes  # here: a Python built without libffi has no ctypes

    class PciInfo(ctypes.Structure):  # nvmlPciInfo_t (nvml.h)
        _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint),
                    ("bus", ctypes.c_uint), ("device", ctypes.c_uint),
                    ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                    ("busId", ctypes.c_char * 32)]

    info = PciInfo()
    if _nvml_call(nvml, "nvmlDeviceGetPciInfo_v3", handle, ctypes.byref(info)) != 0:
        raise RuntimeError("nvmlDeviceGetPciInfo failed")
    return pci_key(info.busId.decode(errors="replace"))


def _nvml_call(nvml: Any, name: str, *args: Any) -> int:
    """One NVML call; its return code (0: success). RuntimeError where the library has no such
    call."""
    fn = getattr(nvml, name, None)
    if fn is None:
        raise RuntimeError(f"NVML has no {name}")
    return int(fn(*args))


def _nvml_each_gpu(nvml: Any, each: Any) -> list[Any]:
    """``each(handle, index)`` for every GPU, between nvmlInit and nvmlShutdown; an error of
    ``each`` on one GPU leaves that GPU out."""
    import ctypes  # here: a Python built without libffi has no ctypes
    if _nvml_call(nvml, "nvmlInit_v2") != 0:
        raise RuntimeError("nvmlInit failed (no NVIDIA driver?)")
    try:
        count = ctypes.c_uint(0)
        if _nvml_call(nvml, "nvmlDeviceGetCount_v2", ctypes.byref(count)) != 0:
            raise RuntimeError("nvmlDeviceGetCount failed")
        out = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if _nvml_call(nvml, "nvmlDeviceGetHandleByIndex_v2", index, ctypes.byref(handle)) != 0:
                continue
            try:
                out.append(each(handle, index))
            except RuntimeError:
                continue
        return out
    finally:
        _nvml_call(nvml, "nvmlShutdown")


# -- NVML's counters --------------------------------------------------------------------------

NVML_SUCCESS = 0
NVML_UNCORRECTED, NVML_VOLATILE = 1, 0
"""``nvmlMemoryErrorType_t`` NVML_MEMORY_ERROR_TYPE_UNCORRECTED; ``nvmlEccCounterType_t``
NVML_VOLATILE_ECC (since the driver loaded)."""
NVML_FEATURE_ENABLED = 1
NVML_SLOWDOWNS = {0x8: "hardware slowdown", 0x40: "hardware thermal slowdown",
             0x80: "hardware power brake slowdown", 0x20: "software thermal slowdown"}
"""``nvmlClocksEventReasons`` bits that mean the GPU runs slower than it should (power cap and
idle are normal and left out)."""


class GpuState(TypedDict, total=False):
    """One GPU's health as NVML says it (:func:`nvml_state`; a key is absent where the GPU does
    not support the call), read by the health gate (``facts.health``)."""

    index: int
    pci: str
    ecc_uncorrected: int
    remap_pending: bool
    remap_failed: bool
    retire_pending: bool
    pcie: tuple[int, ...]
    """(width, max width, gen, max gen)."""
    util: int
    slowdowns: list[str]


def nvml_state(nvml: Any = None) -> list[GpuState]:
    """Per GPU what NVML says of its health: ``{index, pci, ecc_uncorrected, remap_pending,
    remap_failed, retire_pending, pcie: (width, max width, gen, max gen), slowdowns}``; a key is
    absent where the GPU does not support the call. [] where NVML does not answer."""
    try:
        lib = nvml if nvml is not None else load_nvml()
        return _nvml_each_gpu(lib, _nvml_gpu_state(lib))
    except (RuntimeError, AttributeError, OSError):
        return []


def _nvml_gpu_state(nvml: Any) -> Any:
    import ctypes  # here: a Python built without libffi has no ctypes

    def each(handle: Any, index: int) -> GpuState:
        state: GpuState = {"index": index}
        try:
            state["pci"] = _nvml_pci_of(nvml, handle)
        except RuntimeError:
            pass
        ecc = ctypes.c_ulonglong(0)
        if _nvml_maybe(nvml, "nvmlDeviceGetTotalEccErrors", handle, NVML_UNCORRECTED,
                  NVML_VOLATILE, ctypes.byref(ecc)):
            state["ecc_uncorrected"] = int(ecc.value)
        corr, unc, pending, failed = (ctypes.c_uint(0) for _ in range(4))
        if _nvml_maybe(nvml, "nvmlDeviceGetRemappedRows", handle, ctypes.byref(corr),
                  ctypes.byref(unc), ctypes.byref(pending), ctypes.byref(failed)):
            state["remap_pending"] = bool(pending.value)
            state["remap_failed"] = bool(failed.value)
        retire = ctypes.c_int(0)
        if _nvml_maybe(nvml, "nvmlDeviceGetRetiredPagesPendingStatus", handle,
                  ctypes.byref(retire)):
            state["retire_pending"] = retire.value == NVML_FEATURE_ENABLED
        link = [ctypes.c_uint(0) for _ in range(4)]
        if all(_nvml_maybe(nvml, name, handle, ctypes.byref(value)) for name, value in zip(
                ("nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkWidth",
                 "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration"),
                link, strict=True)):
            state["pcie"] = tuple(int(v.value) for v in link)
        util = (ctypes.c_uint * 2)()  # nvmlUtilization_t: gpu, memory (%)
        if _nvml_maybe(nvml, "nvmlDeviceGetUtilizationRates", handle, ctypes.byref(util)):
            state["util"] = int(util[0])
        reasons = ctypes.c_ulonglong(0)
        if _nvml_maybe(nvml, "nvmlDeviceGetCurrentClocksEventReasons", handle,
                  ctypes.byref(reasons)) or \
                _nvml_maybe(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", handle,
                       ctypes.byref(reasons)):
            state["slowdowns"] = [name for bit, name in NVML_SLOWDOWNS.items()
                                  if reasons.value & bit]
        return state

    return each


def _nvml_maybe(nvml: Any, name: str, *args: Any) -> bool:
    """An NVML call that a GPU may not support: whether it answered."""
    try:
        return _nvml_call(nvml, name, *args) == NVML_SUCCESS
    except RuntimeError:
        return False


# -- NVML's Xid events (where the kernel's log is not readable) ------------------------------

NVML_EVENT_XID = 0x8
"""``nvmlEventTypeXidCriticalError``."""
NVML_ERROR_TIMEOUT = 10


class NvmlXids:
    """NVML's Xid events, for a user who cannot read the kernel's log: no privilege needed, but
    no history (only what happens while registered) and no pid (NVIDIA/k8s-device-plugin
    watches the same events). ``wait`` gives what came; ``close`` ends it. Raises
    RuntimeError where NVML or its events are not there."""

    def __init__(self, nvml: Any = None) -> None:
        import ctypes  # here: a Python built without libffi has no ctypes
        self.nvml = nvml if nvml is not None else load_nvml()
        self.set = ctypes.c_void_p()
        self.closed = False
        self.gpus: dict[int, tuple[int, str]] = {}
        """Device handle's value -> (its index, its PCI address)."""
        if _nvml_call(self.nvml, "nvmlInit_v2") != 0:
            raise RuntimeError("nvmlInit failed (no NVIDIA driver?)")
        try:
            if _nvml_call(self.nvml, "nvmlEventSetCreate", ctypes.byref(self.set)) != 0:
                raise RuntimeError("nvmlEventSetCreate failed")
            count = ctypes.c_uint(0)
            _nvml_call(self.nvml, "nvmlDeviceGetCount_v2", ctypes.byref(count))
            for index in range(count.value):
                handle = ctypes.c_void_p()
                if _nvml_call(self.nvml, "nvmlDeviceGetHandleByIndex_v2", index,
                              ctypes.byref(handle)) != 0:
                    continue
                if _nvml_call(self.nvml, "nvmlDeviceRegisterEvents", handle,
                              ctypes.c_ulonglong(NVML_EVENT_XID), self.set) == 0:
                    self.gpus[int(handle.value or 0)] = (index, _nvml_pci_of(self.nvml, handle))
        except (RuntimeError, AttributeError):
            self.close()
            raise
        if not self.gpus:
            self.close()
            raise RuntimeError("no GPU takes Xid events")

    def wait(self, ms: int) -> list[Xid]:
        """The Xids NVML reports within ``ms`` milliseconds (all that are waiting, at once)."""
        import ctypes

        class EventData(ctypes.Structure):  # nvmlEventData_t (nvml.h)
            _fields_ = [("device", ctypes.c_void_p), ("eventType", ctypes.c_ulonglong),
                        ("eventData", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                        ("computeInstanceId", ctypes.c_uint)]

        out: list[Xid] = []
        while len(out) < 64:
            data = EventData()
            code = _nvml_call(self.nvml, "nvmlEventSetWait_v2", self.set, ctypes.byref(data),
                              ctypes.c_uint(0 if out else ms))
            if code != 0 or not data.eventType & NVML_EVENT_XID:
                break
            index, pci = self.gpus.get(int(data.device or 0), (None, "?"))
            out.append({"pci": pci, "gpu": index, "xid": int(data.eventData), "pid": 0,
                        "name": "", "text": "(an NVML event)"})
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.set.value:
            _nvml_call(self.nvml, "nvmlEventSetFree", self.set)
            self.set.value = None
        _nvml_call(self.nvml, "nvmlShutdown")

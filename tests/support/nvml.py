"""NVML as a GPU answers it, for the tests of the GPU paths on a machine without one: return
codes, results written through the pointers NVML is given (``node.facts.gpu_errors``)."""

from __future__ import annotations

import ctypes
from typing import Any


class RecordedNvml:
    """NVML's calls as a GPU answered them (an H100 SXM: two devices, recorded values given
    below), in NVML's calling convention: return codes, results through pointers."""

    def __init__(self, gpus: list[dict[str, Any]],
                 events: list[tuple[int, int]] | None = None) -> None:
        self.gpus = gpus
        self.events = list(events or [])
        """(GPU index, Xid) the driver will report, in order."""
        self.registered: list[int] = []
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("nvml"):
            raise AttributeError(name)

        def call(*args: Any) -> int:
            self.calls.append(name)
            return self.answer(name, args)
        return call

    @staticmethod
    def out(arg: Any) -> Any:
        return arg._obj  # what ctypes.byref pointed at

    def answer(self, name: str, args: tuple[Any, ...]) -> int:
        if name in ("nvmlInit_v2", "nvmlShutdown"):
            return 0
        if name == "nvmlDeviceGetCount_v2":
            self.out(args[0]).value = len(self.gpus)
            return 0
        if name == "nvmlDeviceGetHandleByIndex_v2":
            self.out(args[1]).value = args[0] + 1
            return 0
        if name in ("nvmlEventSetCreate",):
            self.out(args[0]).value = 0xE5E7
            return 0
        if name == "nvmlEventSetFree":
            return 0
        if name == "nvmlDeviceRegisterEvents":
            assert args[1].value == 0x8 and args[2].value == 0xE5E7  # Xid events, our set
            self.registered.append(args[0].value - 1)
            return 0
        if name == "nvmlEventSetWait_v2":
            if not self.events:
                return 10  # NVML_ERROR_TIMEOUT
            index, xid = self.events.pop(0)
            data = self.out(args[1])
            data.device, data.eventType, data.eventData = index + 1, 0x8, xid
            return 0
        gpu = self.gpus[args[0].value - 1]
        if name not in gpu:
            return 3  # NVML_ERROR_NOT_SUPPORTED
        values = gpu[name]
        # (the ECC call's error type and counter type come before its result)
        targets = [self.out(a) for a in args[3 if name == "nvmlDeviceGetTotalEccErrors" else 1:]]
        for target, value in zip(targets, values, strict=True):
            if isinstance(target, ctypes.Structure):
                target.busId = value
            elif isinstance(target, ctypes.Array):
                target[0] = value
            else:
                target.value = value
        return 0


H100 = {"nvmlDeviceGetPciInfo_v3": [b"00000000:18:00.0"],
        "nvmlDeviceGetTotalEccErrors": [0],
        "nvmlDeviceGetRemappedRows": [0, 0, 0, 0],
        "nvmlDeviceGetCurrPcieLinkWidth": [16], "nvmlDeviceGetMaxPcieLinkWidth": [16],
        "nvmlDeviceGetCurrPcieLinkGeneration": [5], "nvmlDeviceGetMaxPcieLinkGeneration": [5],
        "nvmlDeviceGetUtilizationRates": [97],
        "nvmlDeviceGetCurrentClocksEventReasons": [0x1 | 0x4]}  # idle + SW power cap: normal
"""An H100's answers; it has no retired pages (Ampere and newer remap rows instead)."""

"""Runs on a node over one long-lived ssh session and prints a JSON sample every interval.

Shipped like the guard (source over stdin). GPU figures come from NVML (nvidia-ml-py) when it
is importable and a driver is loaded; CPU, RAM and network from psutil, or from /proc when the
node's Python has no psutil. Stops when stdin closes (the head went away).

  stdin  line 2  JSON config: {"interval": seconds}
  stdout         frames of ``node.wire``: ``hello``, then ``sample {json}`` every interval
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any, TypedDict

from ptcluster.node.sharing.leases import held_all, user_name
from ptcluster.node.sharing.records import MAX_LEASES, lease_of, rank_count
from ptcluster.node.warm.pools import listed
from ptcluster.node.wire import (
    MAX_FRAME,
    GpuSample,
    JobSample,
    Kind,
    LeaseRecord,
    Sample,
    encode,
    hello,
)


class Cpu:
    """CPU % and RAM, psutil first, /proc otherwise."""

    def __init__(self) -> None:
        try:
            import psutil
            self.psutil: Any = psutil
            psutil.cpu_percent(None)
        except ImportError:
            self.psutil = None
            self.last = self._stat()

    @staticmethod
    def _stat() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals), idle

    def percent(self) -> float:
        if self.psutil:
            return float(self.psutil.cpu_percent(None))
        total, idle = self._stat()
        dt, di = total - self.last[0], idle - self.last[1]
        self.last = (total, idle)
        return round(100.0 * (dt - di) / dt, 1) if dt > 0 else 0.0

    def memory(self) -> dict[str, int]:
        if self.psutil:
            vm = self.psutil.virtual_memory()
            return {"used": int(vm.total - vm.available), "total": int(vm.total)}
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        return {"used": info["MemTotal"] - info.get("MemAvailable", info["MemFree"]),
                "total": info["MemTotal"]}


def net_bytes() -> tuple[int, int]:
    """(rx, tx) bytes over every interface but loopback."""
    rx = tx = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, data = line.split(":", 1)
            if name.strip() == "lo":
                continue
            fields = data.split()
            rx += int(fields[0])
            tx += int(fields[8])
    return rx, tx


class Gpus:
    def __init__(self) -> None:
        self.nvml: Any = None
        self.error: str | None = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
        except ImportError:
            self.error = "nvidia-ml-py not installed"
        except Exception as exc:  # noqa: BLE001 - NVMLError: no driver / no GPU
            self.error = str(exc) or type(exc).__name__

    def sample(self) -> list[GpuSample]:
        if self.nvml is None:
            return []
        nv = self.nvml
        out = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            util = nv.nvmlDeviceGetUtilizationRates(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            gpu: GpuSample = {"index": i, "name": _text(nv.nvmlDeviceGetName(h)),
                              "util": util.gpu, "mem_used": mem.used, "mem_total": mem.total,
                              "uuid": None, "power_w": None, "power_limit_w": None,
                              "temp_c": None}
            try:  # (dcgm-exporter's UUID label: `monitor --serve`)
                gpu["uuid"] = _text(nv.nvmlDeviceGetUUID(h))
            except Exception:  # noqa: BLE001
                pass
            try:
                gpu["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000
                gpu["power_limit_w"] = nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000
            except Exception:  # noqa: BLE001 - not supported on every board
                gpu["power_w"] = gpu["power_limit_w"] = None
            try:
                gpu["temp_c"] = nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
            except Exception:  # noqa: BLE001
                gpu["temp_c"] = None
            out.append(gpu)
        return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def jobs(leased: list[LeaseRecord]) -> dict[str, JobSample]:
    """Every ptcluster job on this node, any user's, from the leases its guard holds here:
    job id -> user, ranks, GPUs. (Not from /proc/*/environ, which shows only one's own.)"""
    here = socket.gethostname()
    found: dict[str, JobSample] = {}
    for r in leased:
        if r.get("node") != here or not r.get("job_id"):
            continue
        job = found.setdefault(str(r["job_id"]), {"user": r.get("user"), "ranks": 0,
                                                  "gpus": []})
        kind, value = lease_of(r)
        if kind == "job":
            job["ranks"] = rank_count(r)
        elif kind == "gpu" and value.isdigit():
            job["gpus"] = sorted([*job["gpus"], int(value)])
    return found


def fitted(sample: Sample, limit: int) -> bytes:
    """``sample``'s frame, at most ``limit`` bytes: the head closes a channel whose frame is
    longer (``wire.MAX_FRAME``), and other users' lease records (thousands, each up to 32
    texts) could make it so. The lease records are halved until it fits (the jobs counted
    again from those kept); the figures stay (L3)."""
    frame = encode(Kind.SAMPLE, sample)
    while len(frame) > limit and sample["leases"]:
        kept = sample["leases"][:len(sample["leases"]) // 2]
        sample = Sample(**{**sample, "leases": kept, "jobs": jobs(kept)})
        frame = encode(Kind.SAMPLE, sample)
    return frame


class SamplerConfig(TypedDict, total=False):
    """The program's config line (``monitor.watch.Monitor`` writes it)."""

    interval: float
    """Seconds between samples (default 2, at least 0.2)."""


def main() -> int:
    cfg: SamplerConfig = json.loads(sys.stdin.readline())
    sys.stdout.buffer.write(hello("sampler"))
    sys.stdout.flush()
    interval = max(0.2, float(cfg.get("interval", 2.0)))
    done = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    cpu, gpus = Cpu(), Gpus()
    last_net, last_t = net_bytes(), time.monotonic()
    done.wait(min(interval, 0.5))  # a first interval for the rates
    while not done.is_set():
        now = time.monotonic()
        rx, tx = net_bytes()
        dt = max(now - last_t, 1e-6)
        leased = held_all(unknown=True)[:MAX_LEASES]
        sample: Sample = {
            "hostname": socket.gethostname(), "time": time.time(),
            "cpu_percent": cpu.percent(), "cpus": os.cpu_count(), "mem": cpu.memory(),
            "net": {"rx_bps": (rx - last_net[0]) / dt, "tx_bps": (tx - last_net[1]) / dt},
            "gpus": gpus.sample(), "gpu_error": gpus.error, "leases": leased,
            "jobs": jobs(leased), "user": user_name(), "pools": listed(),
        }
        last_net, last_t = (rx, tx), now
        try:
            sys.stdout.buffer.write(fitted(sample, MAX_FRAME))
            sys.stdout.flush()
        except (BrokenPipeError, OSError):
            break
        done.wait(interval)
    return 0


if __name__ == "__main__":
    code = main()
    os._exit(code)

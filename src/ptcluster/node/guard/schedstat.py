"""What the node sees of its ranks' time, for the head's straggler report
(``launch.supervise.straggler``).

Standard library only; shipped with the guard (shipped by ``remote.bootstrap``). Nothing runs
inside a rank for it: the guard reads ``/proc`` with every second heartbeat (``wire.timing_every``).

Per rank, of its process's **main thread** (``/proc/PID/task/PID/schedstat``: nanoseconds on a
CPU, nanoseconds runnable but waiting for one), over the interval since the last look: ``span``
(wall seconds), ``run`` and ``delay`` (seconds). The rest of the span the thread was asleep or
blocked; in a synchronous data-parallel job that is mostly the wait inside collectives (gloo's
waiting main thread sleeps on a futex: measured here, ``benchmarks/straggler_threshold.py``), and
the rank the others wait for sleeps least. ``delay`` counts a CPU quota's throttling too (a busy
loop under a 25 % quota waited 1.52 s in 2 s here). Plus the collectives the rank completed in the
interval, where its stack probe reports the flight recorder's counters (already sent for the
hang watch; None without them).

Of the node: the share of memory available (``/proc/meminfo``) and, where NVML is importable, the
mean GPU utilization (%).
"""

from typing import Any


class SchedstatMeter:
    """Each rank's main-thread figures since the previous ``sample``."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, float, int, int, float]] = {}
        """rank -> (pid, sampled at, run ns, delay ns, completed collectives or -1)."""
        self.nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
        except Exception:  # noqa: BLE001 - no pynvml, no driver, no GPU: no GPU figure
            self.nvml = None

    def sample(self, pids: dict[int, int], completed: dict[int, float],
               now: float) -> dict[str, dict[str, Any]]:
        """rank (as text) -> ``{span, run, delay, collectives}``; a rank's first look (or a new
        pid) gives nothing yet. ``completed``: rank -> collectives completed so far (from its
        probe; absent when unknown)."""
        out: dict[str, dict[str, Any]] = {}
        for rank, pid in pids.items():
            got = main_thread_schedstat(pid)
            if got is None:
                self.last.pop(rank, None)
                continue
            count = int(completed.get(rank, -1))
            prev = self.last.get(rank)
            self.last[rank] = (pid, now, got[0], got[1], count)
            if prev is None or prev[0] != pid or now <= prev[1]:
                continue
            figures: dict[str, Any] = {"span": round(now - prev[1], 3),
                                       "run": round((got[0] - prev[2]) / 1e9, 4),
                                       "delay": round((got[1] - prev[3]) / 1e9, 4),
                                       "collectives": count - prev[4]
                                       if count >= 0 and prev[4] >= 0 else None}
            out[str(rank)] = figures
        for rank in list(self.last):
            if rank not in pids:
                del self.last[rank]
        return out

    def node(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        mem = meminfo()
        if mem.get("MemTotal") and "MemAvailable" in mem:
            out["mem_available"] = round(mem["MemAvailable"] / mem["MemTotal"], 3)
        if self.nvml is not None:
            try:
                nv = self.nvml
                utils = [nv.nvmlDeviceGetUtilizationRates(nv.nvmlDeviceGetHandleByIndex(i)).gpu
                         for i in range(nv.nvmlDeviceGetCount())]
                if utils:
                    out["gpu_util"] = round(sum(utils) / len(utils), 1)
            except Exception:  # noqa: BLE001 - NVML errors: no GPU figure this time
                pass
        return out


def main_thread_schedstat(pid: int) -> tuple[int, int] | None:
    """(run ns, run delay ns) of ``pid``'s main thread; None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            fields = f.read().split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


def meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0])
    except OSError:
        pass
    return out

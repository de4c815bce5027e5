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

Of the node: the share of memory available (``/proc/meminfo``), where NVML is importable the
mean GPU utilization (%), and where a CPU quota holds the ranks back, the share of its periods in
which their CPU group was throttled (``cpu_throttled``: ``cpu.stat``'s ``nr_throttled`` over
``nr_periods`` since the last look, the most of the ranks' groups). The main thread's ``delay``
alone does not show a quota reliably: since Linux 6.18 a throttled task is taken off the run
queue when it returns to user space (its wait is then sleep, not delay), and the main thread of
a throttled rank also sleeps while its own communication threads wait for the quota (a CI run:
the capped rank asleep 60 % of its window, its delay under the 25 % that names a saturated CPU).
"""

from collections.abc import Iterable
from typing import Any

from ptcluster.node.wire import NodeTiming, RankTiming


class SchedstatMeter:
    """Each rank's main-thread figures since the previous ``sample``."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, float, int, int, int]] = {}
        """rank -> (pid, sampled at, run ns, delay ns, completed collectives or -1)."""
        self.groups: dict[str, tuple[int, int]] = {}
        """The ranks' CPU groups' ``cpu.stat`` at the last look: path -> (periods, throttled)."""
        self.throttled: float | None = None
        """The share of periods throttled since the previous look (None: no quota seen)."""
        self.nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
        except Exception:  # noqa: BLE001 - no pynvml, no driver, no GPU: no GPU figure
            self.nvml = None

    def sample(self, pids: dict[int, int], completed: dict[int, float],
               now: float) -> dict[str, RankTiming]:
        """rank (as text) -> ``{span, run, delay, collectives}``; a rank's first look (or a new
        pid) gives nothing yet. ``completed``: rank -> collectives completed so far (from its
        probe; absent when unknown)."""
        out: dict[str, RankTiming] = {}
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
            figures: RankTiming = {"span": round(now - prev[1], 3),
                                   "run": round((got[0] - prev[2]) / 1e9, 4),
                                   "delay": round((got[1] - prev[3]) / 1e9, 4),
                                   "collectives": count - prev[4]
                                   if count >= 0 and prev[4] >= 0 else None}
            out[str(rank)] = figures
        for rank in list(self.last):
            if rank not in pids:
                del self.last[rank]
        self.look_at_groups(pids.values())
        return out

    def look_at_groups(self, pids: Iterable[int]) -> None:
        """``throttled``: of the ranks' CPU groups, the highest share of periods throttled since
        the previous look (a group with no period elapsed, or no quota, says nothing)."""
        mounts = cgroup_mounts("cpu")
        now: dict[str, tuple[int, int]] = {}
        for pid in set(pids):
            path = cpu_group(pid, mounts)
            if path and path not in now:
                got = cpu_stat(path)
                if got is not None:
                    now[path] = got
        shares = [(throttled - self.groups[path][1]) / (periods - self.groups[path][0])
                  for path, (periods, throttled) in now.items()
                  if path in self.groups and periods > self.groups[path][0]]
        self.groups = now
        self.throttled = round(max(shares), 3) if shares else None

    def node(self) -> NodeTiming:
        out: NodeTiming = {}
        mem = meminfo()
        if mem.get("MemTotal") and "MemAvailable" in mem:
            out["mem_available"] = round(mem["MemAvailable"] / mem["MemTotal"], 3)
        if self.throttled is not None:
            out["cpu_throttled"] = self.throttled
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


def cgroup_mounts(controller: str) -> dict[str, str]:
    """Where ``controller`` ("cpu", "memory") is: ``{"v1": PATH}`` (a ``cgroup`` mount with it
    among its options) and ``{"v2": PATH}`` (the unified hierarchy)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 4:
                    continue
                if fields[2] == "cgroup2":
                    found.setdefault("v2", fields[1])
                elif fields[2] == "cgroup" and controller in fields[3].split(","):
                    found.setdefault("v1", fields[1])
    except OSError:
        pass
    return found


def cpu_group(pid: int, mounts: dict[str, str]) -> str | None:
    """The folder of ``pid``'s CPU group (v1's ``cpu`` controller first, else the unified
    hierarchy's); None when it has none here."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "cpu" in controllers.split(",") and "v1" in mounts:
            return mounts["v1"] + path
    for line in lines:
        if line.startswith("0::") and "v2" in mounts:
            return mounts["v2"] + line[3:]
    return None


def cpu_stat(folder: str) -> tuple[int, int] | None:
    """A CPU group's ``(nr_periods, nr_throttled)`` (v1 and v2 both name them so); None where
    it has no quota's figures."""
    got: dict[str, int] = {}
    try:
        with open(folder + "/cpu.stat") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in ("nr_periods", "nr_throttled"):
                    got[key] = int(value)
    except (OSError, ValueError):
        return None
    if len(got) < 2:
        return None
    return got["nr_periods"], got["nr_throttled"]


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

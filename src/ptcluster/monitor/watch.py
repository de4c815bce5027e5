"""Head side of `ptcluster monitor`: one sampler session per node, latest sample per node.

A node that cannot be reached (or whose session dies) is reported as such while the others
keep updating.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from ptcluster.monitor.sampler import CONTROL
from ptcluster.remote.bootstrap import node_argv, preamble
from ptcluster.remote.transport import Transport, explain_channel_failure
from ptcluster.spec.model import ClusterSpec


@dataclass
class NodeView:
    host: str
    sample: dict[str, Any] | None = None
    error: str | None = None
    updated: float | None = None


class Monitor:
    def __init__(self, spec: ClusterSpec, transports: dict[str, Transport],
                 interval: float = 2.0) -> None:
        self.spec = spec
        self.views = {n.host: NodeView(host=n.host) for n in spec.nodes}
        self.lock = threading.Lock()
        self.procs = {}
        for node in spec.nodes:
            try:
                proc = transports[node.host].spawn(node_argv(node.python))
            except OSError as exc:
                self.views[node.host].error = str(exc)
                continue
            self.procs[node.host] = proc
            assert proc.stdin is not None
            try:
                proc.stdin.write(preamble("ptcluster.monitor", "sampler.py",
                                          {"interval": interval}))
                proc.stdin.flush()
            except OSError:
                pass
            threading.Thread(target=self._read, args=(node.host, node.python, proc.stdout,
                                                      proc.stderr), daemon=True).start()

    def _read(self, host: str, python: str, out: IO[bytes], err: IO[bytes]) -> None:
        for raw in iter(out.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith(CONTROL + "sample "):
                sample = json.loads(line[len(CONTROL) + 7:])
                with self.lock:
                    view = self.views[host]
                    view.sample, view.error, view.updated = sample, None, time.time()
        stderr = err.read().decode(errors="replace").splitlines()
        code = self.procs[host].wait()
        problem, _ = explain_channel_failure(stderr, code, python)
        with self.lock:
            self.views[host].error = f"unreachable: {problem}"

    def snapshot(self) -> list[NodeView]:
        with self.lock:
            return [NodeView(v.host, v.sample, v.error, v.updated) for v in self.views.values()]

    def wait_first(self, timeout: float) -> None:
        """Until every node has a sample or an error, or ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(v.sample is not None or v.error for v in self.snapshot()):
                return
            time.sleep(0.05)
        with self.lock:
            for view in self.views.values():
                if view.sample is None and view.error is None:
                    view.error = f"no sample within {timeout:.0f} s"

    def close(self) -> None:
        for proc in self.procs.values():
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except Exception:  # noqa: BLE001
                proc.kill()
                proc.wait()

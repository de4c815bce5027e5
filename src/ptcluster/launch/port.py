"""The rendezvous port of a job: ``--port``, the cluster file's, or one free at launch.

Apart from the pure plan because finding a free port binds a socket on this machine.
"""

from __future__ import annotations

import socket

from ptcluster.cluster.model import ClusterSpec
from ptcluster.launch.plan import AUTO_PORT


def free_port() -> int:
    """A TCP port free on loopback now (the local cluster's rendezvous, like --standalone)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_port(spec: ClusterSpec, override: int | None) -> int:
    """The rendezvous port: ``--port``, else ``master.port``; ``auto`` is a free port on the
    local cluster (the head is its master) and else :data:`AUTO_PORT`, for the master node's
    guard to choose at launch."""
    if override is not None:
        return override
    if spec.master.port is not None:
        return spec.master.port
    return free_port() if spec.local else AUTO_PORT

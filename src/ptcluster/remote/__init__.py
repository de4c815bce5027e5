"""How we reach a node: transports (local, OpenSSH) and the node-side guard."""

from __future__ import annotations

from ptcluster.remote.transport import LocalTransport, SshTransport, Transport, transport_for

__all__ = ["LocalTransport", "SshTransport", "Transport", "transport_for"]

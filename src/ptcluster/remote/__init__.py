"""How the head reaches a node: transports (local, OpenSSH, srun; chosen in ``connect``), the
node channel, the packer of node programs, code sync. The node side itself is ``ptcluster.node``."""

from __future__ import annotations

from ptcluster.remote.transport import LocalTransport, SshTransport, Transport

__all__ = ["LocalTransport", "SshTransport", "Transport"]

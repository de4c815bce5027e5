"""What the head remembers of each node after shipping it the project's environment: its
platform (what the environment is resolved for), the torch and ptcluster beneath, and the
digests it was seen to have.

With it, a ``run`` whose environment is unchanged opens no session before the launch (the one
that asked each node what it has cost 0.87 s of every such run): the head computes each node's
digest from what it remembers and launches at once; the node's guard checks the environment
before any rank starts (``node.guard.prechecks.project_environment``) and, when it is missing
or changed, refuses with a named reply, and the runner ships and builds it (``ship``, the one
path) and launches again. A node the head knows nothing of, or whose remembered digests do not
include the one wanted now (a changed lock), is shipped first, as before.

One JSON file per node under ``~/.cache/ptcluster/nodes/`` (private to this user), named by
the digest of how the head reaches it and where its environments live: another user, port,
interpreter or root is another node.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ptcluster.cluster.model import NodeSpec
from ptcluster.venvs.resolved import Platform

DEFAULT_KNOWN = "~/.cache/ptcluster/nodes"
KEEP_DIGESTS = 8
"""Digests remembered per node (the most recent first): switching between a few locks stays
optimistic."""


@dataclass(frozen=True)
class Known:
    """One node as the head last saw it."""

    platform: Platform
    torch: str
    ptcluster: str
    digests: tuple[str, ...]
    """Environments the node had after a ship, the most recent first."""


class KnownNodes:
    """The head's records of its nodes (``root``: created on first write, mode 0700)."""

    def __init__(self, root: Path | str = DEFAULT_KNOWN) -> None:
        self.root = Path(root).expanduser()

    def path(self, node: NodeSpec, env_root: str) -> Path:
        key = json.dumps([node.host, repr(node.ssh), node.python, env_root])
        return self.root / f"{hashlib.sha256(key.encode()).hexdigest()}.json"

    def get(self, node: NodeSpec, env_root: str) -> Known | None:
        """The record of ``node``; None when there is none or it cannot be read (the head
        then asks the node, as on a first run)."""
        try:
            raw = json.loads(self.path(node, env_root).read_text())
            p = raw["platform"]
            return Known(Platform(str(p["python"]), str(p["machine"]), str(p["glibc"])),
                         str(raw["torch"]), str(raw["ptcluster"]),
                         tuple(str(d) for d in raw["digests"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, node: NodeSpec, env_root: str, facts: dict[str, Any], digest: str) -> None:
        """Remember ``node``'s ``facts`` (``venvs`` agent's) and that it has ``digest`` now.
        Best effort: a record that cannot be written only costs the next run a session."""
        old = self.get(node, env_root)
        digests = [digest, *(d for d in (old.digests if old else ()) if d != digest)]
        record = {"platform": {k: str(facts.get(k) or "") for k in ("python", "machine",
                                                                     "glibc")},
                  "torch": str(facts.get("torch") or ""),
                  "ptcluster": str(facts.get("ptcluster") or ""),
                  "digests": digests[:KEEP_DIGESTS]}
        path = self.path(node, env_root)
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            part = path.with_name(f".{path.name}.{os.getpid()}")
            part.write_text(json.dumps(record))
            os.replace(part, path)
        except OSError:
            pass

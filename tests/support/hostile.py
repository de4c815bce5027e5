"""A hostile node for the head's reply checks (issue 43): a real process that speaks the
channel's protocol (frames of the shipped ``node.wire``) and answers one frame of its own
making, read from a file, to whatever program the head ships."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ptcluster.node import wire
from ptcluster.remote.transport import Transport

PROGRAM = """\
import json, sys
sys.path.insert(0, sys.argv[1])
import wire
sys.stdin.readline(); sys.stdin.readline()
with open(sys.argv[4]) as f:
    payload = json.load(f)
sys.stdout.buffer.write(wire.hello(sys.argv[2]) + wire.encode(sys.argv[3], payload))
sys.stdout.flush()
for line in sys.stdin:
    if not line.startswith("hb"):
        break
"""


@dataclass
class HostileTransport(Transport):
    """Runs :data:`PROGRAM` instead of the shipped program: ``hello`` as ``program``, then
    ``kind`` with the JSON in ``payload``."""

    host: str
    program: str
    kind: str
    payload: Path

    def argv(self, node_argv: list[str]) -> list[str]:
        return [sys.executable, "-I", "-c", PROGRAM, str(Path(wire.__file__).parent),
                self.program, self.kind, str(self.payload)]

"""The framing every node channel speaks, both ways: one frame per line, ``KIND PAYLOAD``.

Standard library only, and inlined into every program shipped to a node (``remote.bootstrap``
puts this source in front of the program's own), so the head and its node programs always
agree on it. Two shapes of frame:

* control frames: ``KIND JSON`` (``hello``, ``ready``, ``exit``, ``hb``, ``go``, ``stop``, ...);
* text frames for output, cheap at high line rates: ``o RANK TEXT`` and ``e RANK TEXT`` (a
  rank's stdout / stderr line) and ``a TEXT`` (a line of the node program's own child, e.g.
  torchrun's agent). A text frame's payload is never parsed as JSON, so nothing a job prints can
  pass for a control frame.

The first frame of a node program is ``hello {"v": VERSION, "program": ..., "pid": ...,
"time": ...}``; the head refuses a version it does not speak.
"""

import json
import time

VERSION = 2
RSTART, REXIT, RERROR, RDATA = "rstart", "rexit", "rerror", "rdata"
"""Control frames that carry a rank's records (``node.rank_wire``) from its guard to the head."""
RANK_FRAMES = {"start": RSTART, "exit": REXIT, "error": RERROR, "data": RDATA}
"""The frame for each rank record kind (``rank_wire.START``, ``EXIT``, ``ERROR``, ``REPORT``)."""
TIMING = "timing"
"""Guard -> head, every ``timing_every`` s while ranks run: ``timing {t, ranks, node}``, per rank
its main thread's ``{span, run, delay, collectives}`` since the last frame and the node's
``{mem_available, gpu_util}`` (``node.busy``; the head's ``launch.straggler`` decides)."""
TIMING_EVERY = 2.0
"""Seconds between two ``timing`` frames of a guard that beats every second."""


def timing_every(heartbeat_every: float) -> float:
    """Seconds between two ``timing`` frames of a guard that beats every ``heartbeat_every`` s
    (the head's config: longer on large clusters): one with every second heartbeat."""
    return max(TIMING_EVERY, 2 * heartbeat_every)


def encode(kind: str, payload: object = None) -> bytes:
    """A control frame: ``kind`` plus its JSON payload (``{}`` when None)."""
    body = json.dumps({} if payload is None else payload, separators=(",", ":"))
    return f"{kind} {body}\n".encode()


def encode_text(kind: str, rank: int | None, line: bytes) -> bytes:
    """A text frame for one output line (``line`` without its newline)."""
    if rank is None:
        return kind.encode() + b" " + line + b"\n"
    return f"{kind} {rank} ".encode() + line + b"\n"


def hello(program: str) -> bytes:
    import os

    return encode("hello", {"v": VERSION, "program": program, "pid": os.getpid(),
                            "time": time.time()})


def split(line: str) -> tuple[str, str]:
    """``(kind, payload)`` of one received frame (its newline already removed)."""
    kind, _, payload = line.partition(" ")
    return kind, payload


def control(payload: str) -> dict:
    """The JSON object of a control frame; ``{}`` for an empty payload.

    Raises ``ValueError`` for a payload that is not a JSON object.
    """
    if not payload:
        return {}
    value = json.loads(payload)
    if not isinstance(value, dict):
        raise ValueError(f"control frame payload is not an object: {payload[:80]!r}")
    return value

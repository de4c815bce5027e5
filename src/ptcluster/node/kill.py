"""``ptcluster kill``'s node program: signal the guard of one job on this node.

Standard library only (shipped like the others). It finds the job's lease (``job-ID``: its
guard holds it while the job runs there; the record names the guard's pid), leaves a note of
who asked (the guard reports it to its head as the cause), and signals the guard, which then
ends its part of the job as on any stop (the same job-scoped teardown: nothing else touched).
The kernel decides who may: only the job's user, or root; anyone else gets EPERM, said as is.

  stdin  line 2  JSON config: {"job_id", "signal": "TERM" | "INT" | "KILL", "by": {host, user}}
  stdout         frames of ``node.wire``: ``hello``, then ``result {json}``
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

from ptcluster.node.leases import RECORD_MODE, held_all, kill_note  # inlined
from ptcluster.node.records import write_record  # inlined
from ptcluster.node.wire import Kind, encode, hello  # inlined


def end_job(job_id: str, signame: str, by: dict) -> dict:
    here = socket.gethostname()  # (a lock directory may be shared with other nodes)
    guards = [r for r in held_all() if r.get("job_id") == job_id and r.get("node") == here
              and str(r.get("resource", "")).startswith("job-") and r.get("pid")]
    if not guards:
        return {"found": False}
    record = guards[0]
    out = {"found": True, "pid": record["pid"], "user": record.get("user")}
    try:  # the note first: the guard reads it when the signal arrives
        write_record(kill_note(job_id, uid=os.getuid()), {**by, "t": time.time()}, RECORD_MODE)
    except OSError as exc:
        out["note_error"] = str(exc)
    try:
        os.kill(int(record["pid"]), getattr(signal, "SIG" + signame))
        out["signalled"] = True
    except PermissionError:
        try:
            os.unlink(kill_note(job_id, uid=os.getuid()))
        except OSError:
            pass
        out["signalled"] = False
        owner = record.get("user") or "?"
        out["error"] = (f"job {job_id} is {owner}'s: only {owner}"
                        f"{'' if owner == 'root' else ' or root'} may end it")
    except ProcessLookupError:
        out["signalled"] = False
        out["error"] = "its guard ended meanwhile"
    return out


def main() -> int:
    cfg = json.loads(sys.stdin.readline())
    sys.stdout.buffer.write(hello("kill"))
    result = end_job(str(cfg["job_id"]), str(cfg.get("signal") or "TERM"),
                     dict(cfg.get("by") or {}))
    sys.stdout.buffer.write(encode(Kind.RESULT, result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

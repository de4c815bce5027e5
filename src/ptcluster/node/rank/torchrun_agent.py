"""torchrun's agent on a node of a job of several nodes: torch's own ``torch.distributed.run``,
with the same arguments, and one thing more: node 0 keeps the rendezvous store up until the
agent of every other node has left torch's exit barrier.

Why. With the static rendezvous ptcluster uses (``--master-addr``, ``--node-rank``), node 0's
agent hosts the TCPStore that every agent's exit barrier waits on (torch 2.13:
``elastic/rendezvous/static_tcp_rendezvous.py``, ``elastic/utils/store.py``'s ``barrier``).
When node 0 is the last to reach the barrier, its own wait returns at once and its process
ends, and the store with it, while another agent's ``add``/``wait`` is still under way. That
agent then logs "Error waiting on exit barrier" with a C++ and a Python traceback (its exit
code stays 0) after a job that succeeded: in 3 of 6 runs of a 2+1+1 job on the namespace
testbed here (2026-12-03). It is torch's pytorch/pytorch#69520 (open since 2021).

How. Node 0 creates the store's server before torchrun does, with ``multi_tenant``: every
TCPStore of one process on that port shares one server (torch's static rendezvous asks for it
the same way), so the server lives as long as this process holds it, not as long as torchrun's
agent. After a torchrun that succeeded, every other node's agent adds one to ``DONE_KEY``; the
last one sets ``ALL_KEY``; node 0 waits for it (at most ``HOLD`` seconds: a node whose agent was
killed does not answer) and only then ends. A torchrun that failed raises, as it does under
``python -m torch.distributed.run``: torch runs no exit barrier then, and the head stops the job.

It also parses torchrun's own options apart from the program's arguments (``parse``): torch's
parser saw both, and stopped at a program argument that abbreviates two of its options
(``ptcluster run train.py --nproc 3``: "ambiguous option: --nproc could match --nproc-per-node,
--nproc_per_node", exit 2 before any rank started).

Run by the guard from the file it wrote (``rank_wire.AGENT_BOOT``); torch and the standard
library only.
"""

from __future__ import annotations

import gc
import signal
import sys
from argparse import Namespace
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.run import parse_args, run

DONE_KEY, ALL_KEY = "ptcluster/agents-done", "ptcluster/agents-all-done"
"""Keys in the rendezvous store, beside torch's own (which are under the run id's prefix)."""
HOLD = 30.0
"""Seconds node 0 keeps the store up for the other agents after its torchrun succeeded. Every
other agent has passed its barrier by then unless it died (torch's own barrier waits 300 s
before that, on every node)."""
TELL = 10.0
"""Seconds another node's agent tries to reach node 0's store to say it is done."""


def parse(argv: list[str]) -> Namespace:
    """torchrun's options, and the program it starts with that program's own arguments.

    The plan's command is ``OPTIONS --no-python PROGRAM ARGS``: ARGS are the program's (the
    shim's, then the user's), never torchrun's, however they look. argparse scans every argument
    for its options first, so torch's parser took ARGS that abbreviate one of its options as
    such and refused one that abbreviates two; here it sees only OPTIONS and PROGRAM."""
    if "--no-python" not in argv:
        return parse_args(argv)
    at = argv.index("--no-python") + 2
    args = parse_args(argv[:at])
    args.training_script_args = argv[at:]
    return args


def run_agent(argv: list[str]) -> None:
    args = parse(argv)
    nodes = int(str(args.nnodes).split(":")[-1])
    host = nodes > 1 and args.node_rank == 0
    server = (TCPStore(args.master_addr, args.master_port, None, True, timedelta(seconds=TELL),
                       wait_for_workers=False, multi_tenant=True)
              if host else None)
    run(args)  # raises when torchrun failed: nothing to hold then
    if nodes < 2:
        return
    # A stop from the guard now ends this process at once (torchrun's handlers raise in Python,
    # which a wait inside the store's C++ would not see until it returned).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if server is not None:
        try:
            server.wait([ALL_KEY], timedelta(seconds=HOLD))
        except Exception:  # noqa: BLE001 - a node that never said: its own guard reports it
            pass
        return
    try:
        store = TCPStore(args.master_addr, args.master_port, None, False,
                         timedelta(seconds=TELL), wait_for_workers=False)
        if store.add(DONE_KEY, 1) == nodes - 1:
            store.set(ALL_KEY, "1")
    except Exception:  # noqa: BLE001 - node 0 gone (its hold ran out): nothing left to tell
        pass


def main() -> None:
    # as torch's ``main`` is: what ended it (node 0's store that could not start too) goes to
    # the error file the guard reads (``rank_wire.AGENT_ERROR_VAR``)
    try:
        record(run_agent)(sys.argv[1:])
    finally:
        # The process ends now: the interpreter's last collections pass over what torch
        # made unless it is frozen. They took 0.2-0.7 s here, and the job's end (the guard's
        # exit frame, the head's summary) waited for them after the last rank had ended.
        gc.freeze()


if __name__ == "__main__":
    main()

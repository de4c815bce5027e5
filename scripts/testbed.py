#!/usr/bin/env python3
"""Bring up the multi-host testbed by hand (root).

N namespace "nodes", each with its own address, hostname, /etc/hosts and a real sshd, plus a
cluster file that uses them.

    sudo .venv/bin/python scripts/testbed.py up 3 [--slots 2,1,1]
    sudo .venv/bin/python scripts/testbed.py up 3 --bare   # own root file systems (support/bare)
    # in another shell:
    .venv/bin/ptcluster run --trust-cluster-file --cluster testbed-cluster.yaml \\
        -m ptcluster.examples.mnist

With --bare, the nodes' login and password are printed, and kept as a comment in the
cluster file. Ctrl-C (or SIGTERM) tears everything down.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support import bare  # noqa: E402
from tests.support.bare import BareNode, BareOptions  # noqa: E402
from tests.support.testbed import Testbed, TestbedError  # noqa: E402


def main() -> int:
    # The whole docstring: its first line alone is no sentence, and the examples are the usage.
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["up"])
    ap.add_argument("nodes", type=int, nargs="?", default=3)
    ap.add_argument("--slots", help="comma-separated slots per node (default 1 each)")
    ap.add_argument("--cluster", default="testbed-cluster.yaml", help="where to write it")
    ap.add_argument("--bare", action="store_true",
                    help="nodes with their own root file system, a password login and no key "
                    "(sudo with a password on node 0, NOPASSWD on node 1, ufw on node 2)")
    args = ap.parse_args()
    slots = [int(s) for s in args.slots.split(",")] if args.slots else [1] * args.nodes
    if len(slots) != args.nodes:
        ap.error("--slots needs one value per node")
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        bed = Testbed(args.nodes, bare=BareOptions(nodes=(
            BareNode(sudo="password"), BareNode(sudo="nopasswd"), BareNode(ufw=True),
        )) if args.bare else False)
    except TestbedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    with bed:
        path = Path(args.cluster).resolve()
        if args.bare:
            path.write_text(bed.cluster_yaml(slots, workdir="~/project", extra=(
                f"# login: {bare.USER}, password: {bare.PASSWORD}; then `ptcluster setup "
                f"--trust-cluster-file --cluster {args.cluster} --accept-new-host-keys` (without a "
                "terminal: --password-file F, a file of mode 600)\n")))
        else:
            path.write_text(bed.cluster_yaml(slots, python=sys.executable,
                                             workdir=str(Path.cwd())))
        for node in bed.nodes:
            print(f"{node.name:<16} {node.addr:<15} netns {node.netns}")
        print(f"cluster file: {path}")
        if args.bare:  # (setup asks for it; without a terminal: --password-file, mode 600)
            print(f"login:        {bare.USER}, password: {bare.PASSWORD}")
        print(f"ssh:          ssh -F {bed.ssh_config} {bed.nodes[0].name}")
        print("Ctrl-C to tear down.", flush=True)
        done.wait()
    print("torn down.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

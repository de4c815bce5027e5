"""`ptcluster doctor`'s checks at scale: the head's work once every node's facts are in.

The facts of one node are collected for real (the facts program on this machine, over the local
transport); N nodes' facts are made from them, one address per node (on one /8, or
``--prefix 24``: 256 nodes per subnet), each node
with the peers ``doctor.collect.probe_peers`` gives it and their answers. The facts programs
themselves cannot run 1024 times here (each imports torch: ~1.5 s of CPU, on 2 cores); their
channels are the hub's, measured by ``head_scale.py``. Per N: the seconds ``run_checks``
takes (the median of ``--repeat``), per node, and the findings by status: the cost per node
must not grow with N.

    .venv/bin/python benchmarks/doctor_checks_scale.py [--nodes 64,256,1024,4096] [--repeat 3]
        [--prefix 24]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import Counter
from typing import Any

from ptcluster.cluster import local_cluster, parse_cluster_text
from ptcluster.doctor.checks import run_checks
from ptcluster.doctor.collect import collect_facts, probe_peers
from ptcluster.doctor.node_report import NodeReport
from ptcluster.remote.transport import LocalTransport


def one_node() -> NodeReport:
    spec = local_cluster(1)
    probes = collect_facts(spec, {n.host: LocalTransport(host=n.host) for n in spec.nodes},
                           master_port=0)
    report = probes[spec.nodes[0].host]
    if report.facts is None:
        raise SystemExit(f"the facts program failed here: {report.problem}")
    return report


def address(i: int) -> str:
    """Node ``i``'s address on 10.0.0.0/8 (node 0: 10.0.0.0 would be the network's; 1-based)."""
    i += 1
    return f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"


def cluster(real: NodeReport, n: int, prefix: int) -> tuple[Any, dict[str, NodeReport]]:
    """A cluster file of ``n`` nodes on ``ib0`` and every node's facts, as they would come
    (each interface on a /``prefix``: /24 puts 256 nodes on each subnet, as a routed fabric
    does; doctor warns for every node off the first node's subnet)."""
    hosts = [f"n{i}" for i in range(n)]
    spec = parse_cluster_text("master: {addr: n0, port: 29500}\nnodes:\n" + "".join(
        f"  - {{host: {h}, interface: ib0}}\n" for h in hosts), "<doctor nodes>")
    probes = {}
    for i, host in enumerate(hosts):
        facts = copy.deepcopy(real.facts)
        assert facts is not None
        facts.update(hostname=host, hostname_addrs=[address(i)])
        facts["interfaces"] = [{"name": "lo", "up": True, "ipv4": ["127.0.0.1/8"]},
                               {"name": "ib0", "up": True, "ipv4": [f"{address(i)}/{prefix}"]}]
        facts["master"] = {"addrs": [address(0)], "route_dev": "ib0", "interface": "ib0",
                           "interface_error": ""}
        peers = probe_peers(i, n)
        facts["peers"] = {hosts[j]: {"addrs": [address(j)], "route_dev": "ib0"} for j in peers}
        facts["listening"] = {"master": 29500 if i == 0 else None, "ephemeral": 40000,
                              "master_error": None}
        connects = [{"label": "master", "host": "n0", "port": 29500, "error": None, "ms": 0.2}]
        connects += [{"label": f"peer:{hosts[j]}", "host": address(j), "port": 40000,
                      "error": None, "ms": 0.2} for j in peers]
        probes[host] = NodeReport(host=host, facts=facts, ssh_s=real.ssh_s,
                                  clock_offset=real.clock_offset, connects=connects)
    return spec, probes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="64,256,1024,4096")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=8,
                    help="the interfaces' prefix length (24: 256 nodes per subnet)")
    args = ap.parse_args()
    real = one_node()
    print(f"# interfaces on /{args.prefix}")
    print("| nodes | run_checks s (median) | ms per node | findings |")
    print("| --- | --- | --- | --- |")
    for n in (int(x) for x in args.nodes.split(",")):
        spec, probes = cluster(real, n, args.prefix)
        times, findings = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            findings = run_checks(spec, probes)
            times.append(time.perf_counter() - t0)
        took = statistics.median(times)
        counts = Counter(f.status for f in findings)
        print(f"| {n} | {took:.3f} | {1000 * took / n:.2f} | "
              f"{', '.join(f'{k} {v}' for k, v in sorted(counts.items()))} |", flush=True)


if __name__ == "__main__":
    main()

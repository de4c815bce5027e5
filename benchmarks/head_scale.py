"""The head at scale: the real runner and supervisor with M fake nodes x 8 ranks
(``tests/support/fakenode.py``: the head<->guard protocol from the shipped wire module, one
process per node, over the local transport).

Per (nodes, lines/s per rank), one head process each (a fresh one: nothing carries over):
- cpu: the head's CPU (user+sys) over the steady part of the job, % of one core (less the
  benchmark's own sampling of ``/proc/self``); reads/s: its read system calls a second then;
- rss MB, threads, fds (and fds per node): the head's peaks from ``/proc/self``;
- ready: from the start until every node is ready (the runner's own "all N node(s) ready");
  the fake nodes' own start-up on this machine's cores is most of it at scale;
- stop: one node's rank fails; the time from that failure until the head queued the last
  ``stop``, until it had written the last one into its node's pipe, and until the last fake
  node read it (one machine, one clock). The last is mostly how long 1024 processes wait
  for this machine's 2 cores;
- lost: lines the fake nodes sent minus lines in the rank logs (must be 0).
Under ``--soft-nofile 1024`` each head starts with the soft open-file limit of a default
Ubuntu login (the hard limit is left as it is, as there) and raises it as ``ptcluster`` does.

    .venv/bin/python benchmarks/head_scale.py [--nodes 16,64,256,1024] [--rates 0,1,10]
        [--seconds 15] [--soft-nofile 1024] [--fakes-idle] [--hold S] [--heartbeat S]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import ROOT, cpu, last_json, proc_status

sys.path.insert(0, str(ROOT))
from tests.support.fakenode import fake_job  # noqa: E402


def head(nodes: int, rate: float, seconds: float, fail: bool) -> dict[str, Any]:
    """One job in this process; its figures."""
    from ptcluster.cli import raise_open_files_limit
    from ptcluster.launch.options import RunOptions
    from ptcluster.launch.runner import Runner
    from ptcluster.remote.channel import NodeChannel
    from ptcluster.remote.hub import Hub

    if os.environ.get("HEAD_SCALE_WINDOW"):  # (the fan-out window, to compare)
        import ptcluster.remote.channel as channel

        channel.FANOUT = int(os.environ["HEAD_SCALE_WINDOW"])
    raise_open_files_limit()
    tmp = Path(tempfile.mkdtemp(prefix="head-scale-"))
    events = tmp / "events"
    os.environ.update(FAKE_RATE=str(rate), FAKE_SECONDS=str(seconds), FAKE_EVENTS=str(events))
    if fail:
        os.environ["FAKE_FAIL"] = f"f{nodes // 2}:{min(6.0, seconds / 2)}"
    plan, transports = fake_job(nodes)
    told: list[float] = []  # when the head queued each "stop" (its share of a teardown)
    written: list[float] = []  # when the head's write of each "stop" had reached the pipe
    unwritten: set[NodeChannel] = set()
    send, write = NodeChannel.send, Hub._write

    def counted_send(channel: NodeChannel, kind: str, payload: Any = None) -> None:
        if kind == "stop":
            told.append(time.time())
            unwritten.add(channel)
        send(channel, kind, payload)

    def counted_write(hub: Hub, link: Any) -> None:  # (the hub's record of a channel)
        write(hub, link)
        channel = link.channel
        if channel in unwritten and not channel.pending()[0]:
            unwritten.discard(channel)
            written.append(time.time())

    NodeChannel.send = counted_send  # type: ignore[method-assign]
    Hub._write = counted_write  # type: ignore[method-assign]
    statuses: list[str] = []
    ready_at: list[float] = []
    t0 = time.monotonic()

    def on_status(text: str) -> None:
        statuses.append(text)
        if "node(s) ready in" in text and not ready_at:
            ready_at.append(time.monotonic() - t0)

    samples: list[tuple[float, float, int, int, int, float, int]] = []
    done = threading.Event()

    own = [0.0]  # this sampler's own CPU (listing 11 000 fds is not the head's work)

    def sample() -> None:
        while not done.wait(0.5):
            before = time.thread_time()
            status = proc_status()
            own[0] += time.thread_time() - before
            samples.append((time.monotonic() - t0, cpu() - own[0], *status, os.times().system,
                            reads()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    beat = float(os.environ.get("HEAD_SCALE_HEARTBEAT") or 0)  # (see --heartbeat)
    opts = RunOptions(ready_timeout=600.0, stop_deadline=30.0, **(
        {"heartbeat_interval": beat, "guard_heartbeat_timeout": 20 * beat,
         "node_silence": 20 * beat} if beat else {}))
    runner = Runner(plan, transports, tmp / "run", on_status=on_status, options=opts)
    result = runner.run()
    done.set()
    sampler.join()
    logged = sum(sum(1 for _ in open(p)) for p in (tmp / "run").glob("rank*.log"))
    sent, fail_t, stops = 0, None, []
    for line in events.read_text().splitlines() if events.exists() else []:
        host, kind, *rest = line.split()
        if kind == "sent":
            sent += int(rest[0])
        elif kind == "fail":
            fail_t = float(rest[0])
        elif kind == "stop":
            stops.append(float(rest[0]))
    ready = ready_at[0] if ready_at else float("nan")
    ended = min(ready + seconds, samples[-1][0] if samples else 0.0)
    steady = [s for s in samples if ready + 1.0 <= s[0] <= ended - 0.5]
    cpu_pct = sys_pct = reads_per_s = float("nan")
    if len(steady) >= 2:
        span = steady[-1][0] - steady[0][0]
        cpu_pct = 100 * (steady[-1][1] - steady[0][1]) / span
        sys_pct = 100 * (steady[-1][5] - steady[0][5]) / span
        reads_per_s = (steady[-1][6] - steady[0][6]) / span
    return {
        "nodes": nodes, "rate": rate, "ok": result.ok if not fail else len(result.failures) > 0,
        "cause": result.root_cause.message if result.root_cause and not fail else "",
        "ready": round(ready, 2), "cpu": round(cpu_pct, 1),
        "cpu_in_kernel": round(sys_pct, 1),  # (of "cpu": its system calls)
        "reads_per_s": round(reads_per_s) if reads_per_s == reads_per_s else None,  # (NaN:
        # no steady part; the head's read system calls, all files)
        "cpu_to_ready": round(min((s[1] for s in samples if s[0] >= ready),
                                  default=float("nan")), 2),
        "rss": round(max((s[2] for s in samples), default=0) / 1024, 1),
        "threads": max((s[3] for s in samples), default=0),
        "fds": max((s[4] for s in samples), default=0),
        "lost": sent - logged, "sent": sent,
        # (evaluations over every rank)
        "straggler_looks": len(runner.sup.straggler_figures()["trace"]),
        "stop": round(max(stops) - fail_t, 2) if fail and fail_t and stops else None,
        "stopped": len(stops),
        "head_told": round(max(told) - fail_t, 2) if fail and fail_t and told else None,
        "head_wrote": round(max(written) - fail_t, 2) if fail and fail_t and written else None,
        "written": len(written),
        "wrote_spread": [round(sorted(written)[int(q * (len(written) - 1))] - fail_t, 2)
                         for q in (0, 0.1, 0.5, 0.9, 1)] if fail and fail_t and written else None,
    }


def reads() -> int:
    """The read system calls this process made so far (``syscr`` of /proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscr:"))


def one(nodes: int, rate: float, seconds: float, fail: bool, soft: int | None) -> dict[str, Any]:
    def limit() -> None:
        if soft:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    argv = [sys.executable, __file__, "--one", str(nodes), str(rate), str(seconds)]
    return last_json(argv + (["--fail"] if fail else []), ROOT / "benchmarks",
                     preexec_fn=limit, nodes=nodes, rate=rate, ok=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="16,64,256,1024")
    ap.add_argument("--rates", default="0,1,10")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--soft-nofile", type=int, default=None)
    ap.add_argument("--no-fail", action="store_true", help="skip the one-node-fails runs")
    ap.add_argument("--fakes-idle", action="store_true",
                    help="fake nodes in the head's session under SCHED_IDLE: they get a CPU "
                         "only when the head does not want one (real nodes are other machines)")
    ap.add_argument("--window", type=int, default=None,
                    help="connections in their handshake at once (default: channel.FANOUT)")
    ap.add_argument("--hold", type=float, default=None,
                    help="seconds the fake guards hold output (default: the config's "
                         "output_hold; 0: a write per line, as guards wrote before)")
    ap.add_argument("--heartbeat", type=float, default=None,
                    help="seconds between heartbeats (and 20x that for both timeouts): with "
                         "30, nearly none are sent while the fake nodes start one after "
                         "another here, which real nodes do in parallel, so the head's CPU to "
                         "ready is its own start-up work alone")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--fail", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.window:
        os.environ["HEAD_SCALE_WINDOW"] = str(args.window)
    if args.heartbeat:
        os.environ["HEAD_SCALE_HEARTBEAT"] = str(args.heartbeat)
    if args.fakes_idle:
        os.environ["FAKE_SCHED"] = "idle"
    if args.hold is not None:
        os.environ["FAKE_HOLD"] = str(args.hold)
    if args.one:
        print(json.dumps(head(int(args.one[0]), float(args.one[1]), float(args.one[2]),
                              args.fail)))
        return
    print(f"# {args.seconds:.0f} s jobs, 8 ranks per fake node, soft open-file limit "
          f"{args.soft_nofile or resource.getrlimit(resource.RLIMIT_NOFILE)[0]} at start, "
          f"fan-out window {args.window or 'default'}, heartbeats "
          f"{f'every {args.heartbeat:g} s' if args.heartbeat else 'as the options say'}, "
          "output held "
          f"{'as the config says' if args.hold is None else f'{args.hold:g} s'}"
          f"{', fake nodes idle in the head session' if args.fakes_idle else ''}")
    print("| nodes | lines/s per rank | ok | head CPU % | reads/s | RSS MB | threads "
          "| fds (per node) | ready s (head CPU s by then) | lines lost |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in (int(x) for x in args.nodes.split(",")):
        for rate in (float(x) for x in args.rates.split(",")):
            r = one(n, rate, args.seconds, False, args.soft_nofile)
            if not r.get("ready"):
                print(f"| {n} | {rate:g} | **failed**: {r.get('cause')} | | | | | | | |")
                continue
            print(f"| {n} | {rate:g} | {'yes' if r['ok'] else 'no: ' + r['cause']} "
                  f"| {r['cpu']} | {r['reads_per_s']} | {r['rss']} | {r['threads']} "
                  f"| {r['fds']} ({r['fds'] / n:.1f}) | {r['ready']} ({r['cpu_to_ready']}) "
                  f"| {r['lost']} of {r['sent']} |",
                  flush=True)
    if args.no_fail:
        return
    print("\n| nodes | one node fails: the head queued the last stop after | wrote the last "
          "one into its pipe after (stops written) | the last node read it after | nodes told |")
    print("| --- | --- | --- | --- | --- |")
    for n in (int(x) for x in args.nodes.split(",")):
        r = one(n, 0, args.seconds, True, args.soft_nofile)
        print(f"| {n} | {r.get('head_told')} s | {r.get('head_wrote')} s ({r.get('written')}) "
              f"| {r.get('stop')} s | {r.get('stopped')} of {n - 1} |", flush=True)


if __name__ == "__main__":
    main()

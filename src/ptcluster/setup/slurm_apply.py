"""``setup --slurm``'s part of apply: the cluster-wide phase (every node's Slurm facts read again
once phase 1 installed slurmd, the files planned from all of them, the controller first, then
every other node, then ``scontrol reconfigure``), and the proof: ``sinfo`` shows every node idle,
then a job through Slurm on every node (``srun -N<all>``), then (``--slurm-proof trainer``, the
default) the reference trainer through ``ptcluster submit`` on every node, one epoch, run from
the controller by the login user with the venv setup made; the report gives both job ids.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from typing import Any

from ptcluster.cluster.model import NodeSpec
from ptcluster.setup import plan as P
from ptcluster.setup import steps as S
from ptcluster.setup.executor import Executor
from ptcluster.setup.report import SlurmProof, TrainerProof
from ptcluster.setup.slurm import SlurmCluster, head_munge_key, node_name, slurm_cluster

TRAINER_WAIT = 900.0
"""Seconds for the trainer's job to end (one epoch: ~10 s here, on 3 CPU nodes)."""
PROOF_DIR = "~/.ptcluster/slurm-proof"
"""Where the trainer's submit directories go, on the controller."""
IDLE_WAIT = 90.0
"""Seconds for every node to be idle once the daemons run (measured here: ~3 s)."""
CHECK_JOB = "ptcluster-setup-check"


def cluster_slurm(setup: Executor, keep: tuple[str, ...] = ()) -> SlurmCluster:
    """The cluster's Slurm from the facts at hand; the head's munge key made now unless this
    is a dry run (which changes nothing, the head included)."""
    assert setup.slurm is not None
    _, key = head_munge_key(setup.slurm.controller, create=not setup.opts.dry_run)
    addrs = {h: o.addr for h, o in setup.outcomes.items()}
    return slurm_cluster(setup.slurm, dict(setup.facts), addrs, key, keep)


def conf_nodes(conf: str | None) -> dict[str, str]:
    """Slurm's node name -> its ``NodeName=`` line, of a slurm.conf."""
    out: dict[str, str] = {}
    for line in (conf or "").splitlines():
        m = re.match(r"NodeName=(\S+)\s", line)
        if m and m.group(1) != "DEFAULT":
            out[m.group(1)] = line
    return out


def drain_removed(setup: Executor) -> tuple[str, ...]:
    """Nodes in the controller's slurm.conf but no longer in the cluster file: drained (their
    jobs finish, no new one starts there); those still running a job keep their line in
    slurm.conf until a later run (the lines returned), the others leave it now."""
    assert setup.slurm is not None
    ctl = setup.slurm.controller
    facts = setup.facts.get(ctl)
    if facts is None or not setup.reached(ctl):
        return ()
    old = conf_nodes(facts["slurm"]["files"].get("slurm.conf"))
    now = {node_name(f) for f in setup.facts.values() if f is not None}
    keep: list[str] = []
    said = setup.slurm_removed
    for name in [n for n in old if n not in now]:
        ok, _ = _run(setup, ctl, ["scontrol", "update", f"NodeName={name}", "State=DRAIN",
                                  "Reason=removed from the cluster file (ptcluster setup)"], 30)
        _, jobs = _run(setup, ctl, ["squeue", "-h", "-w", name, "-o", "%i"], 30)
        running = [j for j in jobs.split() if j.isdigit()] if ok else []
        if running:
            keep.append(old[name])
            said.setdefault("draining", []).append({"node": name, "jobs": running})
            setup.on_event(ctl, f"{name}: drained; job(s) {', '.join(running)} still run "
                           "there: it stays in slurm.conf until a later run")
        else:
            said.setdefault("removed", []).append(name)
            setup.on_event(ctl, f"{name}: drained and taken out of slurm.conf")
    return tuple(keep)


def cluster_wide(setup: Executor) -> None:
    """Phase 2 on every node (the controller first); ``scontrol reconfigure`` when a node's
    files changed."""
    assert setup.slurm is not None
    ctl = setup.slurm.controller

    def refresh(node: NodeSpec) -> None:
        setup.refresh(node.host, ["slurm"])

    setup.each(refresh, "refresh")
    setup.cluster = replace(setup.cluster, slurm=cluster_slurm(setup, drain_removed(setup)))

    def phase2(node: NodeSpec) -> None:
        setup.apply_phase(node, 2)

    setup.each(phase2, selected=True, hosts={ctl})
    setup.each(phase2, selected=True, hosts={h for h in setup.outcomes if h != ctl})
    changed = any(s == "slurm.conf" and r == "changed" for o in setup.outcomes.values()
                  for s, r, _ in o.applied)
    if changed and setup.reached(ctl) and setup.outcomes[ctl].problem is None:
        ok, out = _run(setup, ctl, ["scontrol", "reconfigure"], 60)
        setup.on_event(ctl, "scontrol reconfigure: " + ("done" if ok else f"FAILED {out}"))


def _run(setup: Executor, host: str, argv: list[str], timeout: float) -> tuple[bool, str]:
    return setup.act(host, S.StepAction(tuple(argv), root=True, timeout=timeout))


SUMMARY_OF = ("import glob, json, sys\n"
              "runs = sorted(glob.glob(sys.argv[1] + '/*/summary.json'))\n"
              "s = json.load(open(runs[-1])) if runs else {}\n"
              "print(json.dumps({'outcome': s.get('outcome'), 'ranks': [{'host': r.get('host')}"
              " for r in s.get('ranks') or []]}))")
"""Run on the controller with the venv's python: what the proof needs of the newest run's
``summary.json`` in a submit directory (the run directories are named by time), in a few
hundred bytes (an action's output is capped at 4,000 characters; a summary is longer)."""


def _summary(setup: Executor, ctl: str, log: str | None) -> dict[str, Any]:
    """``outcome`` and ``ranks`` (their hosts) of the last ``ptcluster run``'s ``summary.json``
    in the submit directory that holds Slurm's ``log``; {} when there is none or it does not
    parse."""
    if not log or "/" not in log:
        return {}
    ok, text = setup.act(ctl, S.StepAction((P.VENV_PYTHON, "-c", SUMMARY_OF,
                                            log.rsplit("/", 1)[0])))
    try:
        said = json.loads(text.strip().splitlines()[-1]) if ok and text.strip() else {}
    except ValueError:
        return {}
    return said if isinstance(said, dict) else {}


SRUN_TRIES = 2
"""``srun``s the proof tries: one just after the daemons (re)started may fail on its I/O setup
(seen on the nspawn testbed, 2 of 4 full test runs: ``io_init_msg_unpack: unpack error``, while
``sinfo`` already said idle); the report keeps the first one's words (``retried``)."""
SRUN_AGAIN = 3.0
"""Seconds before the proof's second ``srun``."""


def verify(setup: Executor) -> SlurmProof:
    """``sinfo`` until every node is idle, then ``srun -N<all>`` on them: ``{ok, sinfo, job_id,
    ran_on, problem, seconds}``."""
    assert setup.slurm is not None
    begun = time.monotonic()
    ctl = setup.slurm.controller
    names = {node_name(f) for f in setup.facts.values() if f is not None}
    out: SlurmProof = {"ok": False, "controller": ctl, "nodes": sorted(names),
                       **setup.slurm_removed}  # type: ignore[typeddict-item]
    if not setup.reached(ctl) or setup.outcomes[ctl].problem is not None or \
            len(names) != len(setup.spec.nodes):
        out["problem"] = "not every node was reached: no job was tried"
        return out
    deadline = time.monotonic() + IDLE_WAIT
    states: dict[str, str] = {}
    while True:
        ok, text = _run(setup, ctl, ["sinfo", "-h", "-N", "-o", "%N %t"], 30)
        states = dict(line.split()[:2] for line in text.splitlines() if len(line.split()) >= 2)
        out["sinfo"] = text.strip()
        if ok and all(states.get(n) == "idle" for n in names):
            break
        if time.monotonic() > deadline:
            out["problem"] = (f"not every node idle after {IDLE_WAIT:.0f} s: " +
                              ", ".join(f"{n} {states.get(n, 'missing')}" for n in sorted(names)))
            return out
        time.sleep(1.0)
    out["idle_s"] = round(time.monotonic() - begun, 1)
    for attempt in range(SRUN_TRIES):
        ok, text = _run(setup, ctl, ["srun", "-N", str(len(names)), f"--job-name={CHECK_JOB}",
                                     "sh", "-c",
                                     'echo "ptcluster-check $SLURM_JOB_ID $(hostname)"'], 120)
        lines = [m.groups() for m in re.finditer(r"^ptcluster-check (\d+) (\S+)$", text, re.M)]
        ran_on = sorted({h for _, h in lines})
        if (ok and set(ran_on) == names) or attempt + 1 == SRUN_TRIES:
            break
        out["retried"] = text.strip()[-500:]
        setup.on_event(ctl, f"slurm: srun -N{len(names)} failed once ({text.strip()[-120:]}): "
                       f"trying again in {SRUN_AGAIN:.0f} s")
        time.sleep(SRUN_AGAIN)
    out["job_id"] = lines[0][0] if lines else None
    out["ran_on"] = ran_on
    out["seconds"] = round(time.monotonic() - begun, 1)
    if not ok or set(ran_on) != names:
        out["problem"] = f"srun -N{len(names)} did not run on every node: {text.strip()[-500:]}"
        return out
    setup.on_event(ctl, f"slurm: {len(names)} node(s) idle; job {out['job_id']} ran on "
                   f"{', '.join(ran_on)}")
    if setup.opts.slurm_proof == "trainer":
        out["trainer"] = trainer_job(setup, ctl, len(names))
        if not out["trainer"]["ok"]:
            out["problem"] = out["trainer"]["problem"]
            return out
    out["ok"] = True
    return out


def trainer_job(setup: Executor, ctl: str, n: int) -> TrainerProof:
    """``ptcluster submit --nodes n`` of the reference trainer (one epoch), waited for, and
    its run's ``summary.json`` read: proven when Slurm says COMPLETED and the summary says
    succeeded with one rank on each of the ``n`` nodes."""
    node = next(x for x in setup.spec.nodes if x.host == ctl)
    submit = [P.VENV_PYTHON, "-m", "ptcluster", "submit", "--nodes", str(n), "--nproc", "1",
              "--run-dir", PROOF_DIR, "--job-name", "ptcluster-setup-trainer", "--",
              "-m", "ptcluster.examples.mnist", "--epochs", "1"]
    ok, text = setup.act(ctl, S.StepAction(
        ("sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", node.workdir or "~/", *submit),
        timeout=120))
    job = text.strip().splitlines()[-1] if ok and text.strip() else ""
    out: TrainerProof = {"ok": False, "job_id": job if job.isdigit() else None}
    if not job.isdigit():
        out["problem"] = f"ptcluster submit of the reference trainer failed: {text[-500:]}"
        return out
    deadline, fields = time.monotonic() + TRAINER_WAIT, {}
    while time.monotonic() < deadline:
        _, shown = _run(setup, ctl, ["scontrol", "show", "job", job], 30)
        fields = dict(w.split("=", 1) for w in shown.split() if "=" in w)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                      "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"):
            break
        time.sleep(2.0)
    out["state"] = fields.get("JobState", "unknown")
    out["log"] = fields.get("StdOut")
    said = _summary(setup, ctl, out["log"])
    hosts = sorted({str(r.get("host")) for r in said.get("ranks") or []})
    out["outcome"] = said.get("outcome")
    out["world_size"] = len(said.get("ranks") or [])
    out["nodes"] = hosts
    out["final"] = (f"{said.get('outcome')} on {out['world_size']} rank(s) of {len(hosts)} "
                    "node(s) (its summary.json)")
    if out["state"] != "COMPLETED" or said.get("outcome") != "succeeded" or len(hosts) != n:
        out["problem"] = (f"the reference trainer's job {job} ended {out['state']}, its run "
                          f"{out['final']} (its log: {out['log']} on {ctl}); on nodes without "
                          "network, put the MNIST files in the workdir's data/ on every node, "
                          "or pass --slurm-proof srun")
        return out
    out["ok"] = True
    setup.on_event(ctl, f"slurm: the reference trainer's job {job} completed on {n} node(s)")
    return out

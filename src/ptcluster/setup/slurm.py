"""``ptcluster setup --slurm``: what the nodes' Slurm is made of -- the cluster-wide files
(``slurm.conf`` the same on every node, a ``gres.conf`` where there are GPUs, a ``cgroup.conf``
where Slurm's cgroup plugins can run) and the one munge key -- each a pure function of every
node's facts (``node/facts/slurm_facts.py``: ``slurmd -C`` read once slurmd is installed). The steps
that install and write them: ``setup.slurm_steps``; the cluster-wide phase and the proof:
``setup.slurm_apply``.

The munge key is made once, on the head (``head_munge_key``), and reaches each node as the input
of the command that writes it (over the setup channel, over ssh): never in an argv, a plan, a
report or a log; the facts carry its sha256 only.

Sources of the facts used: slurm.conf(5), gres.conf(5) and cgroup.conf(5) of Slurm 22.05 (the
ports 6817/6818 are Slurm's defaults; ``AutoDetect=nvml`` needs a slurmd built with NVML);
Debian's slurm-wlm packaging (/etc/slurm, /var/lib/slurm/{slurmctld,slurmd}, /var/log/slurm,
units with ``ConditionPathExists=/etc/slurm/slurm.conf``); munge(7) (the key: the munge user's
alone, the same on every host).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ptcluster.cluster.model import SlurmSetupSpec
from ptcluster.node.facts.setup_facts import SetupFacts
from ptcluster.node.facts.slurm_facts import HW_KEYS
from ptcluster.remote import replies

SLURM_DIR = "~/.ptcluster/slurm"
"""The head's Slurm files: one munge key per controller (``munge-HOST.key``, 0600)."""
FILES = {"slurm.conf": "/etc/slurm/slurm.conf", "gres.conf": "/etc/slurm/gres.conf",
         "cgroup.conf": "/etc/slurm/cgroup.conf"}
SRUN_PORTS = "60001-63000"
"""``SrunPortRange``: srun's ports in a known range, which the firewall step opens to the
other nodes with every other TCP port (TCP from each node to each node)."""
KEY_BYTES = 128
"""As ``mungekey`` makes them (1024 bits)."""


@dataclass(frozen=True)
class SlurmCluster:
    """What every node's Slurm steps depend on: the controller, the files, the key's digest."""

    controller: str
    files: dict[str, str]
    """name (``FILES``) -> text, the same on every node; a file not wanted is absent; none at
    all while a node's facts are missing (the files wait until every node answered)."""
    why: str
    """Which Proctrack/Task plugins, and why (said in the plan)."""
    munge_sha: str | None
    """The head's key's sha256; None: not made yet (a dry run from nothing)."""
    munge_b64: str | None = None
    """The key itself, base64 (a command's input only; None in a dry run)."""
    without_cgroup_v2: tuple[str, ...] = ()
    """The nodes without cgroup v2 (none: Slurm's cgroup plugins; else Linux's /proc)."""

    def __repr__(self) -> str:  # never the key, wherever a SlurmCluster is shown
        return f"SlurmCluster(controller={self.controller!r}, files={sorted(self.files)})"


def head_munge_key(controller: str, create: bool) -> tuple[Path, bytes | None]:
    """The cluster's key on the head (made once, 0600, when ``create``): its path and bytes."""
    path = Path(SLURM_DIR).expanduser() / f"munge-{controller}.key"
    if not path.exists() and create:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
    try:
        return path, path.read_bytes()
    except FileNotFoundError:
        return path, None


def node_name(facts: SetupFacts) -> str:
    """Slurm's name of a node: its short hostname (how slurmd finds its own line)."""
    return str(facts["hostname"]).split(".")[0]


def plugins(facts: dict[str, SetupFacts]) -> tuple[dict[str, str], str]:
    """Proctrack/Task/JobAcctGather by what every node supports: Slurm's cgroup plugins where
    every node has cgroup v2, Linux's /proc elsewhere (a cluster has one slurm.conf)."""
    v1 = sorted(h for h, f in facts.items() if f["slurm"]["cgroup"] != "v2")
    if not v1:
        return ({"ProctrackType": "proctrack/cgroup", "TaskPlugin": "task/cgroup,task/affinity",
                 "JobAcctGatherType": "jobacct_gather/cgroup"},
                "cgroup plugins: every node has cgroup v2 (untested on this project's testbed)")
    return ({"ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none",
             "JobAcctGatherType": "jobacct_gather/none"},
            f"proctrack/linuxproc, task/none: {', '.join(v1)} without cgroup v2 (no CPU/GPU "
            "binding or memory limits)")


def gpu_count(facts: SetupFacts) -> int:
    return int(gpu_count_raw(facts))


def gres_conf(facts: dict[str, SetupFacts]) -> str | None:
    """gres.conf for every node with GPUs (None: no GPU anywhere): ``AutoDetect=nvml`` where
    the node has NVML, its ``/dev/nvidiaN`` files where not."""
    lines = ["# Written by `ptcluster setup --slurm`: the same on every node."]
    for f in facts.values():
        n = gpu_count(f)
        if not n:
            continue
        name = node_name(f)
        if f["slurm"]["nvml"]:
            lines.append(f"NodeName={name} AutoDetect=nvml Name=gpu Count={n}")
        else:
            files = f["slurm"]["gpu_files"][:n]
            lines.append(f"NodeName={name} AutoDetect=off Name=gpu File=" + ",".join(files))
    return "\n".join(lines) + "\n" if len(lines) > 1 else None


def slurm_conf(spec: SlurmSetupSpec, facts: dict[str, SetupFacts],
               addrs: dict[str, str], keep: tuple[str, ...] = ()) -> tuple[str, str]:
    """slurm.conf from the nodes' facts (hosts in file order) and why its plugins; ``keep``:
    ``NodeName=`` lines of removed nodes still running jobs (drained)."""
    ctl = facts[spec.controller]
    chosen, why = plugins(facts)
    gpus = any(gpu_count(f) for f in facts.values())
    lines = [
        "# Written by `ptcluster setup --slurm` from each node's facts (slurmd -C); the same on",
        "# every node. Edits are replaced: change the cluster file and run setup again.",
        "ClusterName=ptcluster",
        f"SlurmctldHost={node_name(ctl)}({addrs[spec.controller]})",
        "AuthType=auth/munge", "CryptoType=crypto/munge", "SlurmUser=slurm",
        "StateSaveLocation=/var/lib/slurm/slurmctld", "SlurmdSpoolDir=/var/lib/slurm/slurmd",
        "SlurmctldPidFile=/run/slurmctld.pid", "SlurmdPidFile=/run/slurmd.pid",
        "SlurmctldLogFile=/var/log/slurm/slurmctld.log",
        "SlurmdLogFile=/var/log/slurm/slurmd.log",
        "SlurmctldPort=6817", "SlurmdPort=6818", f"SrunPortRange={SRUN_PORTS}",
        "SchedulerType=sched/backfill", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "MpiDefault=none", "ReturnToService=2",
        f"# {why}",
        *[f"{k}={v}" for k, v in chosen.items()],
    ]
    if gpus:
        lines.append("GresTypes=gpu")
    for host, f in facts.items():
        hw = f["slurm"]["hw"]
        gres = f" Gres=gpu:{gpu_count(f)}" if gpu_count(f) else ""
        lines.append(f"NodeName={node_name(f)} NodeAddr={addrs[host]} " +
                     " ".join(f"{k}={hw[k]}" for k in ("CPUs", "Boards", "SocketsPerBoard",
                                                       "CoresPerSocket", "ThreadsPerCore",
                                                       "RealMemory")) + gres + " State=UNKNOWN")
    lines += list(keep)
    names = {h: node_name(f) for h, f in facts.items()}
    parts = spec.partitions or (("main", tuple(facts)),)
    kept = [line.split()[0].split("=", 1)[1] for line in keep]
    for i, (pname, hosts) in enumerate(parts):
        # a kept node stays in the default partition: its running jobs are that partition's
        members = ",".join([names[h] for h in hosts if h in names] + (kept if i == 0 else []))
        lines.append(f"PartitionName={pname} Nodes={members}" + (" Default=YES" if i == 0 else "")
                     + " MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n", why


CGROUP_CONF = ("# Written by `ptcluster setup --slurm`: Slurm's cgroup plugins on cgroup v2.\n"
               "CgroupPlugin=cgroup/v2\nConstrainCores=yes\nConstrainDevices=yes\n"
               "ConstrainRAMSpace=yes\n")


def slurm_cluster(spec: SlurmSetupSpec, facts: dict[str, SetupFacts | None],
                  addrs: dict[str, str], key: bytes | None,
                  keep: tuple[str, ...] = ()) -> SlurmCluster:
    """The cluster's Slurm from the facts of every node (``facts``: every node of the file,
    None where one did not answer)."""
    sha = hashlib.sha256(key).hexdigest() if key else None
    b64 = base64.b64encode(key).decode() if key else None
    if any(f is None or "slurm" not in f for f in facts.values()):
        return SlurmCluster(spec.controller, {}, "", sha, b64)
    known = {h: f for h, f in facts.items() if f is not None}
    refused = [f"{h}: {why}" for h, f in known.items() for why in [unsafe_facts(f)] if why]
    refused += [f"a kept line {line[:80]!r}" for line in keep if not _KEPT.fullmatch(line)]
    if refused:  # (the facts were checked as they came: replies.facts_reply; this is a 2nd wall)
        return SlurmCluster(spec.controller, {}, "no Slurm files are written: " +
                            "; ".join(refused), sha, b64)
    conf, why = slurm_conf(spec, known, addrs, keep)
    guessed = sorted(h for h, f in known.items() if f["slurm"]["hw_from"] != "slurmd -C")
    if guessed:
        why += (f"; the hardware of {', '.join(guessed)} read from /sys and /proc until slurmd "
                "is there to say (slurmd -C)")
    files = {"slurm.conf": conf}
    gres = gres_conf(known)
    if gres:
        files["gres.conf"] = gres
    v1 = tuple(sorted(h for h, f in known.items() if f["slurm"]["cgroup"] != "v2"))
    if not v1:  # as ``plugins`` chose
        files["cgroup.conf"] = CGROUP_CONF
    return SlurmCluster(spec.controller, files, why, sha, b64, v1)


_KEPT = re.compile(r"NodeName=[A-Za-z0-9][A-Za-z0-9.-]*( [A-Za-z]+=[A-Za-z0-9_.,:()/-]*)*")
"""A removed node's line kept from the old slurm.conf (``slurm_apply.conf_nodes``): words alone."""


def unsafe_facts(facts: SetupFacts) -> str | None:
    """Why a node's facts may not go into the files root writes on every node (None: they
    may): each value written there is checked where it is written, whatever checked it before
    (``remote.replies``): the name a DNS name, the hardware whole numbers, ``/dev/nvidiaN``."""
    try:
        replies.hostname("hostname", facts.get("hostname"))
        replies.number(0, replies.MAX_GPUS)("gpu.count", gpu_count_raw(facts))
        hw = facts["slurm"]["hw"]
        for key in HW_KEYS:
            replies.number(0, replies.MAX_HW)(f"slurm.hw.{key}", hw.get(key))
        for i, path in enumerate(facts["slurm"].get("gpu_files") or []):
            replies.gpu_file(f"slurm.gpu_files[{i}]", path)
    except replies.BadReply as exc:
        return exc.what
    return None


def gpu_count_raw(facts: SetupFacts) -> Any:
    return facts.get("gpu", {}).get("count") or 0

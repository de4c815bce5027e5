"""Starting torchrun: the ranks' environment on this node (the head's plan, the leased GPUs, the
interface, Slurm's task variables taken out) and the child's setup between fork and exec.

Standard library only; a part of the guard (shipped by ``remote.bootstrap``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import Any

from ptcluster.node.facts.nccl_log import DEBUG_FILE, DEBUG_SUBSYS, IB, read_dir
from ptcluster.node.facts.rdma import fallback_cause, read_rdma
from ptcluster.node.guard.outbox import Outbox
from ptcluster.node.guard.prechecks import node_python
from ptcluster.node.guard.proctree import libc_prctl
from ptcluster.node.rank_wire import (
    ACCELERATE_CPU,
    AGENT_BOOT,
    AGENT_ERROR_FILE,
    AGENT_ERROR_VAR,
    AGENT_FILE,
    BACKEND_VAR,
    IFNAME_VARS,
    SHIM_FILE,
    SHIM_VAR,
    SOCK_VAR,
    TORCHRUN_LOG_VAR,
)
from ptcluster.node.wire import PRIVATE_CWD, GuardConfig, Kind, NcclChoice, ReadyFacts, encode_text

PR_SET_PDEATHSIG = 1
HANDED: dict[str, str] = dict(getattr(getattr(__spec__, "loader", None), "files", None) or {})
"""The programs this guard hands on (file name -> packed source: its ranks' shim, torchrun's
agent program): the files that came with the guard's modules (``node.importer.Shipped.files``;
none when this module was imported from a file)."""
SLURM_TASK_VARS = (
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS",
    "SLURM_NNODES", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_GTIDS", "SLURM_TASK_PID",
)
"""What an srun step tells its one task about itself (task 0 of 1 on 1 node). Left in the
ranks' environment, code that reads a rank's place from Slurm's variables instead of torchrun's
(``SLURM_PROCID`` as the rank, ``SLURM_NTASKS`` as the world) would see a world of one; the
job's own variables (SLURM_JOB_ID, SLURM_JOB_NODELIST, …) stay."""


def under_slurm() -> bool:
    """True when this guard is a Slurm task (an ``srun`` step of ``ptcluster run``).

    Slurm's preemption warning (``sbatch --signal=USR2@T``, ``scancel -s USR2``) goes to every
    process of the step: the ranks get it from Slurm, and the guard and torchrun, whose default
    action for SIGUSR2 is to die, must survive it.
    """
    return "SLURM_STEP_ID" in os.environ


def use_port(argv: list[str], port: int) -> None:
    """The rendezvous port the master's guard chose (``master.port: auto``), told with ``go``:
    into torchrun's command line (torchrun gives it to the ranks as MASTER_PORT)."""
    at = argv.index("--master-port") + 1 if "--master-port" in argv else 0
    if at:
        argv[at] = str(port)


def rank_env(cfg: GuardConfig, facts: ReadyFacts, tmpdir: str, sock: str) -> dict[str, str]:
    """torchrun's (and so the ranks') environment: this node's, less an srun task's identity,
    plus the head's plan, the leased GPUs (on a node with none, in a gloo job: Accelerate told
    so, ``rank_wire.ACCELERATE_CPU``), the interface and the rank server's socket."""
    env = dict(os.environ)
    if under_slurm():  # this step's task identity is not the ranks': RANK, WORLD_SIZE are
        for key in SLURM_TASK_VARS:
            env.pop(key, None)
    env.update(cfg["env"])
    for key, value in (cfg.get("env_defaults") or {}).items():
        env.setdefault(key, value)
    gpus = facts.get("gpus") or {}
    if gpus.get("indices") is not None:  # only the leased GPUs
        env["CUDA_VISIBLE_DEVICES"] = gpus["visible"]
    if not gpus and env.get(BACKEND_VAR, "auto") in ("gloo", "auto"):  # a CPU node's gloo job
        env.setdefault(*ACCELERATE_CPU)
    interface = facts.get("interface")
    if interface:
        for var in IFNAME_VARS:
            env.setdefault(var, interface)
    for key, value in (facts.get("rdma") or {}).items():
        if key == GID_VAR and any(k in env for k in GID_CHOOSERS):
            continue  # the user asked NCCL to choose the GID another way
        env.setdefault(key, value)  # the user's env: (and the node's own) first
    if (facts.get("gpus") or {}).get("indices") and not any(v in env for v in NCCL_LOG_VARS):
        env.update(zip(NCCL_LOG_VARS, ("INFO", DEBUG_SUBSYS, os.path.join(tmpdir, DEBUG_FILE)),
                       strict=True))
    env[SOCK_VAR] = sock
    env[SHIM_VAR] = os.path.join(tmpdir, SHIM_FILE)
    env[TORCHRUN_LOG_VAR] = tmpdir  # torchrun's own files: removed with the temp dir
    env[AGENT_ERROR_VAR] = os.path.join(tmpdir, AGENT_ERROR_FILE)
    return env


GID_VAR = "NCCL_IB_GID_INDEX"
GID_CHOOSERS = ("NCCL_IB_ADDR_FAMILY", "NCCL_IB_ADDR_RANGE", "NCCL_IB_ROCE_VERSION_NUM")
"""NCCL's own ways to pick the GID (2.21 and later): set, they leave the index to NCCL."""
NCCL_LOG_VARS = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")
"""Set on a node with GPUs unless the user's ``env:`` or the node sets one of them: NCCL's init
lines go to a file per rank in the job's directory (the console stays as it was), for
:func:`nccl_said`."""


def nccl_said(tmpdir: str, env: dict[str, str]) -> dict[str, NcclChoice]:
    """What NCCL chose on this node (``node.facts.nccl_log``: the transport, HCAs, GID index), from
    the files its ranks wrote; with the likely cause when it used sockets though the node has
    HCAs. ``{}`` when NCCL wrote nothing here."""
    found = read_dir(tmpdir) if env.get("NCCL_DEBUG_FILE", "").startswith(tmpdir) else None
    if found is None:
        return {}
    if found["gid_index"] is None and found["transport"] == IB and \
            env.get("NCCL_IB_GID_INDEX", "").lstrip("-").isdigit():
        found["gid_index"] = int(env["NCCL_IB_GID_INDEX"])  # what the ranks were given
    devices = read_rdma()
    if devices and found["transport"] != IB:
        found["hcas"] = [d["name"] for d in devices]
        found["cause"] = fallback_cause(devices, env)
    return {"nccl": found}


def agent_error(tmpdir: str) -> str:
    """What ended torchrun itself (``TYPE: TEXT``, from the file its ``@record`` writes, see
    ``rank_wire.AGENT_ERROR_VAR``); "" when it wrote none or not in that shape."""
    try:
        with open(os.path.join(tmpdir, AGENT_ERROR_FILE), "rb") as f:
            data = json.loads(f.read(1 << 20))
        message = data["message"]
        text = message["message"] if isinstance(message, dict) else message
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return text[:300] if isinstance(text, str) else ""


def child_setup(slurm: bool) -> Callable[[], None]:
    """What torchrun's process does between fork and exec: its own session, SIGINT back to its
    default, SIGUSR2 ignored under Slurm, and death with the guard (even on SIGKILL)."""
    prctl = libc_prctl()  # resolved here: the child between fork and exec stays minimal

    def setup() -> None:
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if slurm:  # torchrun would die of it; the ranks install their own handler
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        if prctl is not None:  # the job dies with the guard, even on SIGKILL
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return setup


TORCHRUN = ["-m", "torch.distributed.run"]


def agent_argv(argv: list[str], tmpdir: str) -> list[str]:
    """The plan's torchrun command (``python -m torch.distributed.run ARGS``, what one would type
    by hand) as this guard runs it: torch's same ``main`` with the same ARGS, under the agent
    program it wrote into ``tmpdir`` (``node/rank/torchrun_agent.py`` says what it adds)."""
    if argv[1:3] != TORCHRUN:
        return argv
    return [argv[0], "-c", AGENT_BOOT, os.path.join(tmpdir, AGENT_FILE), *argv[3:]]


def start_dir(cfg: GuardConfig, tmpdir: str) -> str:
    """Where torchrun and its ranks start: the workdir; for shipped code (``PRIVATE_CWD``) a
    new directory in the job's private ``tmpdir`` (removed with it), so that nothing in the
    workdir (a cloned repository) is found through '' or '.' on ``sys.path``."""
    if (cfg.get("target") or {}).get("cwd") != PRIVATE_CWD:
        return cfg["workdir"]
    path = os.path.join(tmpdir, "cwd")
    if not os.path.isdir(path):  # (a warm start that fell back cold made it already)
        os.mkdir(path, 0o700)
    return path


def start_torchrun(cfg: GuardConfig, env: dict[str, str],
                   tmpdir: str) -> subprocess.Popen[bytes]:
    """torchrun, its output (the agent's own: the ranks' comes through the rank server) on one
    pipe."""
    return subprocess.Popen(
        agent_argv(node_python(cfg["argv"]), tmpdir), cwd=start_dir(cfg, tmpdir), env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=child_setup(under_slurm()),
    )


def pump_agent(stream: Any, out: Outbox) -> threading.Thread:
    """A thread that forwards torchrun's own stdout/stderr as ``a`` frames."""

    def pump() -> None:
        for line in iter(stream.readline, b""):
            out.later(encode_text(Kind.AGENT, None, line.rstrip(b"\r\n")))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread

"""What a guard checks on its node before a job starts (``precheck``: its ``ready`` facts), and
the leases it takes for the job meanwhile (the job itself, the master's port, its GPUs).

Standard library only; a part of the guard (shipped by ``remote.bootstrap``). A refusal is a
``GuardError`` (``guard.refusal``).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Collection
from typing import Any

from ptcluster.node.facts.health import health, unfit
from ptcluster.node.facts.health_facts import boot
from ptcluster.node.facts.netif import AUTO_PORTS, address_on, route_interface
from ptcluster.node.facts.rdma import rdma_env, read_rdma
from ptcluster.node.guard import refusal as R
from ptcluster.node.guard.gpus import claim
from ptcluster.node.guard.proctree import listdir, set_subreaper
from ptcluster.node.guard.refusal import (
    GuardError,
    refuse,
    unleasable,
    untrusted_lease_dir,
)
from ptcluster.node.rank_wire import AGENT_FILE, BACKEND_VAR, SHIM_FILE
from ptcluster.node.sharing.leases import NO_LEASES, Lease, Leasing, describe
from ptcluster.node.sharing.records import valid_job_id
from ptcluster.node.venv_store import env_state, mark_used, site_packages
from ptcluster.node.wire import GuardConfig, LeaseOwner, ReadyFacts, Target


def precheck(cfg: GuardConfig, handed: Collection[str], held: list[Lease]) -> ReadyFacts:
    """This node's ``ready`` facts, once everything the job needs is here and leased (into
    ``held``, as each is taken); ``GuardError`` names what is not. ``cfg["workdir"]`` becomes
    the node's own path (``~`` expanded)."""
    if not {SHIM_FILE, AGENT_FILE} <= set(handed):  # run from its file, not as shipped
        raise refuse(R.NO_RANK_PROGRAMS)
    facts: ReadyFacts = {"hostname": socket.gethostname(), "pid": os.getpid(),
                         "python": sys.executable, "time": time.time()}
    node_boot = boot()  # (after a loss, the head tells a reboot by it)
    facts["boot_id"] = str(node_boot.get("boot_id") or "")
    facts["uptime"] = float(node_boot.get("uptime") or 0.0)
    try:
        set_subreaper()
        facts["subreaper"] = True
    except OSError as exc:
        facts["subreaper"] = False
        facts["subreaper_error"] = str(exc)
    workdir = os.path.expanduser(cfg["workdir"])
    if not os.path.isdir(workdir):
        raise refuse(R.WORKDIR_MISSING, workdir=workdir)
    cfg["workdir"] = facts["workdir"] = workdir
    site = project_environment(cfg)
    check_target(cfg.get("target") or {}, workdir, site)
    health_gate(cfg, workdir)
    owner: LeaseOwner = {"job_id": cfg.get("job_id"), "head": cfg.get("head"),
                         "command": cfg.get("command"), "ranks": cfg.get("ranks")}
    leasing = job_leasing(cfg)
    if leasing.off:
        facts["leases_off"] = leasing.off
    held.append(lease_job(owner, leasing))  # what `ptcluster ps` and `kill` find
    port = cfg.get("check_port")
    if port:  # the master: the port is this job's until the guard ends
        facts["master_port"], lease = lease_master_port(port, owner, leasing)
        held.append(lease)
    chosen, leased = claim(cfg.get("gpus"), int(cfg.get("slots") or 1), owner,
                           {**os.environ, **cfg["env"]}, leasing)
    held.extend(leased)
    if chosen:
        facts["gpus"] = chosen
    _interface(cfg, facts)
    facts["rdma"] = rdma_env(read_rdma())
    facts.update(versions())
    return facts


def project_environment(cfg: GuardConfig) -> str:
    """The project's environment the head expects the ranks to run in (``environment``:
    ``{digest, root}``; the head launched without asking the node first), checked complete and
    unchanged (``venv_store.env_state``, the ``venvs`` agent's own check) before anything is
    leased: its site-packages, "" without one. Missing or changed: refused with
    ``environment`` set, a reply the head answers by shipping and building it, then launching
    again; never a rank started in it."""
    env = cfg.get("environment")
    if not env:
        return ""
    root, digest = os.path.expanduser(str(env["root"])), str(env["digest"])
    env_dir = os.path.join(root, "envs", digest)
    state, why = env_state(env_dir, f"{sys.version_info[0]}.{sys.version_info[1]}")
    have, want = versions().get("torch", ""), str(env.get("torch") or "")
    if state == "ok" and want and have != want:  # (setup changed torch since the head looked)
        state, why = "changed", (f"the head checked the requirements against torch {want}; this "
                                 f"node now has torch {have or 'none'}")
    if state != "ok":
        raise refuse(R.ENVIRONMENT_NOT_READY, environment=state, digest=digest[:12],
                     state=state, why=f" ({why})" if why else "")
    try:
        mark_used(root, digest)  # its last use, for `ptcluster venvs --prune`
    except OSError:
        pass
    return site_packages(env_dir)


def health_gate(cfg: GuardConfig, workdir: str) -> None:
    """Refuse a node unfit for the job's ranks (``node.facts.health``: too few GPUs, a nearly full
    workdir disk, too little memory), before anything is leased or started."""
    env = {**os.environ, **cfg["env"]}
    refusal = unfit(health({"workdir": workdir, "slots": cfg.get("slots"),
                            "checkpoints": list(cfg.get("checkpoints") or []),
                            "backend": env.get(BACKEND_VAR),
                            "chosen": isinstance(cfg.get("gpus"), list)
                            or "CUDA_VISIBLE_DEVICES" in env}))
    if refusal is not None:
        raise GuardError(refusal["what"], refusal["fix"], unhealthy=True, code=refusal["code"],
                         fields=refusal["fields"])


def job_leasing(cfg: GuardConfig) -> Leasing:
    """The job's leasing on this node: in the lease directory (``/run/lock``), which must be
    root's sticky 1777 one (made here when missing and we are root); without leases only when
    the user opted out (``run --no-leases``, said in the ready facts). Else refused, never
    silently unleased."""
    if cfg.get("leases") is False:
        return Leasing(off=NO_LEASES)
    try:
        return Leasing()
    except OSError as exc:
        raise untrusted_lease_dir(exc) from None


NCCL_WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
"""The packages NCCL comes in with torch's CUDA wheels."""


def versions() -> ReadyFacts:
    """``{torch, nccl}``: the versions installed in this python (the ranks' own), from the
    packages' metadata, nothing imported; the head compares them across the nodes."""
    found: ReadyFacts = {}
    torch, nccl = _installed(("torch",)), _installed(NCCL_WHEELS)
    if torch:
        found["torch"] = torch
    if nccl:
        found["nccl"] = nccl
    return found


def _installed(names: tuple[str, ...]) -> str:
    """The version of the first of ``names`` installed; "" when none is."""
    from importlib import metadata  # (~40 ms: only here)

    for name in names:
        try:
            return metadata.version(name)
        except (metadata.PackageNotFoundError, ValueError, OSError):
            continue
    return ""


def _interface(cfg: GuardConfig, facts: ReadyFacts) -> None:
    """The interface the ranks' sockets use (the cluster file's, or the route to the master)
    and this node's address on it: where peers reach it (a new master, after a loss)."""
    if cfg.get("interface"):
        facts["interface"] = cfg["interface"]
        facts["interface_source"] = "cluster file"
    elif cfg.get("detect_interface_for"):
        dev, why = route_interface(str(cfg["detect_interface_for"]))
        facts["interface"] = dev
        facts["interface_source"] = ("route to the master" if dev else
                                     f"not detected ({why})")
    if facts.get("interface"):
        facts["address"] = address_on(str(facts["interface"]))


def node_python(argv: list[str]) -> list[str]:
    """torchrun's argv with the interpreter resolved here: ``auto`` (the cluster file's default
    ``python:``) is the interpreter this guard runs on, and ``~/`` is this node's home."""
    out = list(argv)
    for i, word in enumerate(out):
        if i == 0 or out[i - 1] == "--no-python":
            out[i] = sys.executable if word == "auto" else os.path.expanduser(word)
    return out


def check_target(target: Target, workdir: str, site: str = "") -> None:
    """Refuse before launch a script or module that is not there (what `python` would find;
    ``site``: the project environment's site-packages, which the ranks' interpreter sees and
    this guard's, its base, does not)."""
    script = target.get("script")
    if script:
        path = os.path.join(workdir, os.path.expanduser(script))
        if not os.path.isfile(path):
            raise refuse(R.SCRIPT_MISSING, script=script, workdir=workdir)
    module = target.get("module")
    if module and not module_present(module, workdir, site):
        raise refuse(R.MODULE_MISSING, module=module, python=sys.executable, workdir=workdir)


def _find_spec(top: str) -> Any:
    """``importlib.util.find_spec(top)`` as the ranks' fresh interpreter sees it: never what
    this process imported, nor the hook this program came with (``node.importer``: its
    ``ptcluster`` is not the ranks'), only the finders a plain interpreter has."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None or getattr(finder, "SHIPPED", False):
            continue
        spec = find(top, None)
        if spec is not None:
            return spec
    return None


def module_present(name: str, workdir: str, site: str = "") -> bool:
    """Whether ``python -m name`` run in ``workdir`` would find it, without importing it.

    The top-level package is looked up like the interpreter would (installed, editable or in
    the workdir); submodules are looked for in its directories. Only a definite miss is False.
    """
    top, *rest = name.split(".")
    added = [workdir, *([site] if site else [])]
    sys.path[0:0] = added
    try:
        spec = _find_spec(top)
    except (ImportError, ValueError):
        spec = None
    finally:
        for path in added:
            sys.path.remove(path)
    if spec is None:
        return False
    dirs = list(spec.submodule_search_locations or [])
    for i, part in enumerate(rest):
        if not dirs:
            return spec.loader is not None and not rest  # a module has no submodules
        last = i == len(rest) - 1
        found = []
        for d in dirs:
            if os.path.isdir(os.path.join(d, part)):
                found.append(os.path.join(d, part))
            elif last and any(os.path.isfile(os.path.join(d, part + ext))
                              for ext in (".py", ".pyc")):
                return True
            elif last and any(f.startswith(part + ".") and f.endswith(".so")
                              for f in listdir(d)):
                return True
        if not found:
            return False
        dirs = found
    return True


def check_port_free(port: int) -> None:
    why = port_in_use(port)
    if why:
        raise refuse(R.PORT_IN_USE, port=port, why=why)


def port_in_use(port: int) -> str | None:
    """Why ``port`` cannot be the store's port now; None when it is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Like torch's TCPStore: connections of a previous job in TIME_WAIT are fine, only a
        # socket still bound or listening on the port is a conflict.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def lease_job(owner: LeaseOwner, leasing: Leasing) -> Lease:
    """The job's own lease on this node (``job-ID``): its record is what ``ptcluster ps`` lists
    and ``ptcluster kill`` signals (the guard's pid), on every node of the job."""
    if not valid_job_id(owner.get("job_id")):  # (it names files in the shared lease dir)
        raise refuse(R.NOT_A_JOB_ID, job_id=repr(str(owner.get("job_id"))[:80]))
    try:
        lease = leasing.take(f"job-{owner['job_id']}", owner)
    except OSError as exc:
        raise unleasable("", exc) from None
    if lease is None:
        held = leasing.holder(f"job-{owner['job_id']}") or {}
        if held.get("uid") == os.getuid():
            raise refuse(R.JOB_RUNS, job_id=owner["job_id"])
        # (job ids are public: another user may hold this one's lease; L1)
        raise refuse(R.JOB_LEASE_HELD, busy=True, job_id=owner["job_id"], holder=describe(held))
    return lease


def lease_master_port(port: int | str, owner: LeaseOwner,
                      leasing: Leasing | None = None) -> tuple[int, Lease]:
    """The rendezvous port this job's master uses, leased for the job's life.

    ``auto``: the first port of :data:`AUTO_PORTS` that no other ptcluster job holds and nothing
    else has bound. A fixed port: refused when another ptcluster job holds it (naming that job)
    or anything else has bound it.
    """
    leasing = leasing or Leasing()
    try:
        if port == "auto":
            for p in AUTO_PORTS:
                lease = leasing.take(f"port-{p}", owner)
                if lease is None:
                    continue
                if port_in_use(p) is None:
                    return p, lease
                lease.release()
            raise refuse(R.NO_FREE_PORT, low=AUTO_PORTS.start, high=AUTO_PORTS.stop - 1)
        lease = leasing.take(f"port-{int(port)}", owner)
    except OSError as exc:
        raise unleasable("the rendezvous port ", exc) from None
    if lease is None:
        raise refuse(R.PORT_LEASED, busy=True, port=port,
                     holder=describe(leasing.holder(f"port-{int(port)}") or {}))
    try:
        check_port_free(int(port))
    except GuardError:
        lease.release()
        raise
    return int(port), lease


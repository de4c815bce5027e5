"""What setup does on each node: a pure function of the facts of every node.

Per node, in order, each step is ``ok`` (its fact proves it done), ``change`` (with the exact
commands apply runs) or ``blocked`` (why, and the commands an admin can run instead). Each step
is one function, declared once in ``STEP_DEFS`` with the fact sections it needs. Apply re-plans
a step (that function alone) from fresh facts right before acting, so a step is only ever run
when its own fact still says it is needed.
"""

from __future__ import annotations

import shlex

from ptcluster.cluster.model import SETUP_PYTHON, SETUP_VENV
from ptcluster.cluster.validate import is_dns_name
from ptcluster.errors import Problem
from ptcluster.node.facts.setup_facts import SetupFacts
from ptcluster.remote.diagnoses import HOSTNAME_REFUSED
from ptcluster.setup import problems as R
from ptcluster.setup.slurm_steps import SLURM_DEFS
from ptcluster.setup.steps import (
    BLOCKED,
    OK,
    WHEELHOUSE,
    ClusterFacts,
    Step,
    StepAction,
    StepDef,
)
from ptcluster.setup.wheels import extras_said, self_requirement, venv_lacks

PACKAGES = ("python3-venv", "python3-dev", "build-essential", "rsync")
VENV, VENV_PYTHON = SETUP_VENV, SETUP_PYTHON
ENV_FILE = "~/.ptcluster/env"
HOSTS_BEGIN = "# BEGIN ptcluster: cluster nodes (managed by `ptcluster setup`, edits are replaced)"
HOSTS_END = "# END ptcluster"
NO_TORCH = Problem(None, "no torch build fits")
"""The torch steps' block when the choice says no more (it always does: ``TorchChoice``)."""


def hostname_problem(facts: SetupFacts) -> Problem | None:
    """Why setup refuses a node whose reported hostname is not a DNS name (a node's word goes
    into every node's ``/etc/hosts``, as root: a newline in it would add lines there)."""
    name = facts.get("hostname")
    if is_dns_name(name):
        return None
    return Problem.of(HOSTNAME_REFUSED, None, hostname=str(name)[:80])


def cluster_hostnames(facts: dict[str, SetupFacts]) -> dict[str, str]:
    """host -> the hostname the node reported, for the nodes whose name is a DNS name."""
    return {h: f["hostname"] for h, f in facts.items() if hostname_problem(f) is None}


def plan_node(host: str, facts: SetupFacts, cf: ClusterFacts) -> list[Step]:
    """Every step for one node, in ``step_defs`` order, from its facts (``node/setup_agent.py``
    reads them) and the cluster's."""
    return [d.plan(host, facts, cf) for d in step_defs(cf)]


def step_defs(cf: ClusterFacts | None) -> tuple[StepDef, ...]:
    """``STEP_DEFS``, and ``setup.slurm_steps``' after them when the cluster gets Slurm."""
    if cf is None or cf.slurm is None:
        return STEP_DEFS
    return STEP_DEFS + SLURM_DEFS


def _root_ok(facts: SetupFacts) -> bool:
    return bool(facts["sudo"]["mode"] in ("root", "nopasswd", "password"))


SUDO_WHY = {"root": "logged in as root", "nopasswd": "sudo without a password",
            "password": "sudo with the password (checked)",
            "needs-password": "sudo needs a password and none was given",
            "wrong-password": "sudo refused the password"}


def _sudo_why(facts: SetupFacts) -> str:
    return SUDO_WHY.get(facts["sudo"]["mode"], facts["sudo"].get("why") or "no sudo")


def _no_sudo(facts: SetupFacts) -> Step:
    mode = facts["sudo"]["mode"]
    if mode == "needs-password":
        return R.SUDO_NEEDS_PASSWORD.step("sudo")
    if mode == "wrong-password":
        return R.SUDO_REFUSED_PASSWORD.step("sudo")
    return R.NO_SUDO.step("sudo", why=_sudo_why(facts))


def _debian(facts: SetupFacts) -> bool:
    os_ = facts["os"]
    family = {os_.get("ID", "")} | set(os_.get("ID_LIKE", "").split())
    return bool(family & {"debian", "ubuntu"})


def _missing_packages(facts: SetupFacts) -> list[str]:
    return [p for p, ok in facts["packages"].items() if not ok]


def _ssh_key(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    if facts.get("key_authorized"):
        return Step("ssh key", OK, "the head's key is authorized")
    return R.KEY_NOT_AUTHORIZED.step("ssh key", (
        StepAction(("sh", "-c", "umask 077 && mkdir -p ~/.ssh && cat >> ~/.ssh/authorized_keys"),
                   input=cf.pubkey.strip() + "\n"),))


def _sudo(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    return Step("sudo", OK, _sudo_why(facts)) if _root_ok(facts) else _no_sudo(facts)


def _os(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    os_ = facts["os"]
    if _debian(facts):
        return Step("os", OK, os_.get("PRETTY_NAME") or os_.get("ID") or "")
    return R.NOT_APT.step("os", os=os_.get("PRETTY_NAME") or "unknown OS")


def _gpu_driver(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    gpu = facts["gpu"]
    if gpu["count"] and not gpu["driver"]:
        return R.NO_DRIVER.step("gpu driver", count=gpu["count"])
    return Step("gpu driver", OK, f"driver {gpu['driver']}, {gpu['count']} GPU(s)"
                if gpu["count"] else "no NVIDIA GPU")


def _apt_packages(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    missing = _missing_packages(facts)
    if not missing:
        return Step("apt packages", OK, "installed: " + ", ".join(facts["packages"]))
    apt = StepAction(("sh", "-c", "dpkg --configure -a && apt-get update -q && apt-get install "
                      "-y -q -o DPkg::Lock::Timeout=300 " + shlex.join(missing)),
                     root=True, env=(("DEBIAN_FRONTEND", "noninteractive"),), timeout=1800)
    debian = _debian(facts)
    return _root_step("apt packages", _root_ok(facts) and debian, R.PACKAGES_MISSING.step(
        "apt packages", (apt,), missing=", ".join(missing)), _sudo_why(facts) if debian
        else "not apt")


def _python_venv(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    venv, node_py = facts["venv"], facts["python"]
    if node_py != cf.python:
        return R.PYTHON_DIFFERS.step("python venv", node=node_py, head=cf.python)
    if venv.get("exists") and venv.get("ok"):
        return Step("python venv", OK, f"{VENV} (Python {venv.get('python')})")
    make = StepAction(("sh", "-c", f"rm -rf {VENV} && python3 -m venv {VENV}"))
    if _missing_packages(facts) and not (_root_ok(facts) and _debian(facts)):
        return R.VENV_NEEDS_PACKAGES.step("python venv", (make,))
    return R.NO_VENV.step("python venv", (make,), venv=VENV)


def _wanted(cf: ClusterFacts) -> dict[str, str]:
    """dist -> the version the venv gets."""
    return {"torch": cf.torch.local_version, "ptcluster": cf.self_version}



def _install_case(host: str, facts: SetupFacts, cf: ClusterFacts) -> str:
    """What ``wheels`` and ``torch + ptcluster`` share: ``no torch`` (no build fits),
    ``installed`` (the venv has what they would bring), ``no venv`` (it cannot be made) or
    ``install``."""
    if cf.torch.variant is None:
        return "no torch"
    venv = _python_venv(host, facts, cf)
    dists = facts["venv"].get("dists") or {}
    if venv.status == OK and not venv_lacks(dists, _wanted(cf)):
        return "installed"
    return "no venv" if venv.status == BLOCKED else "install"


def _wheels(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    case = _install_case(host, facts, cf)
    if case == "no torch":
        return R.NO_TORCH_BUILD.step("wheels", why=(cf.torch.problem or NO_TORCH).what)
    if case == "installed":
        return Step("wheels", OK, "nothing to copy: the venv has what it needs")
    if case == "no venv":
        return R.WHEELS_NO_VENV.step("wheels")
    if cf.manifest is None:
        return R.WHEELS_TO_DOWNLOAD.step("wheels", (StepAction(
            (cf.torch.requirement, "ptcluster + deps"), kind="copy"),))
    node_wheels: dict[str, str] = facts.get("wheelhouse") or {}
    lacking = tuple(n for n, h in cf.manifest.items() if node_wheels.get(n) != h)
    if not lacking:
        return Step("wheels", OK, f"{len(cf.manifest)} wheels already on the node")
    return R.WHEELS_LACKING.step("wheels", (StepAction(lacking, kind="copy"),),
                                 lacking=len(lacking), total=len(cf.manifest))


def _torch(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    case, want = _install_case(host, facts, cf), _wanted(cf)
    dists = facts["venv"].get("dists") or {}
    if case == "no torch":
        return R.NO_TORCH_BUILD.step("torch + ptcluster", why=str(cf.torch.problem or NO_TORCH))
    if case == "installed":
        return Step("torch + ptcluster", OK, f"torch {want['torch']}, ptcluster "
                    f"{want['ptcluster']}{extras_said(dists)} ({cf.torch.why})")
    if case == "no venv":
        return R.TORCH_NO_VENV.step("torch + ptcluster")
    pip = StepAction((VENV_PYTHON, "-m", "pip", "install", "--disable-pip-version-check",
                      "--no-index", "--find-links", WHEELHOUSE, cf.torch.requirement,
                      self_requirement(cf.self_version)), timeout=3600)
    return R.TORCH_INSTALL.step("torch + ptcluster", (pip,), lacks=", ".join(venv_lacks(
        dists, want)), torch=want["torch"], why=cf.torch.why, ptcluster=want["ptcluster"])


def _env_file(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    text = env_file_text(host, facts, cf)
    if facts.get("env_file") == text:
        return Step("env file", OK, ENV_FILE)
    return R.ENV_FILE.step("env file", (
        StepAction(("sh", "-c", f"mkdir -p ~/.ptcluster && cat > {ENV_FILE}.tmp && "
                    f"mv {ENV_FILE}.tmp {ENV_FILE}"), input=text),), path=ENV_FILE,
        state="differs" if facts.get("env_file") is not None else "missing")


def _workdir(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    workdir = facts.get("workdir")
    if not workdir or workdir.get("exists", True):
        return Step("workdir", OK, workdir.get("path", "") if workdir else "")
    return R.WORKDIR_MISSING.step("workdir", (
        StepAction(("mkdir", "-p", "--", workdir["path"])),), path=workdir["path"])


def _root_step(name: str, can: bool, change: Step, why_not: str) -> Step:
    """``change`` where setup has root; else blocked, its commands for an admin."""
    if can:
        return change
    return R.NEEDS_ROOT.step(name, change.actions, why=change.why, why_not=why_not)


def _firewall(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    fw = facts["firewall"]
    if not fw["kind"] or not fw["active"]:
        return Step("firewall", OK, "no active firewall" + (f" ({fw['kind']} inactive)"
                                                            if fw["kind"] else ""))
    peers = [a for h, a in cf.addrs.items() if h != host]
    if fw["kind"] == "ufw":
        want = {a: f"ufw allow from {a} proto tcp" for a in peers}
        have = set(fw["rules"] or [])
        lacking = [a for a in peers if want[a] not in have]
        actions = tuple(StepAction(("ufw", "allow", "from", a, "proto", "tcp"), root=True)
                        for a in lacking)
    else:
        have = set(fw["rules"] or [])
        lacking = [a for a in peers if a not in have]
        actions = tuple(StepAction(("firewall-cmd", "--permanent", "--zone=trusted",
                                    f"--add-source={a}"), root=True) for a in lacking)
        if actions:
            actions += (StepAction(("firewall-cmd", "--reload"), root=True),)
    if fw["rules"] is None:
        return R.FIREWALL_UNREADABLE.step("firewall", tuple(
            StepAction(("ufw", "allow", "from", a, "proto", "tcp"), root=True)
            for a in peers) if fw["kind"] == "ufw" else (), kind=fw["kind"])
    if not lacking:
        return Step("firewall", OK, f"{fw['kind']}: TCP open to the other nodes only "
                    f"({', '.join(peers) or 'none'})")
    return _root_step("firewall", _root_ok(facts), R.FIREWALL_CLOSED.step(
        "firewall", actions, kind=fw["kind"], lacking=", ".join(lacking)), "no sudo")


def hosts_with_block(current: str, entries: list[tuple[str, list[str]]], own: str) -> str:
    """``current`` /etc/hosts with our marked block (replaced, or appended), and this node's own
    name taken off any 127.x line (Ubuntu's 127.0.1.1 trap, which doctor flags); nothing else
    touched."""
    lines = current.splitlines()
    out: list[str] = []
    inside = False
    for line in lines:
        if line.strip() == HOSTS_BEGIN:
            inside = True
            continue
        if inside:
            if line.strip() == HOSTS_END:
                inside = False
            continue
        words = line.split("#", 1)[0].split()
        if len(words) >= 2 and words[0].startswith("127.") and own in words[1:] \
                and own != "localhost":
            names = [w for w in words[1:] if w != own]
            if not names:
                continue
            line = " ".join([words[0], *names])
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    block = [HOSTS_BEGIN, *(f"{addr} {' '.join(names)}" for addr, names in entries), HOSTS_END]
    return "\n".join([*out, "", *block]) + "\n"


def _hosts(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    entries = []
    for h, addr in cf.addrs.items():
        # (a name a node reported is checked at its facts, ``hostname_problem``; again here)
        names = [n for n in [cf.hostnames.get(h), h] if n and n != addr and is_dns_name(n)]
        names = list(dict.fromkeys(names))
        if names:
            entries.append((addr, names))
    current = facts.get("hosts") or ""
    want = hosts_with_block(current, entries, facts["hostname"])
    if want == current:
        return Step("/etc/hosts", OK, "every node's name maps to its cluster address")
    state = "differs" if HOSTS_BEGIN in current else "is missing"
    trap = any(line.split()[:1] and line.split()[0].startswith("127.") and facts["hostname"] in
               line.split()[1:] for line in current.splitlines())
    # Written in place, not renamed over (/etc/hosts is often a bind mount: containers), but
    # only once the whole new text is on disk beside it: an interrupted step never leaves it
    # empty or half written.
    script = ("cat > /etc/hosts.ptcluster-new && cat /etc/hosts.ptcluster-new > /etc/hosts "
              "&& rm -f /etc/hosts.ptcluster-new")
    write = (StepAction(("sh", "-c", script), root=True, input=want),)
    change = (R.HOSTS_TRAP.step("/etc/hosts", write, state=state, hostname=facts["hostname"])
              if trap else R.HOSTS_BLOCK.step("/etc/hosts", write, state=state))
    return _root_step("/etc/hosts", _root_ok(facts), change, "no sudo")


def env_file_text(host: str, facts: SetupFacts, cf: ClusterFacts) -> str:
    iface = cf.interfaces.get(host) or facts.get("interface")
    pairs = [("MASTER_ADDR", cf.master_addr), ("MASTER_PORT", str(cf.master_port))]
    if iface:
        pairs += [("NCCL_SOCKET_IFNAME", iface), ("GLOO_SOCKET_IFNAME", iface)]
    lines = ["# Written by `ptcluster setup`: the cluster's variables, for jobs started by hand",
             "# (`. ~/.ptcluster/env`). `ptcluster run` sets them itself."]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in pairs]
    lines.append(f"export PATH={shlex.quote(VENV.replace('~', facts['home'], 1) + '/bin')}:$PATH")
    return "\n".join(lines) + "\n"


STEP_DEFS: tuple[StepDef, ...] = (
    StepDef("ssh key", ("key",), _ssh_key),
    StepDef("sudo", (), _sudo),
    StepDef("os", (), _os),
    StepDef("gpu driver", (), _gpu_driver),
    StepDef("apt packages", ("apt",), _apt_packages),
    StepDef("python venv", ("venv", "apt"), _python_venv),
    StepDef("wheels", ("wheels", "venv"), _wheels, wheelhouse=True),
    StepDef("torch + ptcluster", ("venv",), _torch),
    StepDef("firewall", ("firewall",), _firewall),
    StepDef("/etc/hosts", ("hosts",), _hosts),
    StepDef("env file", ("env",), _env_file),
    StepDef("workdir", ("workdir",), _workdir),
)
"""Every step, in the order the plan lists them and apply runs them (the connection comes before
all of them)."""
STEPS = tuple(d.name for d in STEP_DEFS)


def pending(steps: list[Step]) -> bool:
    return any(s.status != OK for s in steps)

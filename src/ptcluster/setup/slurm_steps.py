"""``ptcluster setup --slurm``'s steps, each a pure function of a node's facts and the cluster's
(``setup.slurm``: the files they write, the one munge key).

Per node, after setup's own steps: the packages (munge, slurmd, slurm-client; slurmctld on the
controller) from the node's own apt, the cluster's **one** munge key, munge running; then, once
every node's phase 1 is done, the cluster-wide files and slurmctld (on the controller) and
slurmd running with them: a daemon older than its files is restarted.
"""

from __future__ import annotations

import shlex

from ptcluster.node.facts.setup_facts import SetupFacts
from ptcluster.setup import problems as R
from ptcluster.setup.slurm import FILES, SlurmCluster
from ptcluster.setup.steps import (
    OK,
    ClusterFacts,
    PlanFn,
    Step,
    StepAction,
    StepDef,
)


def _wanted(host: str, sc: SlurmCluster) -> list[str]:
    return ["munge", "slurmd", "slurm-client"] + (["slurmctld"] if host == sc.controller else [])


def _packages(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    sc, have = cf.slurm, facts["slurm"]["packages"]
    assert sc is not None
    missing = [p for p in _wanted(host, sc) if not have.get(p)]
    if not missing:
        return Step("slurm packages", OK, "installed: " + ", ".join(_wanted(host, sc)))
    apt = StepAction(("sh", "-c", "apt-get update -q && apt-get install -y -q "
                      "--no-install-recommends -o DPkg::Lock::Timeout=300 " +
                      shlex.join(missing)), root=True,
                     env=(("DEBIAN_FRONTEND", "noninteractive"),), timeout=1800)
    return R.SLURM_PACKAGES.step("slurm packages", (apt,), missing=", ".join(missing))


KEY_PROGRAM = """
import base64, os, pwd, sys
folder, owner = sys.argv[1], sys.argv[2]
key = base64.b64decode(sys.stdin.read(), validate=False)
d = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
tmp = ".munge.key.ptcluster-" + os.urandom(8).hex()
fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400, dir_fd=d)
try:
    view = memoryview(key)
    while view:
        view = view[os.write(fd, view):]
    user = pwd.getpwnam(owner)
    os.fchown(fd, user.pw_uid, user.pw_gid)
    os.fchmod(fd, 0o400)
    os.fsync(fd)
finally:
    os.close(fd)
os.rename(tmp, "munge.key", src_dir_fd=d, dst_dir_fd=d)
"""
"""Root writes the key (base64 on stdin) into munge's own directory through descriptors
(L6): a new file of a random name (``O_EXCL | O_NOFOLLOW``), owner and mode set on its
descriptor, renamed over the old key in that directory. No path in ``/etc/munge`` (which the
munge account may change) is ever followed, so a link planted there gets no root write and
no ``chown``. ``python3 -I``: nothing from the working directory or the environment."""
KEY_ARGV = ("python3", "-I", "-c", KEY_PROGRAM, "/etc/munge", "munge")


def _munge_key(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    sc, key = cf.slurm, facts["slurm"]["munge_key"]
    assert sc is not None
    if key is None:
        return R.MUNGE_KEY_UNREADABLE.step("munge key")
    if key.get("exists") and key.get("sha256") == sc.munge_sha and key.get("owner") == "munge" \
            and key.get("mode") == "400":
        return Step("munge key", OK, "the cluster's key, munge's own, mode 0400")
    state = ("no key" if not key.get("exists") else "another key" if key.get("sha256") !=
             sc.munge_sha else f"owner {key.get('owner')}, mode {key.get('mode')}")
    source = "the head's" if sc.munge_sha else "a new one, made once on the head"
    return R.MUNGE_KEY.step("munge key", (
        StepAction(KEY_ARGV, root=True, input=(sc.munge_b64 or "") + "\n"),
        StepAction(("systemctl", "restart", "munge"), root=True)), state=state, source=source)


def _service(name: str, host: str, facts: SetupFacts, files: tuple[str, ...]) -> Step:
    """``name`` enabled and running, started after every one of ``files`` last changed."""
    svc = facts["slurm"]["services"][name]
    mtimes = [facts["slurm"]["mtimes"].get(f) for f in files]
    newest = max((m for m in mtimes if m is not None), default=None)
    stale = svc["active"] and newest is not None and (svc["since"] or 0) < newest
    if svc["enabled"] and svc["active"] and not stale:
        return Step(name, OK, "enabled, running")
    reason = (R.SERVICE_DISABLED if not svc["enabled"] else R.SERVICE_STOPPED
              if not svc["active"] else R.SERVICE_STALE)
    return reason.step(name, (StepAction(("sh", "-c", f"systemctl enable {name} && "
                                          f"systemctl restart {name}"), root=True),))


def _munge(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    return _service("munge", host, facts, ())


def _files(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    sc = cf.slurm
    assert sc is not None
    have = facts["slurm"]["files"]
    actions, why = [], []
    for name, path in FILES.items():
        want = sc.files.get(name)
        if want is None or have.get(name) == want:
            continue
        why.append(f"{name} " + ("differs" if have.get(name) is not None else "missing"))
        actions.append(StepAction(("sh", "-c", f"mkdir -p /etc/slurm && cat > {path}.ptc-new "
                                   f"&& chmod 644 {path}.ptc-new && mv -f {path}.ptc-new "
                                   f"{path}"), root=True, input=want, show_input=True))
    if not actions:
        return Step("slurm.conf", OK, f"{', '.join(sc.files)} as the cluster's; {sc.why}")
    return R.SLURM_FILES.step("slurm.conf", tuple(actions), files="; ".join(why),
                              plugins=sc.why)


def _slurmctld(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    assert cf.slurm is not None
    if host != cf.slurm.controller:
        return Step("slurmctld", OK, f"not here: {cf.slurm.controller} is the controller")
    return _service("slurmctld", host, facts, tuple(FILES))


def _slurmd(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
    return _service("slurmd", host, facts, tuple(FILES))


def _needs_files(name: str, plan: PlanFn) -> PlanFn:
    """Step ``name``, blocked until every node's Slurm facts are in (``cf.slurm``)."""
    def step(host: str, facts: SetupFacts, cf: ClusterFacts) -> Step:
        if cf.slurm is None or not cf.slurm.files or "slurm" not in facts:
            if cf.slurm is not None and not cf.slurm.files and cf.slurm.why:  # (with files,
                return R.SLURM_FILES_REFUSED.step(name, why=cf.slurm.why)  # why: the plugins)
            return R.SLURM_FILES_WAIT.step(name)
        return plan(host, facts, cf)
    return step


SLURM_DEFS: tuple[StepDef, ...] = (
    StepDef("slurm packages", ("slurm",), _packages),
    StepDef("munge key", ("slurm",), _munge_key),
    StepDef("munge", ("slurm",), _munge),
    StepDef("slurm.conf", ("slurm",), _needs_files("slurm.conf", _files), phase=2),
    StepDef("slurmctld", ("slurm",), _needs_files("slurmctld", _slurmctld), phase=2),
    StepDef("slurmd", ("slurm",), _needs_files("slurmd", _slurmd), phase=2),
)
"""After setup's own steps, in this order; phase 2 once every node's phase 1 is done (the files
need every node's ``slurmd -C``), the controller first (slurmctld up before the slurmds)."""

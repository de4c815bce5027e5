"""``ptcluster setup``: facts (read-only) -> plan (pure) -> apply (each step re-checked right
before it runs) -> facts again, on every node in parallel. One node failing never stops the
others; every node ends with its own outcome.

The node side is ``node/setup_agent.py`` on the one node channel
(``remote.channel.NodeChannel``). The first contact with a node that does not know our key yet
uses the password, through ssh's ``SSH_ASKPASS`` (``setup.secret``); everything after that uses
the key.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from ptcluster.cluster.model import ClusterSpec, NodeSpec, SlurmSetupSpec, SshSpec
from ptcluster.errors import Problem
from ptcluster.node import SETUP_AGENT as SETUP
from ptcluster.node.facts.setup_facts import SetupConfig, SetupFacts
from ptcluster.node.setup_agent import StepRun
from ptcluster.node.wire import Kind
from ptcluster.remote import replies
from ptcluster.remote.channel import NodeChannel
from ptcluster.remote.sync import tar_pipe
from ptcluster.remote.transport import SshTransport, remote_command, ssh_argv
from ptcluster.setup import plan as P
from ptcluster.setup import problems as R
from ptcluster.setup import slurm_apply
from ptcluster.setup import steps as S
from ptcluster.setup.executor import Event
from ptcluster.setup.login import (
    NodeFailure,
    NodeSession,
    PasswordSsh,
    key_refusal,
    password_ssh,
    ssh_target,
    with_options,
)
from ptcluster.setup.options import SetupOptions
from ptcluster.setup.report import NodeSetupOutcome, SetupReport, SlurmProof
from ptcluster.setup.secret import Askpass, Secret
from ptcluster.setup.torch_choice import GpuNode, TorchChoice, choose_torch
from ptcluster.setup.wheels import prepare_wheelhouse, self_version

log = logging.getLogger(__name__)
NODE_PYTHON = "python3"
"""The setup program runs on the node's system Python (Debian/Ubuntu always have python3)."""


class Setup:
    """One ``ptcluster setup`` run over a cluster (``setup.executor.Executor`` is what a phase
    defined elsewhere may use of it)."""

    def __init__(self, spec: ClusterSpec, opts: SetupOptions, *,
                 password: Callable[[], Secret | None], on_event: Event | None = None,
                 only: set[str] | None = None, known_password: Secret | None = None) -> None:
        self.spec = spec
        self.only = only
        """--node: apply on these hosts only (facts still come from every node: the firewall
        rules and /etc/hosts name all of them)."""
        self.facts: dict[str, SetupFacts | None] = {n.host: None for n in spec.nodes}
        """host -> its facts as last read (None: not reached)."""
        self.opts = opts
        self._password_source = password
        self._password: Secret | None = known_password
        self._asked = known_password is not None
        self._lock = threading.Lock()
        self._askpass: Askpass | None = None
        self.on_event = on_event or (lambda host, text: None)
        self.outcomes = {n.host: NodeSetupOutcome(host=n.host) for n in spec.nodes}
        self.sessions: dict[str, NodeSession] = {}
        self._opened: list[NodeSession] = []
        """Every session started, also those given up on before they joined ``sessions`` (a
        node that stopped answering): each is closed at the end, none left running."""
        self._opened_lock = threading.Lock()  # not _lock: that one is held during the prompt
        self.ssh: dict[str, SshSpec] = {}
        self._wheels_lock = threading.Lock()
        self._wheels: tuple[Path, dict[str, str]] | None = None
        self._wheels_error: NodeFailure | None = None
        self._wheels_s: float | None = None
        self.slurm = spec.slurm or (SlurmSetupSpec(controller=spec.nodes[0].host)
                                    if opts.slurm else None)
        """What Slurm the nodes get (``setup.slurm``); None: none."""
        self.slurm_report: SlurmProof | None = None
        self.slurm_removed: dict[str, list[Any]] = {}
        """Nodes gone from the cluster file: ``removed`` (drained, out of slurm.conf) and
        ``draining`` (drained, still running jobs: kept in slurm.conf)."""
        self.pubkey = ""
        """The public key the nodes get (``head_key``)."""
        self.targets: dict[str, tuple[str, int]] = {}
        """host -> (address, port) as ssh reaches it (``ssh -G``)."""
        self._cluster: S.ClusterFacts | None = None

    @property
    def cluster(self) -> S.ClusterFacts:
        """What every node's plan depends on beyond its own facts (read once every node
        answered, in ``run``)."""
        assert self._cluster is not None, "the cluster's facts are made in run()"
        return self._cluster

    @cluster.setter
    def cluster(self, value: S.ClusterFacts) -> None:
        self._cluster = value

    # -- password ------------------------------------------------------------------------------
    def password(self) -> Secret | None:
        """The password, asked at most once (the CLI prompts, or read --password-file)."""
        with self._lock:
            if not self._asked:
                self._asked = True
                self._password = self._password_source()
            return self._password

    def askpass(self) -> Askpass | None:
        secret = self.password()
        with self._lock:
            if secret is not None and self._askpass is None:
                self._askpass = Askpass(secret)
            return self._askpass

    # -- head ----------------------------------------------------------------------------------
    def head_key(self) -> tuple[list[S.Step], str]:
        """The head's key step(s) and the public key the nodes get."""
        paths = {n.ssh.identity_file or "~/.ssh/id_ed25519" for n in self.spec.nodes}
        steps, pubkey = [], ""
        for raw in sorted(paths):
            path = Path(raw).expanduser()
            pub = Path(str(path) + ".pub")
            argv = ("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                    f"ptcluster@{socket.gethostname()}", "-f", str(path))
            if path.exists() and pub.exists():
                steps.append(S.Step("head key", S.OK, str(path)))
            elif path.exists():
                steps.append(R.HEAD_KEY_HALF.step("head key", (S.StepAction((
                    "ssh-keygen", "-y", "-f", str(path))),), path=path, pub=pub.name))
                continue
            elif self.opts.dry_run:
                steps.append(R.HEAD_KEY_MISSING.step("head key", (S.StepAction(argv),),
                                                     path=path))
                pubkey = pubkey or "ssh-ed25519 <the new key> ptcluster"
                continue
            else:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                subprocess.run(list(argv), check=True, capture_output=True, timeout=30)
                steps.append(S.Step("head key", S.OK, f"{path} (created)"))
            pubkey = pubkey or pub.read_text().strip()
        return steps, pubkey

    # -- phases --------------------------------------------------------------------------------
    def run(self) -> SetupReport:
        begun = time.monotonic()
        head, self.pubkey = self.head_key()
        with ThreadPoolExecutor(max_workers=16) as pool:  # ssh -G: local, ~20 ms each
            self.targets = dict(zip([n.host for n in self.spec.nodes],
                                    pool.map(ssh_target, self.spec.nodes), strict=True))
        for host, (addr, _) in self.targets.items():
            self.outcomes[host].addr = addr
        try:
            self.each(self._connect_and_facts, "connect_and_facts")
            facts = {h: o for h, o in self.facts.items() if o is not None}
            torch = self._choose_torch(facts)
            self.cluster = self._cluster_facts(facts, torch)
            for host, f in facts.items():
                self.outcomes[host].before = P.plan_node(host, f, self.cluster)
            if not self.opts.dry_run:
                self.each(self.apply_phase, selected=True)
                if self.slurm is not None:
                    slurm_apply.cluster_wide(self)
                self.each(self._confirm, "confirm", selected=True)
                if self.slurm is not None:
                    self.slurm_report = slurm_apply.verify(self)
        except BaseException:
            # Ctrl-C (or a bug): the nodes end what they run now; every step can be re-run
            self.close_sessions(Kind.STOP)
            raise
        finally:
            self.close_sessions(Kind.BYE)
            if self._askpass is not None:
                self._askpass.close()
        shown = {h: o for h, o in self.outcomes.items() if not self.only or h in self.only}
        return SetupReport(shown, head, torch, self.opts.dry_run, time.monotonic() - begun,
                           self._wheels_s, self.slurm_report)

    def close_sessions(self, how: str) -> None:
        deadline = time.monotonic() + 5
        with self._opened_lock:  # node threads may still be adding to it
            sessions = list(self._opened)
        for session in sessions:
            session.channel.send(how)
        for session in sessions:
            session.channel.close(deadline)

    # -- the executor (``setup.executor.Executor``) ------------------------------------------
    def each(self, work: Callable[[NodeSpec], None], label: str | None = None, *,
             selected: bool = False, hosts: set[str] | None = None) -> None:
        def guarded(node: NodeSpec) -> None:
            outcome = self.outcomes[node.host]
            if outcome.problem:
                return
            begun = time.monotonic()
            try:
                work(node)
                if label is not None:
                    outcome.seconds[label] = time.monotonic() - begun
            except NodeFailure as exc:
                outcome.problem = exc.problem
                self.on_event(node.host, f"failed: {exc.problem.what}")
            except Exception as exc:  # noqa: BLE001 - one node's bug never stops the others
                log.exception("%s: setup failed", node.host)
                outcome.problem = Problem.of(R.BUG, None, error=f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=guarded, args=(n,), name=f"setup-{n.host}",
                                    daemon=True) for n in self.spec.nodes
                   if (not selected or not self.only or n.host in self.only)
                   and (hosts is None or n.host in hosts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def reached(self, host: str) -> bool:
        return host in self.sessions

    def refresh(self, host: str, sections: list[str]) -> None:
        reply = self.sessions[host].facts(sections,
                                        self.opts.timeout * 3)  # (checked: replies)
        facts = self.facts[host]
        if facts is not None:  # those sections alone: never the hostname checked at connect
            facts.update(replies.fresh(reply, sections))

    def act(self, host: str, action: S.StepAction) -> tuple[bool, str]:
        node = next(n for n in self.spec.nodes if n.host == host)
        return self._act(node, self.sessions[host], action)

    def _connect_and_facts(self, node: NodeSpec) -> None:
        outcome = self.outcomes[node.host]
        addr, port = self.targets[node.host]
        ssh = node.ssh
        if self.opts.accept_new_host_keys:
            ssh = with_options(ssh, ("StrictHostKeyChecking", "accept-new"))
        self.ssh[node.host] = ssh
        self.on_event(node.host, "connecting")
        # the key first (BatchMode: never a prompt); the password only when the key is refused
        session = self.open_session(node, SshTransport(host=node.host, ssh=ssh))
        try:
            first = session.facts(["sudo"], self.opts.timeout * 3)
            outcome.connection = "key"
        except NodeFailure:
            if session.closed is None:
                raise
            session, first = self._password_login(node, session, addr, port)
            outcome.connection = "password"
        self.sessions[node.host] = session
        # The sudo password goes to a node only when it asks (its sudo needs one): never to a
        # node that is root or sudoes without one, over a channel whose host key ssh checked
        # (known, or accepted as new by --accept-new-host-keys: the user's word).
        if first["sudo"]["mode"] == "needs-password":
            secret = self.password()
            if secret is not None:
                session.channel.send(Kind.SUDO, {"password": secret.reveal()})
        facts = session.facts(self.sections(), self.opts.timeout * 3)
        refused = P.hostname_problem(facts)
        if refused is not None:
            raise NodeFailure.said(refused)
        self.facts[node.host] = facts
        self.on_event(node.host, f"facts ({outcome.connection})")

    def sections(self) -> list[str]:
        """Every fact section setup's plan reads (Slurm's only with ``--slurm``)."""
        return ["all", "slurm"] if self.slurm is not None else ["all"]

    def _password_login(self, node: NodeSpec, refused_key: NodeSession, addr: str,
                        port: int) -> tuple[NodeSession, SetupFacts]:
        """The key was refused (``refused_key`` closed): log in with the password, through
        ssh's askpass; the session and its first answer (its sudo facts)."""
        assert refused_key.closed is not None
        refused = key_refusal(node.host, addr, port, *refused_key.closed)
        if refused is not None:
            raise refused from None
        askpass = self.askpass()
        if askpass is None:
            raise NodeFailure.of(R.NO_PASSWORD) from None
        pw = PasswordSsh(host=node.host, ssh=password_ssh(self.ssh[node.host]))
        pw.askpass = askpass
        session = self.open_session(node, pw)
        try:
            first = session.facts(["sudo"], self.opts.timeout)
        except NodeFailure as exc:
            tail = "\n".join(session.closed[1] if session.closed else []).lower()
            if "permission denied" in tail:
                raise NodeFailure.of(R.PASSWORD_REFUSED) from None
            raise exc from None
        return session, first

    def open_session(self, node: NodeSpec, transport: SshTransport) -> NodeSession:
        channel = NodeChannel(transport, NODE_PYTHON, SETUP, self._node_config(node),
                              on_frames=lambda lines: None, on_closed=lambda code, err: None,
                              tag="setup")
        session = NodeSession(channel)
        channel.on_frames, channel.on_closed = session.on_frames, session.on_closed
        try:
            channel.start()
        except OSError as exc:
            raise NodeFailure.of(R.NO_SSH_CLIENT, error=exc) from None
        with self._opened_lock:
            self._opened.append(session)
        return session

    def _node_config(self, node: NodeSpec) -> SetupConfig:
        # the interface is the route to the master's address as the head resolves it: the
        # master's name may resolve on the nodes only once the /etc/hosts step ran
        master = self.targets[self.spec.nodes[0].host][0]
        return {"pubkey": self.pubkey, "venv": P.VENV, "wheelhouse": S.WHEELHOUSE,
                "env_file": P.ENV_FILE, "packages": list(P.PACKAGES), "master_addr": master,
                "workdir": node.workdir}

    def _choose_torch(self, facts: dict[str, SetupFacts]) -> TorchChoice:
        try:
            import importlib.metadata

            version = importlib.metadata.version("torch")
        except Exception:  # noqa: BLE001 - no torch on the head: the newest known good
            version = "2.13.0"
        gpus = [GpuNode(h, f["gpu"]["count"], f["gpu"]["driver"],
                        tuple(f["gpu"]["compute_capability"])) for h, f in facts.items()]
        return choose_torch(version, gpus, self.opts.torch_backend)

    def _cluster_facts(self, facts: dict[str, SetupFacts],
                       torch: TorchChoice) -> S.ClusterFacts:
        master_addr = self.spec.master.addr
        return S.ClusterFacts(
            pubkey=self.pubkey, torch=torch, self_version=self_version(),
            python=f"{sys.version_info[0]}.{sys.version_info[1]}",
            addrs={h: o.addr for h, o in self.outcomes.items() if o.addr},
            hostnames=P.cluster_hostnames(facts),
            master_addr=master_addr, master_port=self.spec.master.port or 29500,
            interfaces={n.host: n.interface for n in self.spec.nodes},
            slurm=None if self.slurm is None else slurm_apply.cluster_slurm(self))

    # -- apply ---------------------------------------------------------------------------------
    def apply_phase(self, node: NodeSpec, phase: int = 1) -> None:
        """Phase 1: each step whose first plan was a change, planned again from its fresh
        facts; phase 2 (``StepDef.phase``, after phase 1 on every node): each such step."""
        outcome = self.outcomes[node.host]
        session = self.sessions[node.host]
        facts = (self.facts[node.host] or SetupFacts()).copy()
        before = {s.name: s for s in outcome.before}
        for d in P.step_defs(self.cluster):
            if d.phase != phase or (phase == 1 and before[d.name].status == S.OK):
                continue
            if d.sections:  # the step's own facts, read again right now
                only = list(d.sections)
                facts.update(replies.fresh(session.facts(only,
                                                       self.opts.timeout * 3), only))
            cluster = self.cluster
            step = d.plan(node.host, facts, cluster)  # this step alone, from those facts
            if d.wheelhouse and step.status == S.CHANGE:
                step = d.plan(node.host, facts, self._with_manifest(cluster))
            if step.status == S.OK:
                outcome.applied.append((d.name, "skipped", "already done"))
                continue
            if step.status == S.BLOCKED:
                outcome.applied.append((d.name, "blocked", step.why))
                continue
            self.on_event(node.host, f"{d.name}: {step.why}")
            begun = time.monotonic()
            for action in step.actions:
                ok, detail = self._act(node, session, action)
                if not ok:
                    outcome.applied.append((d.name, "failed", detail))
                    self.on_event(node.host, f"{d.name}: FAILED {detail.splitlines()[-1:]}")
                    break
            else:
                outcome.applied.append((d.name, "changed", step.why))
                outcome.seconds[d.name] = time.monotonic() - begun
                self.on_event(node.host, f"{d.name}: done ({outcome.seconds[d.name]:.1f} s)")

    def use_wheelhouse(self, folder: Path, manifest: dict[str, str]) -> None:
        """The head's wheelhouse, prepared already (its folder and manifest: file -> sha256):
        not prepared again for the nodes' torch step."""
        with self._wheels_lock:
            self._wheels = (folder, manifest)

    def _with_manifest(self, cluster: S.ClusterFacts) -> S.ClusterFacts:
        """``cluster`` with the head's wheelhouse manifest, the wheelhouse prepared first (once,
        for every node)."""
        with self._wheels_lock:
            if self._wheels_error is not None:
                raise self._wheels_error
            if self._wheels is None:
                begun = time.monotonic()
                try:
                    folder, _, man = prepare_wheelhouse(
                        Path(self.opts.wheelhouse), cluster.torch,
                        say=lambda text: self.on_event("head", f"wheels: {text}"))
                except Exception as exc:  # noqa: BLE001
                    fix = getattr(exc, "fix", None) or "see -v"
                    self._wheels_error = NodeFailure(getattr(exc, "message", str(exc)), fix)
                    raise self._wheels_error from None
                self._wheels = (folder, man)
                self._wheels_s = round(time.monotonic() - begun, 2)
        self.cluster = replace(self.cluster, manifest=self._wheels[1])
        return replace(cluster, manifest=self._wheels[1])

    def _act(self, node: NodeSpec, session: NodeSession, action: S.StepAction) -> tuple[bool, str]:
        if action.kind == "copy":
            return self._copy(node, list(action.argv))
        argv = list(action.argv)
        if action.env:
            argv = ["env", *[f"{k}={v}" for k, v in action.env], *argv]
        step: StepRun = {"id": 1, "argv": argv, "root": action.root, "input": action.input,
                         "timeout": action.timeout}
        done = session.run(step, action.timeout + 30)
        return done["rc"] == 0, done["out"]

    def _copy(self, node: NodeSpec, names: list[str]) -> tuple[bool, str]:
        assert self._wheels is not None
        folder = self._wheels[0]
        remote = remote_command(["sh", "-c", f"mkdir -p {S.WHEELHOUSE} && tar -C "
                                 f"{S.WHEELHOUSE} -xf -"])
        ssh = ssh_argv(node.host, self.ssh[node.host]) + [remote]
        listing = "\0".join(names).encode() + b"\0"
        proc = tar_pipe(folder, listing, ssh, timeout=3600)  # the same pipe as `sync`
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip()
            return False, (err or f"tar over ssh: exit status {proc.returncode}")[-2000:]
        return True, f"{len(names)} wheels"

    def _confirm(self, node: NodeSpec) -> None:
        outcome = self.outcomes[node.host]
        if not any(r in ("changed", "failed") for _, r, _ in outcome.applied):
            outcome.after = outcome.before  # nothing was done: the first facts still hold
            return
        session = self.sessions[node.host]
        facts = session.facts(self.sections(), self.opts.timeout * 3)
        outcome.after = P.plan_node(node.host, facts, self.cluster)
        if P.pending(outcome.after) and self.cluster.manifest is not None:
            facts.update(replies.fresh(session.facts(["wheels"],
                                                   self.opts.timeout * 3), ["wheels"]))
            outcome.after = P.plan_node(node.host, facts, self.cluster)
        self.on_event(node.host, "converged" if not P.pending(outcome.after) else
                      "not converged")


def run_setup(spec: ClusterSpec, opts: SetupOptions, *, password: Callable[[], Secret | None],
              on_event: Event | None = None, only: list[str] | None = None,
              known_password: Secret | None = None) -> SetupReport:
    """Set up every node of ``spec`` (or the ``only`` hosts); never raises for one node.

    ``password`` is called at most once, when a node first needs it (the CLI prompts then);
    ``known_password`` is one at hand already (``--password-file``)."""
    report = Setup(spec, opts, password=password, on_event=on_event,
                   only=set(only) if only else None, known_password=known_password).run()
    return report

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
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ptcluster.node import SETUP_AGENT as SETUP
from ptcluster.node.wire import control, split
from ptcluster.remote.channel import NodeChannel
from ptcluster.remote.sync import tar_pipe
from ptcluster.remote.transport import SshTransport, remote_command, ssh_argv
from ptcluster.setup import plan as P
from ptcluster.setup.secret import Askpass, Secret
from ptcluster.setup.torch_choice import GpuNode, TorchChoice, choose_torch
from ptcluster.setup.wheels import DEFAULT_WHEELHOUSE, prepare_wheelhouse, self_version
from ptcluster.spec.model import ClusterSpec, NodeSpec, SshSpec

log = logging.getLogger(__name__)
NODE_PYTHON = "python3"
"""The setup program runs on the node's system Python (Debian/Ubuntu always have python3)."""


@dataclass(frozen=True, kw_only=True)
class SetupOptions:
    dry_run: bool = False
    """Facts and plan only: nothing changes on any node."""
    accept_new_host_keys: bool = False
    """Trust a node's host key the first time it is seen (ssh's accept-new); never a changed one."""
    torch_backend: str = "auto"
    """``auto`` (from the nodes' GPUs and drivers), ``cpu`` or ``cuXYZ``."""
    wheelhouse: str = DEFAULT_WHEELHOUSE
    """Where the head keeps the wheels it downloads for the nodes."""
    timeout: float = 60.0
    """Seconds for a node to answer (connect, facts); commands have their own (long) limits."""


@dataclass
class NodeSetupOutcome:
    """One node's setup: how the head got in, its plan before and after, what apply did."""

    host: str
    addr: str = ""
    connection: str = ""
    """How the head got in: ``key``, ``password``, or why it could not."""
    before: list[P.Step] = field(default_factory=list)
    """The plan from the first facts."""
    after: list[P.Step] = field(default_factory=list)
    """The plan from the facts after apply (empty in a dry run)."""
    applied: list[tuple[str, str, str]] = field(default_factory=list)
    """(step, changed | failed | skipped, detail) for every step apply looked at."""
    problem: str | None = None
    fix: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    """Where the time went: ``facts``, each applied step, ``confirm``."""

    @property
    def final(self) -> list[P.Step]:
        return self.after or self.before

    @property
    def converged(self) -> bool:
        return self.problem is None and bool(self.final) and not P.pending(self.final)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "addr": self.addr, "connection": self.connection,
                "problem": self.problem, "fix": self.fix, "converged": self.converged,
                "plan": [s.to_json(self.host) for s in self.before],
                "applied": [{"step": s, "result": r, "detail": d} for s, r, d in self.applied],
                "after": [s.to_json(self.host) for s in self.after],
                "seconds": {k: round(v, 2) for k, v in self.seconds.items()}}


@dataclass
class SetupReport:
    nodes: dict[str, NodeSetupOutcome]
    head: list[P.Step]
    torch: TorchChoice | None
    dry_run: bool
    duration: float = 0.0
    wheelhouse_s: float | None = None
    """Seconds the head spent preparing its wheelhouse (None: not needed)."""

    @property
    def converged(self) -> bool:
        return all(n.converged for n in self.nodes.values()) and not P.pending(self.head)

    def to_json(self) -> dict[str, Any]:
        t = self.torch
        return {"dry_run": self.dry_run, "converged": self.converged,
                "duration_s": round(self.duration, 2), "wheelhouse_s": self.wheelhouse_s,
                "head": [s.to_json("head") for s in self.head],
                "torch": None if t is None else {"version": t.version, "variant": t.variant,
                                                 "why": t.why, "problem": t.problem},
                "nodes": [n.to_json() for n in self.nodes.values()]}


Event = Callable[[str, str], None]


class NodeSession:
    """Request/reply over the setup program's channel."""

    def __init__(self, channel: NodeChannel) -> None:
        self.channel = channel
        self.replies: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.closed: tuple[int | None, list[str]] | None = None

    def on_frames(self, lines: list[str]) -> None:
        for line in lines:
            kind, payload = split(line)
            if kind in ("facts", "done"):
                try:
                    self.replies.put((kind, control(payload)))
                except ValueError as exc:
                    self.replies.put(("bad", str(exc)))

    def on_closed(self, code: int | None, stderr: list[str]) -> None:
        self.closed = (code, stderr)
        self.replies.put(("closed", (code, stderr)))

    def ask(self, kind: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.channel.send(kind, payload)
        try:
            got, value = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise NodeFailure(f"no answer within {timeout:.0f} s ({kind})",
                              "check the node is up and not overloaded") from None
        if got == "closed":
            code, stderr = value
            tail = [s for s in stderr if s.strip()][-1:] or [f"exit status {code}"]
            raise NodeFailure(f"the setup channel closed ({tail[0]})",
                              "check the node's python3 and ssh (-v shows more)")
        if got == "bad":
            raise NodeFailure(f"the node sent a bad frame ({value})", "report this bug")
        return dict(value)


class NodeFailure(Exception):
    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.problem, self.fix = problem, fix


class _PasswordSsh(SshTransport):
    """ssh that may use the password (askpass) when the key is refused."""

    askpass: Askpass | None = None

    def spawn(self, node_argv: list[str]) -> subprocess.Popen[bytes]:
        assert self.askpass is not None
        return subprocess.Popen(self.argv(node_argv), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, env=self.askpass.env())


def _with_options(ssh: SshSpec, *pairs: tuple[str, str]) -> SshSpec:
    given = {k.lower() for k, _ in ssh.options}
    extra = tuple(p for p in pairs if p[0].lower() not in given)
    return replace(ssh, options=extra + ssh.options)


def _password_ssh(ssh: SshSpec) -> SshSpec:
    # ours first: ssh keeps the first value it sees, and the password path must not batch
    keep = tuple((k, v) for k, v in ssh.options if k.lower() not in (
        "batchmode", "preferredauthentications", "numberofpasswordprompts"))
    return replace(ssh, options=(("BatchMode", "no"),
                                 ("PreferredAuthentications", "password,keyboard-interactive"),
                                 ("NumberOfPasswordPrompts", "1")) + keep)


def ssh_target(node: NodeSpec) -> tuple[str, int]:
    """(address, port) ssh would connect to for ``node`` (``ssh -G``: ~/.ssh/config applies)."""
    argv = ssh_argv(node.host, node.ssh)
    argv.insert(1, "-G")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    host, port = node.host, 22
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname":
            host = value.strip()
        elif key == "port":
            port = int(value)
    try:
        host = str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except OSError:
        pass
    return str(host), port


def host_fingerprint(addr: str, port: int) -> str:
    try:
        scan = subprocess.run(["ssh-keyscan", "-T", "5", "-p", str(port), addr],
                              capture_output=True, text=True, timeout=15)
        fp = subprocess.run(["ssh-keygen", "-lf", "-"], input=scan.stdout, capture_output=True,
                            text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(could not read it: {exc})"
    return "; ".join(" ".join(line.split()[1:2] + line.split()[-1:])
                     for line in fp.stdout.splitlines()) or "(no key offered)"


class Setup:
    """One ``ptcluster setup`` run over a cluster."""

    def __init__(self, spec: ClusterSpec, opts: SetupOptions, *,
                 password: Callable[[], Secret | None], on_event: Event | None = None,
                 only: set[str] | None = None, known_password: Secret | None = None) -> None:
        self.spec = spec
        self.only = only
        """--node: apply on these hosts only (facts still come from every node: the firewall
        rules and /etc/hosts name all of them)."""
        self._facts: dict[str, dict[str, Any] | None] = {n.host: None for n in spec.nodes}
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

    # -- password ------------------------------------------------------------------------------
    def password(self) -> Secret | None:
        """The password, asked at most once (the CLI prompts, or read --password-file)."""
        with self._lock:
            if not self._asked:
                self._asked = True
                self._password = self._password_source()
            return self._password

    def _known_password(self) -> Secret | None:
        """The password if it is already at hand (never asks)."""
        with self._lock:
            return self._password

    def askpass(self) -> Askpass | None:
        secret = self.password()
        with self._lock:
            if secret is not None and self._askpass is None:
                self._askpass = Askpass(secret)
            return self._askpass

    # -- head ----------------------------------------------------------------------------------
    def head_key(self) -> tuple[list[P.Step], str]:
        """The head's key step(s) and the public key the nodes get."""
        paths = {n.ssh.identity_file or "~/.ssh/id_ed25519" for n in self.spec.nodes}
        steps, pubkey = [], ""
        for raw in sorted(paths):
            path = Path(raw).expanduser()
            pub = Path(str(path) + ".pub")
            argv = ("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                    f"ptcluster@{socket.gethostname()}", "-f", str(path))
            if path.exists() and pub.exists():
                steps.append(P.Step("head key", P.OK, str(path)))
            elif path.exists():
                steps.append(P.Step("head key", P.BLOCKED, f"{path} exists without {pub.name}: "
                                    "never overwritten", (P.StepAction(("ssh-keygen", "-y", "-f",
                                                                        str(path))),)))
                continue
            elif self.opts.dry_run:
                steps.append(P.Step("head key", P.CHANGE, f"no key at {path}",
                                    (P.StepAction(argv),)))
                pubkey = pubkey or "ssh-ed25519 <the new key> ptcluster"
                continue
            else:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                subprocess.run(list(argv), check=True, capture_output=True, timeout=30)
                steps.append(P.Step("head key", P.OK, f"{path} (created)"))
            pubkey = pubkey or pub.read_text().strip()
        return steps, pubkey

    # -- phases --------------------------------------------------------------------------------
    def run(self) -> SetupReport:
        begun = time.monotonic()
        head, pubkey = self.head_key()
        self.pubkey = pubkey
        with ThreadPoolExecutor(max_workers=16) as pool:  # ssh -G: local, ~20 ms each
            self.targets = dict(zip([n.host for n in self.spec.nodes],
                                    pool.map(ssh_target, self.spec.nodes), strict=True))
        for host, (addr, _) in self.targets.items():
            self.outcomes[host].addr = addr
        try:
            self._parallel(self._connect_and_facts)
            facts = {h: o for h, o in self._facts.items() if o is not None}
            torch = self._choose_torch(facts)
            self.cluster = self._cluster_facts(facts, torch)
            for host, f in facts.items():
                self.outcomes[host].before = P.plan_node(host, f, self.cluster)
            if not self.opts.dry_run:
                self._parallel(self._apply, selected=True)
                self._parallel(self._confirm, selected=True)
        except BaseException:
            # Ctrl-C (or a bug): the nodes end what they run now; every step can be re-run
            self._close_sessions("stop")
            raise
        finally:
            self._close_sessions("bye")
            if self._askpass is not None:
                self._askpass.close()
        shown = {h: o for h, o in self.outcomes.items() if not self.only or h in self.only}
        return SetupReport(shown, head, torch, self.opts.dry_run, time.monotonic() - begun,
                           self._wheels_s)

    def _close_sessions(self, how: str) -> None:
        deadline = time.monotonic() + 5
        with self._opened_lock:  # node threads may still be adding to it
            sessions = list(self._opened)
        for session in sessions:
            session.channel.send(how)
        for session in sessions:
            session.channel.close(deadline)

    def _parallel(self, work: Callable[[NodeSpec], None], selected: bool = False) -> None:
        def guarded(node: NodeSpec) -> None:
            outcome = self.outcomes[node.host]
            if outcome.problem:
                return
            begun = time.monotonic()
            try:
                work(node)
                if work.__name__ != "_apply":
                    outcome.seconds[work.__name__.strip("_")] = time.monotonic() - begun
            except NodeFailure as exc:
                outcome.problem, outcome.fix = exc.problem, exc.fix
                self.on_event(node.host, f"failed: {exc.problem}")
            except Exception as exc:  # noqa: BLE001 - one node's bug never stops the others
                log.exception("%s: setup failed", node.host)
                outcome.problem = f"setup hit a bug here: {type(exc).__name__}: {exc}"
                outcome.fix = "report it with the output of -v"

        threads = [threading.Thread(target=guarded, args=(n,), name=f"setup-{n.host}",
                                    daemon=True) for n in self.spec.nodes
                   if not selected or not self.only or n.host in self.only]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _connect_and_facts(self, node: NodeSpec) -> None:
        outcome = self.outcomes[node.host]
        addr, port = self.targets[node.host]
        ssh = node.ssh
        if self.opts.accept_new_host_keys:
            ssh = _with_options(ssh, ("StrictHostKeyChecking", "accept-new"))
        self.ssh[node.host] = ssh
        self.on_event(node.host, "connecting")
        # the key first (BatchMode: never a prompt); the password only when the key is refused
        session = self._open(node, SshTransport(host=node.host, ssh=ssh))
        known = self._known_password()
        if known is not None:  # sudo may need it: it travels first, then one round trip
            session.channel.send("sudo", {"password": known.reveal()})
        try:
            first = session.ask("facts", {"only": ["sudo"]} if known is None else {},
                                self.opts.timeout * 3)
            outcome.connection = "key"
        except NodeFailure:
            if session.closed is None:
                raise
            code, stderr = session.closed
            err = "\n".join(stderr).strip()
            if "IDENTIFICATION HAS CHANGED" in err.upper():
                raise NodeFailure(
                    "the node's host key CHANGED since it was last seen",
                    "check with the node's admin; if expected, remove the old key "
                    f"(ssh-keygen -R {node.host}); setup never accepts a changed key") from None
            if "host key" in err.lower():
                raise NodeFailure(f"unknown host key {host_fingerprint(addr, port)}",
                                  "check the fingerprint with the node's admin, then run again "
                                  "with --accept-new-host-keys") from None
            if code != 255 or "permission denied" not in err.lower():
                last = err.splitlines()[-1] if err else f"exit status {code}"
                raise NodeFailure(f"cannot start the setup program over ssh ({last})",
                                  "check the node is up, its address, sshd (port 22 or "
                                  "ssh.port) and that it has python3") from None
            askpass = self.askpass()
            if askpass is None:
                raise NodeFailure("the node does not accept the head's key yet and no password "
                                  "was given", "run setup at a terminal (it asks once), or "
                                  "pass --password-file FILE (mode 600)") from None
            pw = _PasswordSsh(host=node.host, ssh=_password_ssh(ssh))
            pw.askpass = askpass
            session = self._open(node, pw)
            try:
                first = session.ask("facts", {"only": ["sudo"]}, self.opts.timeout)
            except NodeFailure as exc:
                tail = "\n".join(session.closed[1] if session.closed else []).lower()
                if "permission denied" in tail:
                    raise NodeFailure("the node refused the password (and the key)",
                                      "check the password, and ssh.user in the cluster file"
                                      ) from None
                raise exc from None
            outcome.connection = "password"
        self.sessions[node.host] = session
        if outcome.connection == "key" and known is not None:
            self._facts[node.host] = first  # the whole facts already, in one round trip
            self.on_event(node.host, "facts (key)")
            return
        secret = self.password() if outcome.connection == "password" else None
        if first["sudo"]["mode"] == "needs-password":
            secret = secret or self.password()
        if secret is not None:
            session.channel.send("sudo", {"password": secret.reveal()})
        self._facts[node.host] = session.ask("facts", {}, self.opts.timeout * 3)
        self.on_event(node.host, f"facts ({outcome.connection})")

    def _open(self, node: NodeSpec, transport: SshTransport) -> NodeSession:
        channel = NodeChannel(transport, NODE_PYTHON, SETUP, self._node_config(node),
                              on_frames=lambda lines: None, on_closed=lambda code, err: None,
                              tag="setup")
        session = NodeSession(channel)
        channel.on_frames, channel.on_closed = session.on_frames, session.on_closed
        try:
            channel.start()
        except OSError as exc:
            raise NodeFailure(f"cannot start ssh: {exc}", "install openssh-client") from None
        with self._opened_lock:
            self._opened.append(session)
        return session

    def _node_config(self, node: NodeSpec) -> dict[str, Any]:
        # the interface is the route to the master's address as the head resolves it: the
        # master's name may resolve on the nodes only once the /etc/hosts step ran
        master = self.targets[self.spec.nodes[0].host][0]
        return {"pubkey": self.pubkey, "venv": P.VENV, "wheelhouse": P.WHEELHOUSE,
                "env_file": P.ENV_FILE, "packages": list(P.PACKAGES), "master_addr": master,
                "workdir": node.workdir}

    def _choose_torch(self, facts: dict[str, dict[str, Any]]) -> TorchChoice:
        try:
            import importlib.metadata

            version = importlib.metadata.version("torch")
        except Exception:  # noqa: BLE001 - no torch on the head: the newest known good
            version = "2.13.0"
        gpus = [GpuNode(h, f["gpu"]["count"], f["gpu"]["driver"],
                        tuple(f["gpu"]["compute_capability"])) for h, f in facts.items()]
        return choose_torch(version, gpus, self.opts.torch_backend)

    def _cluster_facts(self, facts: dict[str, dict[str, Any]],
                       torch: TorchChoice) -> P.ClusterFacts:
        master_addr = self.spec.master.addr
        return P.ClusterFacts(
            pubkey=self.pubkey, torch=torch, self_version=self_version(),
            python=f"{sys.version_info[0]}.{sys.version_info[1]}",
            addrs={h: o.addr for h, o in self.outcomes.items() if o.addr},
            hostnames={h: f["hostname"] for h, f in facts.items()},
            master_addr=master_addr, master_port=self.spec.master.port or 29500,
            interfaces={n.host: n.interface for n in self.spec.nodes})

    # -- apply ---------------------------------------------------------------------------------
    def _apply(self, node: NodeSpec) -> None:
        outcome = self.outcomes[node.host]
        session = self.sessions[node.host]
        facts = dict(self._facts[node.host] or {})
        before = {s.name: s for s in outcome.before}
        for d in P.STEP_DEFS:
            if before[d.name].status == P.OK:
                continue
            if d.sections:  # the step's own facts, read again right now
                facts.update(session.ask("facts", {"only": list(d.sections)},
                                         self.opts.timeout * 3))
            cluster = self.cluster
            step = d.plan(node.host, facts, cluster)  # this step alone, from those facts
            if d.wheelhouse and step.status == P.CHANGE:
                step = d.plan(node.host, facts, self._with_manifest(cluster))
            if step.status == P.OK:
                outcome.applied.append((d.name, "skipped", "already done"))
                continue
            if step.status == P.BLOCKED:
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

    def _with_manifest(self, cluster: P.ClusterFacts) -> P.ClusterFacts:
        """``cluster`` with the head's wheelhouse manifest, the wheelhouse prepared first (once,
        for every node)."""
        with self._wheels_lock:
            if self._wheels_error is not None:
                raise self._wheels_error
            if self._wheels is None:
                begun = time.monotonic()
                try:
                    folder, _, man = prepare_wheelhouse(Path(self.opts.wheelhouse), cluster.torch)
                except Exception as exc:  # noqa: BLE001
                    fix = getattr(exc, "fix", None) or "see -v"
                    self._wheels_error = NodeFailure(getattr(exc, "message", str(exc)), fix)
                    raise self._wheels_error from None
                self._wheels = (folder, man)
                self._wheels_s = round(time.monotonic() - begun, 2)
        self.cluster = replace(self.cluster, manifest=self._wheels[1])
        return replace(cluster, manifest=self._wheels[1])

    def _act(self, node: NodeSpec, session: NodeSession, action: P.StepAction) -> tuple[bool, str]:
        if action.kind == "copy":
            return self._copy(node, list(action.argv))
        argv = list(action.argv)
        if action.env:
            argv = ["env", *[f"{k}={v}" for k, v in action.env], *argv]
        done = session.ask("run", {"id": 1, "argv": argv, "root": action.root,
                                   "input": action.input, "timeout": action.timeout},
                           action.timeout + 30)
        return done["rc"] == 0, done.get("out", "")

    def _copy(self, node: NodeSpec, names: list[str]) -> tuple[bool, str]:
        assert self._wheels is not None
        folder = self._wheels[0]
        remote = remote_command(["sh", "-c", f"mkdir -p {P.WHEELHOUSE} && tar -C "
                                 f"{P.WHEELHOUSE} -xf -"])
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
        facts = session.ask("facts", {}, self.opts.timeout * 3)
        outcome.after = P.plan_node(node.host, facts, self.cluster)
        if P.pending(outcome.after) and self.cluster.manifest is not None:
            facts.update(session.ask("facts", {"only": ["wheels"]}, self.opts.timeout * 3))
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

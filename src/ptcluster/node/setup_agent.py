"""The node side of ``ptcluster setup``: read-only facts, and commands run on the head's word.

Shipped like the doctor's probe (source over the channel's stdin, ``remote.bootstrap``) and run
by the node's system ``python3``: standard library only, nothing of ptcluster installed.

  stdin  line 2   JSON config (``setup_facts.SetupConfig``): pubkey, venv, wheelhouse, env_file,
                  packages, master_addr, workdir
  stdin           ``sudo {"password": ...}``   kept in memory only, piped to ``sudo -S``
                  ``facts {"only": [...]}``    -> ``facts {...}``           (``FactsAsk``)
                  ``run {"id", "argv", "root", "input", "timeout"}`` -> ``done {"id", "rc", "out"}``
                  (``StepRun`` -> ``StepDone``)
                  ``bye``: exit once what was asked is done; ``stop`` or EOF: end the
                  running command (its process group) and exit

The password never reaches a command line, an environment, a file or a frame sent back: it is
written to ``sudo -S``'s stdin and scrubbed from any output returned.

The facts themselves, one function per section, and the command runner are
``node.facts.setup_facts``; this module is the program: its loop, sudo, and the steps' commands.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import sys
import threading
from typing import Any, TypedDict

from ptcluster.node.facts.firewall import UFW_ADDED, ufw_enabled
from ptcluster.node.facts.setup_facts import (
    COMMANDS,
    NO_ROOT,
    SECTIONS,
    SetupConfig,
    SetupFacts,
    Sudo,
    login_name,
    run,
    sections,
)
from ptcluster.node.wire import Kind, control, encode, hello, split


class _Step(TypedDict):
    id: int
    argv: list[str]
    """The command (an argument starting ``~/`` is under the node's home)."""
    root: bool
    """Run as root, the way this node allows (``Node.root_run``)."""
    input: str | None
    """Its standard input."""
    timeout: float


class StepRun(_Step, total=False):
    """A step's command (``run``: ``setup.apply.Setup`` writes it, ``Node.run_step`` runs it)."""

    env: dict[str, str] | None
    """Its environment (None: this program's)."""


class FactsAsk(TypedDict, total=False):
    """``facts``: the sections ``only`` names (None: all), the wheels hashed (``hash_only``)."""

    only: list[str] | None
    hash_only: list[str] | None


class StepDone(TypedDict):
    """A step's outcome (``done``, the answer to ``run``; ``setup.apply`` reads it)."""

    id: int
    rc: int
    """Its exit status."""
    out: str
    """Its output's last 4000 characters, the sudo password scrubbed."""


class Node:
    def __init__(self, cfg: SetupConfig) -> None:
        self.cfg = cfg
        self.password: str | None = None
        self.sudo_mode: str | None = None
        self.sudo_facts: Sudo | None = None
        self.ran: dict[tuple[str, ...], tuple[int, str]] = {}
        """What the password's check ran as root besides ``true`` (see ``sudo``), kept for
        the fact that needs it in the same ``facts`` call."""

    # -- sudo ---------------------------------------------------------------------------------
    def sudo(self, check: tuple[str, ...] = ("true",)) -> Sudo:
        """root | nopasswd | password | needs-password | wrong-password | none (+ why).

        The password is checked by running ``check`` as root: a command whose output a fact
        needs anyway (ufw's rules) saves a second password check (sudo's hashing of it is
        ~60 ms of CPU); its result waits in ``ran``. Should it fail, ``true`` tells why."""
        if os.geteuid() == 0:
            return {"mode": "root"}
        if shutil.which("sudo") is None:
            return {"mode": "none", "why": "sudo is not installed"}
        code, out = run(["sudo", "-n", "true"])
        if code == 0:
            return {"mode": "nopasswd"}
        if self.password is None:
            return {"mode": "needs-password"}
        code, out = COMMANDS.sudo(list(check), self.password)
        out = self.scrub(out)
        if code == 0:
            if check != ("true",):
                self.ran[check] = (code, out)
            return {"mode": "password"}
        low = out.lower()
        if "incorrect password" in low or "sorry, try again" in low:
            return {"mode": "wrong-password", "why": "sudo refused the password"}
        if check != ("true",):  # another refusal, or the command failed: the plain check says
            return self.sudo()
        return {"mode": "none", "why": out.strip().splitlines()[-1].rstrip(".") if out.strip()
                else f"sudo exit status {code}"}

    def root_run(self, argv: list[str], data: str | None = None, timeout: float = 30.0,
                 env: dict[str, str] | None = None) -> tuple[int, str]:
        """``argv`` run as root the way this node allows, ``data`` its input: ``(exit status,
        output)``; 1 and why where it has no root for us."""
        mode = self.sudo_mode or self.sudo()["mode"]
        self.sudo_mode = mode
        if mode == "root":
            return run(argv, stdin=data, timeout=timeout, env=env)
        if mode == "nopasswd":
            return run(["sudo", "-n", "--", *argv], stdin=data, timeout=timeout, env=env)
        if mode == "password" and self.password is not None:
            # -k inside: sudo asks every time, and the password goes only to its prompt
            return COMMANDS.sudo(argv, self.password, stdin=data, timeout=timeout, env=env)
        return 1, f"no root on this node (sudo: {mode})"

    def scrub(self, text: str) -> str:
        if self.password:
            text = text.replace(self.password, "***")
        return text

    # -- facts --------------------------------------------------------------------------------
    def facts(self, only: list[str] | None) -> SetupFacts:
        """The sections ``only`` names (``setup_facts.sections``), and who and where this is."""
        names = sections(only)
        out: SetupFacts = {"user": login_name(), "uid": os.geteuid(),
                               "home": os.path.expanduser("~"), "hostname": os.uname()[1],
                               "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
                               "python_path": sys.executable}
        # what needs no root runs beside sudo's check of the password
        slow = [threading.Thread(target=lambda fact=SECTIONS[name]: out.update(fact(self)))
                for name in names if name in NO_ROOT]
        for t in slow:
            t.start()
        if self.sudo_facts is None:  # once per password (sudo is slow to ask)
            self.sudo_facts = self.sudo(UFW_ADDED if "firewall" in names and ufw_enabled()
                                        else ("true",))
        self.sudo_mode = self.sudo_facts["mode"]
        out["sudo"] = self.sudo_facts
        for name in names:
            if name not in NO_ROOT:
                out.update(SECTIONS[name](self))
        for t in slow:
            t.join()
        self.ran.clear()
        return out

    # -- commands -----------------------------------------------------------------------------
    def run_step(self, msg: StepRun) -> StepDone:
        argv = [os.path.expanduser(a) if a.startswith("~/") else a for a in msg["argv"]]
        data, timeout, env = msg.get("input"), float(msg.get("timeout", 600)), msg.get("env")
        if msg.get("root"):
            code, out = self.root_run(argv, data, timeout, env)
        else:
            code, out = run(argv, stdin=data, timeout=timeout, env=env)
        return {"id": msg["id"], "rc": code, "out": self.scrub(out)[-4000:]}


def main() -> None:
    stdin = sys.stdin.buffer
    cfg: SetupConfig = json.loads(stdin.readline())
    out = sys.stdout.buffer
    node = Node(cfg)

    def send(kind: str, payload: object) -> None:
        out.write(encode(kind, payload))
        out.flush()

    out.write(hello("setup"))
    out.flush()
    # Requests are served on a worker thread, so that this thread sees the channel end (EOF:
    # the head went away, Ctrl-C there) even while a command runs, and ends that command:
    # every step can be re-run, so a re-run brings the node to the same end state.
    requests: queue.Queue[tuple[str, Any] | None] = queue.Queue()

    def serve() -> None:
        while True:
            item = requests.get()
            if item is None:
                return
            kind, msg = item  # (the head's request, as it declares it)
            try:
                if kind == Kind.FACTS:
                    ask: FactsAsk = msg
                    if "hash_only" in ask:
                        node.cfg["hash_only"] = ask["hash_only"]
                    send(Kind.FACTS, node.facts(ask.get("only")))
                elif kind == Kind.RUN:
                    step: StepRun = msg
                    send(Kind.DONE, node.run_step(step))
            except OSError:  # the head is gone
                return

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    for raw in iter(stdin.readline, b""):
        kind, payload = split(raw.decode().rstrip("\n"))
        if kind == Kind.BYE:  # what was asked is finished first
            requests.put(None)
            worker.join()
            os._exit(0)
        if kind == Kind.STOP:
            break
        if kind == Kind.HB:
            continue
        msg = control(payload)
        if kind == Kind.SUDO:
            node.password = msg.get("password")
            node.sudo_mode = node.sudo_facts = None
        elif kind in (Kind.FACTS, Kind.RUN):
            requests.put((kind, msg))
    # stop, or EOF: the head was interrupted (Ctrl-C) or is gone
    COMMANDS.stop()  # a command being started now ends itself (see Commands.run)
    requests.put(None)
    worker.join(timeout=15)  # what is queued returns at once; one being started is ended
    os._exit(0)


if __name__ == "__main__":
    main()

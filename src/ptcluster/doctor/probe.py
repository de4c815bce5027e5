"""The doctor's node-side probe: facts about one node as JSON (standard library first).

Shipped and started like the guard (source over the channel's stdin, see ``remote.bootstrap``).
One ssh session per node does everything:

  stdin  line 2   JSON config: workdir, peers, master_addr, master_port (master only), ...
  stdout          frames of ``remote.wire``: ``hello``, then ``ready {facts}`` (facts, plus the
                  ports this node now listens on)
  stdin           ``connect {"targets": [[label, host, port], ...], "timeout": s}``
  stdout          ``connect {"results": [...]}``
  stdin           EOF or ``bye``: close the listeners and exit

torch is imported once, last, in this process (never per check).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from ptcluster.remote.wire import control, encode, hello, split  # inlined


def sh(*argv: str, timeout: float = 5.0) -> tuple[int, str]:
    """Run a command; (exit code, stdout+stderr). 127 when it is not installed."""
    if shutil.which(argv[0]) is None:
        return 127, f"{argv[0]}: not installed"
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return 126, str(exc)
    return p.returncode, (p.stdout + p.stderr).strip()


def resolve(name: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    out: list[str] = []
    for info in infos:
        addr = str(info[4][0])
        if addr not in out:
            out.append(addr)
    return out


def interfaces() -> list[dict[str, Any]]:
    code, out = sh("ip", "-j", "addr", "show")
    result = []
    if code == 0:
        try:
            for link in json.loads(out):
                result.append({
                    "name": link.get("ifname"),
                    "up": "UP" in link.get("flags", []) and link.get("operstate") != "DOWN",
                    "ipv4": [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])
                             if a.get("family") == "inet"],
                })
        except (ValueError, KeyError, TypeError):
            pass
    return result


def route_dev(addr: str) -> str | None:
    code, out = sh("ip", "-o", "route", "get", addr)
    words = out.split()
    if code != 0 or "dev" not in words:
        return None
    return words[words.index("dev") + 1]


def firewall() -> dict[str, Any]:
    info: dict[str, Any] = {}
    code, out = sh("nft", "list", "ruleset")
    if code == 0:
        info["nft_rules"] = sum(1 for line in out.splitlines()
                                if line.strip() and not line.strip().startswith(
                                    ("table", "chain", "type", "}", "policy")))
        info["nft_drop"] = sum(1 for line in out.splitlines() if " drop" in line
                               or "reject" in line)
    code, out = sh("iptables", "-S")
    if code == 0:
        info["iptables_rules"] = sum(1 for line in out.splitlines() if line.startswith("-A"))
    code, out = sh("ufw", "status")
    if code == 0:
        info["ufw"] = out.splitlines()[0] if out else ""
    return info


def gpus() -> dict[str, Any]:
    code, out = sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                   "--format=csv,noheader", timeout=15)
    if code != 0:
        return {"count": 0, "driver": None, "names": [], "error": None if code == 127 else out}
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    return {"count": len(rows), "driver": rows[0][1] if rows else None,
            "names": [r[0] for r in rows]}


def torch_facts() -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # noqa: BLE001 - report any import failure as a fact
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    facts: dict[str, Any] = {
        "ok": True, "version": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": bool(torch.cuda.is_available()),
        "device_count": int(torch.cuda.device_count()) if torch.cuda.is_available() else 0,
        "gloo": bool(dist.is_gloo_available()), "nccl_available": bool(dist.is_nccl_available()),
        "nccl": None,
    }
    if facts["cuda_available"]:
        try:
            v = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except Exception as exc:  # noqa: BLE001
            facts["nccl"] = f"error: {exc}"
    facts["import_s"] = round(time.perf_counter() - t0, 3)
    return facts


def collect(cfg: dict[str, Any]) -> dict[str, Any]:
    workdir = cfg["workdir"]
    hostname = socket.gethostname()
    facts: dict[str, Any] = {
        "time": time.time(),
        "hostname": hostname,
        "hostname_addrs": resolve(hostname),
        "python": {"executable": sys.executable, "version": platform.python_version()},
        "workdir": {"path": workdir, "exists": os.path.isdir(workdir),
                    "writable": os.access(workdir, os.W_OK)},
        "interfaces": interfaces(),
        "peers": {},
        "firewall": firewall(),
        "gpus": gpus(),
    }
    for peer in cfg.get("peers", []):
        addrs = resolve(peer)
        facts["peers"][peer] = {"addrs": addrs,
                                "route_dev": route_dev(addrs[0]) if addrs else None}
    master = cfg.get("master_addr")
    if master:
        addrs = resolve(master)
        facts["master"] = {"addrs": addrs, "route_dev": route_dev(addrs[0]) if addrs else None}
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = f.read().split()
        facts["ephemeral_range"] = [int(lo), int(hi)]
    except (OSError, ValueError):
        facts["ephemeral_range"] = None
    for key, path in (("shm", "/dev/shm"), ("disk", workdir)):
        try:
            st = os.statvfs(path)
            facts[key] = {"free": st.f_bavail * st.f_frsize, "total": st.f_blocks * st.f_frsize}
        except OSError:
            facts[key] = None
    facts["torch"] = torch_facts() if cfg.get("torch", True) else None
    facts["time"] = time.time()  # last: the head compares it with its clock on arrival
    return facts


class Listener:
    """Accepts and closes connections on a port until the probe ends."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("", port))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()


def connect_all(targets: list[list[Any]], timeout: float) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(label: str, host: str, port: int) -> None:
        t0 = time.perf_counter()
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                err = None
        except OSError as exc:
            err = exc.strerror or str(exc) or type(exc).__name__
        with lock:
            results.append({"label": label, "host": host, "port": port, "error": err,
                            "ms": round((time.perf_counter() - t0) * 1000, 1)})

    threads = [threading.Thread(target=one, args=tuple(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def emit(frame: bytes) -> None:
    sys.stdout.buffer.write(frame)
    sys.stdout.flush()


def main() -> int:
    cfg = json.loads(sys.stdin.readline())
    emit(hello("probe"))
    facts = collect(cfg)
    listening: dict[str, Any] = {"master": None, "ephemeral": None, "master_error": None}
    listeners = []
    if cfg.get("master_port"):
        try:
            listeners.append(Listener(int(cfg["master_port"])))
            listening["master"] = int(cfg["master_port"])
        except OSError as exc:
            listening["master_error"] = exc.strerror or str(exc)
    try:
        eph = Listener(0)  # the kernel picks from ip_local_port_range, as NCCL/Gloo sockets do
        listeners.append(eph)
        listening["ephemeral"] = eph.port
    except OSError as exc:
        listening["ephemeral_error"] = str(exc)
    facts["listening"] = listening
    emit(encode("ready", facts))
    for line in sys.stdin:
        kind, payload = split(line.strip())
        if kind == "connect":
            request = control(payload)
            emit(encode("connect", {"results": connect_all(request.get("targets", []),
                                                           float(request.get("timeout", 2.0)))}))
        elif kind != "hb":
            break  # "bye", EOF or anything unknown: done
    for lst in listeners:
        lst.sock.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)

"""The doctor's node-side probe: facts about one node as JSON (standard library first).

Shipped and started like the guard (source over the channel's stdin, see ``remote.bootstrap``).
One ssh session per node does everything:

  stdin  line 2   JSON config: workdir, peers, master_addr, master_port (master only), ...
  stdout          frames of ``remote.wire``: ``hello``, then ``ready {facts}`` (facts, plus the
                  ports this node now listens on)
  stdin           ``connect {"targets": [[label, host, port], ...], "timeout": s}``
  stdout          ``connect {"results": [...]}``
  stdin           EOF or ``bye``: close the listeners and exit

torch is never imported here (an import costs seconds per node): its versions come from its
package metadata and ``torch/version.py`` (parsed, never executed), the CUDA libraries' versions
from their wheels' metadata or file names, and GPUs from NVML through ctypes. Importing torch is
the all-reduce's job (``doctor/allreduce.py``).

Version facts are ``None`` when the thing is not installed (a CPU build has no NCCL) and are
named in ``unknown`` (with the reason) when it is there but its version cannot be told.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ptcluster.remote.netif import route_interface  # inlined
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


def parse_ip_addr(text: str) -> list[dict[str, Any]]:
    """``ip -j addr show`` -> [{name, up, ipv4: ["addr/len"]}]; raises on unexpected output."""
    links = json.loads(text)
    if not isinstance(links, list):
        raise ValueError(f"expected a JSON list, got {type(links).__name__}")
    return [{
        "name": str(link["ifname"]),
        "up": "UP" in link.get("flags", []) and link.get("operstate") != "DOWN",
        "ipv4": [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])
                 if a.get("family") == "inet"],
    } for link in links]


def interfaces() -> tuple[list[dict[str, Any]], str | None]:
    """(interfaces, None), or ([], why they could not be listed)."""
    code, out = sh("ip", "-j", "addr", "show")
    if code != 0:
        return [], f"`ip -j addr show` failed: {out or f'exit status {code}'}"
    try:
        return parse_ip_addr(out), None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return [], f"`ip -j addr show` output does not parse ({type(exc).__name__}: {exc})"


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


# -- GPUs and the NVIDIA driver ------------------------------------------------------------------

NVML_LIB = "libnvidia-ml.so.1"
NVML_DRIVER_NOT_LOADED = 9  # nvmlInit on a machine with the library but no NVIDIA driver
SMI_FIELDS = ("name", "driver_version", "memory.total", "compute_cap")


def no_gpus(driver: str | None = None, error: str | None = None) -> dict[str, Any]:
    return {"count": 0, "names": [], "memory_mib": [], "compute_capability": [],
            "driver": driver, "cuda_driver": None, "source": None, "error": error}


def read_nvml(nvml: Any) -> dict[str, Any]:
    """GPU facts from a loaded NVML library (``ctypes.CDLL(NVML_LIB)``)."""
    import ctypes  # here, not at the top: a Python built without libffi has no ctypes
    nvml.nvmlErrorString.restype = ctypes.c_char_p

    def call(name: str, *args: Any) -> None:
        code = getattr(nvml, name)(*args)
        if code != 0:
            raise RuntimeError(f"{name}: {nvml.nvmlErrorString(code).decode(errors='replace')}")

    code = nvml.nvmlInit_v2()
    if code == NVML_DRIVER_NOT_LOADED:
        return no_gpus()
    if code != 0:
        return no_gpus(error=f"nvmlInit: {nvml.nvmlErrorString(code).decode(errors='replace')}")
    facts = no_gpus()
    facts["source"] = "nvml"
    text = ctypes.create_string_buffer(96)
    try:
        call("nvmlSystemGetDriverVersion", text, 96)
        facts["driver"] = text.value.decode()
        cuda = ctypes.c_int(0)
        if nvml.nvmlSystemGetCudaDriverVersion_v2(ctypes.pointer(cuda)) == 0:
            facts["cuda_driver"] = f"{cuda.value // 1000}.{cuda.value % 1000 // 10}"
        count = ctypes.c_uint(0)
        call("nvmlDeviceGetCount_v2", ctypes.pointer(count))
        for index in range(count.value):
            handle = ctypes.c_void_p()
            call("nvmlDeviceGetHandleByIndex_v2", index, ctypes.pointer(handle))
            call("nvmlDeviceGetName", handle, text, 96)
            memory = (ctypes.c_ulonglong * 3)()  # nvmlMemory_t: total, free, used
            call("nvmlDeviceGetMemoryInfo", handle, ctypes.pointer(memory))
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            capability = nvml.nvmlDeviceGetCudaComputeCapability(
                handle, ctypes.pointer(major), ctypes.pointer(minor))
            facts["names"].append(text.value.decode(errors="replace"))
            facts["memory_mib"].append(memory[0] >> 20)
            facts["compute_capability"].append(f"{major.value}.{minor.value}"
                                               if capability == 0 else None)
            facts["count"] += 1
    except (RuntimeError, AttributeError) as exc:  # AttributeError: an NVML without that call
        facts["error"] = str(exc)
    finally:
        nvml.nvmlShutdown()
    return facts


def parse_nvidia_smi_csv(text: str, fields: tuple[str, ...] = SMI_FIELDS) -> dict[str, Any]:
    """``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`` -> GPU facts.

    Fields are taken from the right, so a name holding a comma stays whole."""
    facts = no_gpus()
    facts["source"] = "nvidia-smi"
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < len(fields):
            raise ValueError(f"expected {len(fields)} fields: {line!r}")
        cut = len(parts) - len(fields) + 1
        row = dict(zip(fields, [", ".join(parts[:cut]), *parts[cut:]], strict=True))
        facts["names"].append(row["name"])
        facts["driver"] = row.get("driver_version") or facts["driver"]
        memory = row.get("memory.total", "")
        facts["memory_mib"].append(int(memory) if memory.isdigit() else None)
        facts["compute_capability"].append(row.get("compute_cap"))
        facts["count"] += 1
    return facts


def smi_gpus() -> dict[str, Any] | None:
    """GPU facts from nvidia-smi; None when it is not installed."""
    for fields in (SMI_FIELDS, SMI_FIELDS[:3]):  # an older nvidia-smi has no compute_cap
        code, out = sh("nvidia-smi", f"--query-gpu={','.join(fields)}",
                       "--format=csv,noheader,nounits", timeout=15)
        if code == 127:
            return None
        if code == 0:
            try:
                return parse_nvidia_smi_csv(out, fields)
            except ValueError as exc:
                return no_gpus(error=f"nvidia-smi output does not parse: {exc}")
    return no_gpus(error=f"nvidia-smi failed: {out}")


def parse_driver_version(text: str) -> str | None:
    """The driver version from /sys/module/nvidia/version ("580.82.07") or from
    /proc/driver/nvidia/version ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.82.07 ...").
    """
    version = r"\d+\.\d+(\.\d+)?"
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            return next((word for word in line.split() if re.fullmatch(version, word)), None)
    return text.strip() if re.fullmatch(version, text.strip()) else None


def kernel_driver_version() -> str | None:
    for path in ("/sys/module/nvidia/version", "/proc/driver/nvidia/version"):
        try:
            with open(path) as f:
                found = parse_driver_version(f.read())
        except OSError:
            continue
        if found:
            return found
    return None


def gpus() -> dict[str, Any]:
    """NVML through ctypes; nvidia-smi when the library cannot be loaded; the kernel module's
    version for the driver when neither says it."""
    try:
        import ctypes
        nvml = ctypes.CDLL(NVML_LIB)
    except (ImportError, OSError):  # no NVML here (or no ctypes in this Python)
        facts = smi_gpus()
    else:
        try:
            facts = read_nvml(nvml)
        except AttributeError as exc:  # an NVML too old for nvmlInit_v2
            facts = no_gpus(error=f"{NVML_LIB}: {exc}")
    if facts is None:
        driver = kernel_driver_version()
        facts = no_gpus(driver, f"NVIDIA driver {driver} is loaded but neither {NVML_LIB} nor "
                                "nvidia-smi is installed" if driver else None)
    elif not facts["driver"]:
        facts["driver"] = kernel_driver_version()
    return facts


# -- torch and its CUDA libraries, without importing torch -----------------------------------------

# (facts key, wheel name prefix, library file stem): NCCL and cuDNN as torch's CUDA wheels ship them
CUDA_LIBS = (("nccl", "nvidia-nccl", "libnccl"), ("cudnn", "nvidia-cudnn", "libcudnn"))
SYSTEM_LIB_DIRS = ("/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu",
                   "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def parse_version_py(text: str) -> dict[str, Any]:
    """The literal top-level assignments of torch/version.py (``__version__``, ``cuda``, ``hip``),
    parsed with ``ast``: the file is never executed."""
    out: dict[str, Any] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            try:
                out[target.id] = ast.literal_eval(value)
            except ValueError:
                continue
    return out


def lib_file_version(name: str, stem: str) -> str | None:
    """"libnccl.so.2.27.7" -> "2.27.7"; None for "libnccl.so.2" (the major version only)."""
    m = re.fullmatch(re.escape(stem) + r"\.so\.(\d+(?:\.\d+)+)", name)
    return m.group(1) if m else None


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


def lib_version(stem: str, dirs: list[str]) -> tuple[str, str] | None:
    """(version, path) of ``<stem>.so.X.Y...`` in the first of ``dirs`` that has one: the target
    of the link the loader opens (libnccl.so.2 -> libnccl.so.2.27.7), else the newest file."""
    for folder in dirs:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        found = []
        for name in names:
            if name.startswith(stem + ".so"):
                path = os.path.join(folder, name)
                version = (lib_file_version(name, stem) or
                           lib_file_version(os.path.basename(os.path.realpath(path)), stem))
                if version:
                    found.append((_version_key(version), version, path))
        if found:
            soname = re.escape(stem) + r"\.so\.\d+"
            linked = [f for f in found if re.fullmatch(soname, os.path.basename(f[2]))]
            _, version, path = max(linked or found)
            return version, path
    return None


def required_names(requires: list[str], prefix: str) -> list[str]:
    """Names in a package's requirements ("nvidia-nccl-cu13==2.27.7; ...") that start with
    ``prefix``."""
    out = []
    for req in requires:
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
        if m and m.group(0).lower().replace("_", "-").startswith(prefix):
            out.append(m.group(0))
    return out


def wheel_version(prefix: str, requires: list[str]) -> tuple[str, str] | None:
    """(version, name) of the installed wheel torch requires (nvidia-nccl-cu13...), or of the
    usual names when torch does not say."""
    from importlib import metadata
    names = required_names(requires, prefix) + [f"{prefix}-cu{m}" for m in (13, 12, 11)]
    for name in dict.fromkeys(names):
        try:
            return metadata.version(name), name
        except metadata.PackageNotFoundError:
            continue
    return None


def torch_facts() -> dict[str, Any]:
    """torch's version, CUDA, NCCL and cuDNN for this interpreter, without importing torch."""
    from importlib import metadata
    facts: dict[str, Any] = {"ok": False, "version": None, "cuda": None, "hip": None,
                             "nccl": None, "cudnn": None, "path": None, "source": {},
                             "unknown": {}, "error": None}
    unknown: dict[str, str] = facts["unknown"]
    spec = importlib.util.find_spec("torch")  # where `import torch` would load it from
    if spec is None or not spec.submodule_search_locations:
        facts["error"] = f"torch is not installed for {sys.executable}"
        return facts
    root = Path(next(iter(spec.submodule_search_locations)))
    facts.update(ok=True, path=str(root))
    try:
        version_py, why = parse_version_py((root / "version.py").read_text()), None
    except (OSError, SyntaxError, ValueError) as exc:
        version_py, why = {}, f"torch/version.py: {type(exc).__name__}: {exc}"
    # The metadata next to the package `import torch` finds, not another torch on the path.
    dist = next(iter(metadata.distributions(name="torch", path=[str(root.parent)])), None)
    try:
        meta_version = dist.version if dist is not None else None
    except Exception:  # noqa: BLE001 - a broken dist-info folder: fall back to version.py
        meta_version = None
    if meta_version:
        facts["version"], facts["source"]["version"] = meta_version, "package metadata"
    elif isinstance(version_py.get("__version__"), str):
        facts["version"], facts["source"]["version"] = version_py["__version__"], "version.py"
    else:
        unknown["torch"] = f"no package metadata, and {why or 'no __version__ in version.py'}"
    if "cuda" in version_py and isinstance(version_py["cuda"], (str, type(None))):
        facts["cuda"], facts["source"]["cuda"] = version_py["cuda"], "version.py"
    else:
        unknown["cuda"] = why or "no cuda = '<version>' or None in torch/version.py"
    if isinstance(version_py.get("hip"), str):
        facts["hip"] = version_py["hip"]
    if facts["cuda"] is None and "cuda" not in unknown:
        return facts  # a CPU build has no NCCL or cuDNN (ROCm's RCCL is not looked for)
    try:
        requires = (dist.requires or []) if dist is not None else []
    except Exception:  # noqa: BLE001 - as above
        requires = []
    dirs = [str(root / "lib"), os.path.join(sys.prefix, "lib"),
            *[d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d],
            *SYSTEM_LIB_DIRS]
    for key, wheel, stem in CUDA_LIBS:
        found = wheel_version(wheel, requires)
        if found:
            facts[key], facts["source"][key] = found[0], f"{found[1]} package"
        elif (lib := lib_version(stem, dirs)) is not None:
            facts[key], facts["source"][key] = lib
        else:
            unknown[key] = (f"no {wheel}-* package and no {stem}.so.X.Y file (torch may have it "
                            "built in)")
    return facts


def collect(cfg: dict[str, Any]) -> dict[str, Any]:
    workdir = os.path.expanduser(cfg["workdir"])  # `~` is the node's home, as for the guard
    hostname = socket.gethostname()
    facts: dict[str, Any] = {
        "time": time.time(),
        "hostname": hostname,
        "hostname_addrs": resolve(hostname),
        "python": {"executable": sys.executable, "version": platform.python_version()},
        "workdir": {"path": workdir, "exists": os.path.isdir(workdir),
                    "writable": os.access(workdir, os.W_OK)},
        "peers": {},
        "firewall": firewall(),
        "gpus": gpus(),
    }
    facts["interfaces"], facts["interfaces_error"] = interfaces()
    for peer in cfg.get("peers", []):
        addrs = resolve(peer)
        facts["peers"][peer] = {"addrs": addrs,
                                "route_dev": route_dev(addrs[0]) if addrs else None}
    master = cfg.get("master_addr")
    if master:
        addrs = resolve(master)
        iface, why = route_interface(master)  # the guard's own rule (remote/netif.py)
        facts["master"] = {"addrs": addrs, "route_dev": route_dev(addrs[0]) if addrs else None,
                           "interface": iface, "interface_error": why}
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

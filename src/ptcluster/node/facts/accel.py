"""GPUs, the driver, and torch's CUDA/NCCL/cuDNN versions, without importing torch.

Part of the doctor's probe and of the guard (shipped with them, standard library only): NVML
through ctypes, then ``nvidia-smi``, then the kernel module for GPUs and the driver (and, for
the guard's choice of GPUs, NVML's compute processes on each); torch's version from its package
metadata, its CUDA version from ``torch/version.py`` read as text, NCCL and cuDNN from their
wheels or the library files the loader would open. ``None`` means not installed; what is there
but cannot be told is named in ``unknown`` with the reason.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, TypedDict


def sh(*argv: str, timeout: float = 5.0) -> tuple[int, str]:
    """Run a command; (exit code, stdout+stderr). 127 when it is not installed."""
    if shutil.which(argv[0]) is None:
        return 127, f"{argv[0]}: not installed"
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return 126, str(exc)
    return p.returncode, (p.stdout + p.stderr).strip()


NVML_LIB = "libnvidia-ml.so.1"
NVML_DRIVER_NOT_LOADED = 9  # nvmlInit on a machine with the library but no NVIDIA driver
SMI_FIELDS = ("name", "driver_version", "memory.total", "compute_cap")


def load_nvml() -> Any:
    """NVML, loaded: the one loader (``OSError`` where the library is not there,
    ``ImportError`` where this Python has no ctypes)."""
    import ctypes  # here, not at the top: a Python built without libffi has no ctypes
    return ctypes.CDLL(NVML_LIB)


class GpuFacts(TypedDict):
    """The node's NVIDIA GPUs as :func:`gpus` finds them: doctor's ``gpus`` (``DoctorFacts``),
    the health gate's count, and setup's ``gpu`` section its count, driver and capabilities."""

    count: int
    names: list[str]
    memory_mib: list[int | None]
    compute_capability: list[str | None]
    """``MAJOR.MINOR`` each (None where it was not said)."""
    driver: str | None
    cuda_driver: str | None
    """The CUDA version the driver supports (NVML only)."""
    source: str | None
    """``nvml``, ``nvidia-smi``, or None (neither answered)."""
    error: str | None


def no_gpus(driver: str | None = None, error: str | None = None) -> GpuFacts:
    return {"count": 0, "names": [], "memory_mib": [], "compute_capability": [],
            "driver": driver, "cuda_driver": None, "source": None, "error": error}


def read_nvml(nvml: Any) -> GpuFacts:
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


NVML_INSUFFICIENT_SIZE = 7


def compute_processes() -> tuple[dict[int, list[dict[str, int]]], str | None]:
    """Per GPU index, the compute processes NVML sees on it (``pid``, ``mib`` of GPU memory);
    and why that could not be asked (None when it was). Only through NVML: no driver, no
    answer (and no GPU to share)."""
    try:
        import ctypes
        nvml = load_nvml()
    except (ImportError, OSError):
        return {}, f"{NVML_LIB} cannot be loaded: GPU processes not checked"
    try:
        return _read_processes(nvml, ctypes), None
    except (RuntimeError, AttributeError) as exc:
        return {}, f"NVML: {exc}: GPU processes not checked"


def _read_processes(nvml: Any, ctypes: Any) -> dict[int, list[dict[str, int]]]:
    class Info(ctypes.Structure):  # nvmlProcessInfo_t of the _v2/_v3 calls
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                    ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]

    nvml.nvmlErrorString.restype = ctypes.c_char_p
    if nvml.nvmlInit_v2() != 0:
        raise RuntimeError("nvmlInit failed (no NVIDIA driver?)")
    try:
        get = getattr(nvml, "nvmlDeviceGetComputeRunningProcesses_v3", None) or \
            nvml.nvmlDeviceGetComputeRunningProcesses_v2
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.pointer(count)) != 0:
            raise RuntimeError("nvmlDeviceGetCount failed")
        out: dict[int, list[dict[str, int]]] = {}
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.pointer(handle)) != 0:
                raise RuntimeError(f"no handle for GPU {index}")
            n = ctypes.c_uint(0)
            code = get(handle, ctypes.pointer(n), None)  # how many, first
            infos = (Info * (n.value + 8))()  # room for a few that start meanwhile
            n = ctypes.c_uint(len(infos))
            code = get(handle, ctypes.pointer(n), infos)
            if code not in (0, NVML_INSUFFICIENT_SIZE):
                raise RuntimeError(nvml.nvmlErrorString(code).decode(errors="replace"))
            out[index] = [{"pid": int(infos[i].pid), "mib": int(infos[i].usedGpuMemory) >> 20
                           if infos[i].usedGpuMemory < 2 ** 63 else 0}
                          for i in range(min(n.value, len(infos)))]
        return out
    finally:
        nvml.nvmlShutdown()


def parse_nvidia_smi_csv(text: str, fields: tuple[str, ...] = SMI_FIELDS) -> GpuFacts:
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


def smi_gpus() -> GpuFacts | None:
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


def pci_gpu_count(base: str = "/sys/bus/pci/devices") -> int:
    """NVIDIA display controllers on the PCI bus: GPUs that are there with or without a driver
    (setup's driver step looks for those the driver does not show)."""
    count = 0
    for dev in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, dev, "vendor")) as f:
                vendor = f.read().strip()
            with open(os.path.join(base, dev, "class")) as f:
                klass = f.read().strip()
        except OSError:
            continue
        if vendor == "0x10de" and klass.startswith("0x03"):
            count += 1
    return count


def gpus() -> GpuFacts:
    """NVML through ctypes; nvidia-smi when the library cannot be loaded; the kernel module's
    version for the driver when neither says it."""
    try:
        nvml = load_nvml()
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
CUDA_LIBS: tuple[tuple[Literal["nccl", "cudnn"], str, str], ...] = (
    ("nccl", "nvidia-nccl", "libnccl"), ("cudnn", "nvidia-cudnn", "libcudnn"))
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


class TorchFacts(TypedDict):
    """torch as this interpreter would import it (:func:`torch_facts`): doctor's ``torch``
    (``DoctorFacts``)."""

    ok: bool
    """Whether torch is installed here."""
    version: str | None
    cuda: str | None
    """The CUDA it was built for; None: a CPU (or ROCm) build."""
    hip: str | None
    nccl: str | None
    cudnn: str | None
    path: str | None
    source: dict[str, str]
    """Where each version was read (``version.py``, a package, a library file)."""
    unknown: dict[str, str]
    """Why a version could not be read, by its key."""
    error: str | None


def no_torch() -> TorchFacts:
    """torch not found (or not asked: doctor's checks read a node without the section so)."""
    return {"ok": False, "version": None, "cuda": None, "hip": None, "nccl": None,
            "cudnn": None, "path": None, "source": {}, "unknown": {}, "error": None}


def torch_facts() -> TorchFacts:
    """torch's version, CUDA, NCCL and cuDNN for this interpreter, without importing torch."""
    from importlib import metadata
    facts = no_torch()
    unknown: dict[str, str] = facts["unknown"]
    spec = importlib.util.find_spec("torch")  # where `import torch` would load it from
    if spec is None or not spec.submodule_search_locations:
        facts["error"] = f"torch is not installed for {sys.executable}"
        return facts
    root = Path(next(iter(spec.submodule_search_locations)))
    facts["ok"], facts["path"] = True, str(root)
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

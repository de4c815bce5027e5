"""Which torch build the whole cluster gets: one build, chosen from the weakest GPU node.

A pure function of the head's torch version and every node's GPU facts. The rules (PyTorch's
published builds and NVIDIA's driver requirements):

* no GPU on any node: the ``+cpu`` build from PyTorch's CPU index (never PyPI's default build,
  which carries gigabytes of CUDA libraries a CPU node cannot use);
* any GPU older than sm_75 (Maxwell, Pascal, Volta): ``cu126``, the newest build that still
  ships kernels for them;
* otherwise by the lowest driver: >= 580 runs CUDA 13.x builds (``cu130``), >= 525.60.13 runs
  CUDA 12.x builds (``cu128``, by minor-version compatibility); older: no build fits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ptcluster.errors import Problem

CUDA13_DRIVER = (580,)
CUDA12_DRIVER = (525, 60, 13)
OLDEST_CU128_ARCH = (7, 5)
INDEX = "https://download.pytorch.org/whl/{variant}"
VARIANT = re.compile(r"^(cpu|cu\d{3})$")


@dataclass(frozen=True)
class GpuNode:
    """What the resolver needs to know about one node."""

    host: str
    gpus: int
    driver: str | None = None
    """The NVIDIA driver version (``550.54.14``); None when there is none."""
    compute_capability: tuple[str, ...] = ()
    """Per GPU, as nvidia-smi reports it (``8.0``)."""


@dataclass(frozen=True)
class TorchChoice:
    version: str
    """The torch version for every node (the head's, without its local part)."""
    variant: str | None
    """``cpu``, ``cu126``, ``cu128``, ``cu130``; None when no build fits (see ``problem``)."""
    why: str
    problem: Problem | None = None
    """Why no build fits (who: None, its what names the nodes)."""

    @property
    def requirement(self) -> str:
        return f"torch=={self.version}+{self.variant}"

    @property
    def local_version(self) -> str:
        return f"{self.version}+{self.variant}"

    @property
    def index_url(self) -> str:
        return INDEX.format(variant=self.variant)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


def base_version(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``."""
    return version.split("+", 1)[0]


def choose_torch(version: str, nodes: list[GpuNode], backend: str = "auto") -> TorchChoice:
    """One torch build for the cluster; ``backend`` is ``auto``, ``cpu`` or ``cuXYZ``."""
    version = base_version(version)
    if backend != "auto":
        if not VARIANT.match(backend):
            raise ValueError(f"unknown torch backend {backend!r} (auto, cpu or cuXYZ)")
        return TorchChoice(version, backend, f"--torch-backend {backend}")
    gpu_nodes = [n for n in nodes if n.gpus > 0]
    if not gpu_nodes:
        return TorchChoice(version, "cpu", "no node has an NVIDIA GPU: the CPU build")
    no_driver = [n.host for n in gpu_nodes if not n.driver]
    if no_driver:
        return TorchChoice(version, None, "", Problem(
            None, f"GPU without an NVIDIA driver on {', '.join(no_driver)}",
            "install the NVIDIA driver there (setup never installs drivers)"))
    low = min(gpu_nodes, key=lambda n: _version(n.driver or "0"))
    driver = low.driver or "0"
    caps = [(c, n.host) for n in gpu_nodes for c in n.compute_capability]
    old = [f"{h} (sm_{c.replace('.', '')})" for c, h in caps if _version(c) < OLDEST_CU128_ARCH]
    if _version(driver) < CUDA12_DRIVER:
        return TorchChoice(version, None, "", Problem(
            None, f"driver {driver} on {low.host} is older than 525.60.13, the oldest that runs "
            "any CUDA 12 build",
            "upgrade the NVIDIA driver to 525.60.13 or newer (580+ for CUDA 13)"))
    if old:
        return TorchChoice(version, "cu126", f"GPU older than sm_75 on {', '.join(old)}: "
                           "cu126 is the newest build with kernels for it")
    if _version(driver) >= CUDA13_DRIVER:
        return TorchChoice(version, "cu130", f"lowest driver {driver} ({low.host}) >= 580: "
                           "CUDA 13.0")
    return TorchChoice(version, "cu128", f"lowest driver {driver} ({low.host}) >= 525.60.13 "
                       "and < 580: CUDA 12.8")

"""The resolved environment: what both sides agree on (the head resolves it, env-B's node side
builds it). Pure data, no I/O.

Its ``digest`` is the environment's key on every node (``~/.ptcluster/envs/<digest>/``): the
platform and every shipped wheel's (name, version, sha256), sorted, so the same set gives the
same key whatever order the file listed it in, and any changed file or platform another one.
The tool that installs it (uv, in ``tools``) and the packages setup owns (``held``) are not part
of the key: they do not change what the environment holds.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

SETUP_OWNS = ("torch", "triton", "ptcluster")
"""Projects setup installs on every node (one torch build for the cluster): never shipped with
a project's environment, which sees them beneath its own packages."""
SETUP_OWNS_PREFIXES = ("nvidia-",)
"""torch's CUDA libraries (``nvidia-cublas-cu12``...): setup's too."""
KINDS = ("uv.lock", "pylock.toml", "requirements", "pyproject")
"""The declared files ``resolve`` takes, as ``ResolvedEnv.kind`` says them."""
ENVS_DIR = "~/.ptcluster/envs"
"""Where each node keeps its environments, one folder per digest."""

_NAME_RUN = re.compile(r"[-_.]+")


def normalize(name: str) -> str:
    """A project name as PEP 503 compares them: ``Foo_Bar.baz`` -> ``foo-bar-baz``."""
    return _NAME_RUN.sub("-", name).lower()


def setup_owns(name: str) -> bool:
    """True for torch, its CUDA libraries, triton and ptcluster: setup's, not the project's."""
    name = normalize(name)
    return name in SETUP_OWNS or name.startswith(SETUP_OWNS_PREFIXES)


@dataclass(frozen=True)
class Wheel:
    """One wheel file, known by its digest."""

    name: str
    """Normalized project name (PEP 503)."""
    version: str
    filename: str
    """The wheel's real file name (uv and pip read its tags from it to install it)."""
    sha256: str
    """Hex digest of the file: its key in every store."""
    size: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Wheel:
        name, version, filename, sha256 = (str(data[k]) for k in (
            "name", "version", "filename", "sha256"))
        return cls(name, version, filename, sha256, int(data["size"]))


@dataclass(frozen=True)
class Platform:
    """What decides which wheels a node can install."""

    python: str
    """``3.11`` (major.minor)."""
    machine: str
    """``x86_64`` / ``aarch64``."""
    glibc: str
    """``2.36``; ``""`` when the node's C library is not glibc."""

    def __str__(self) -> str:
        libc = f"glibc {self.glibc}" if self.glibc else "not glibc"
        return f"Python {self.python}, {self.machine}, {libc}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Platform:
        return cls(**{k: str(data[k]) for k in ("python", "machine", "glibc")})


@dataclass(frozen=True)
class ResolvedEnv:
    """A declared file resolved for one platform: the exact wheels to install."""

    source: str
    """The declared file's path, as given."""
    kind: str
    """One of ``KINDS``."""
    platform: Platform
    wheels: tuple[Wheel, ...]
    """Sorted by name; torch & its nvidia-*/triton deps and ptcluster are not here (``held``)."""
    tools: tuple[Wheel, ...]
    """The uv wheel for this platform: it travels with the environment."""
    held: tuple[tuple[str, str], ...] = ()
    """(name, version) of what the file pins of setup's own (``setup_owns``): not shipped,
    checked against the nodes' (``check.check_torch``)."""

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        assert list(self.wheels) == sorted(self.wheels, key=lambda w: w.name), "sorted by name"

    @property
    def digest(self) -> str:
        """sha256 over (platform, sorted (name, version, sha256)): the environment's key."""
        body = {"platform": self.platform.to_json(),
                "wheels": sorted([w.name, w.version, w.sha256] for w in self.wheels)}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def python_path(self) -> str:
        """The interpreter the ranks use on every node (``~`` is the node's home)."""
        return f"{ENVS_DIR}/{self.digest}/bin/python"

    @property
    def size(self) -> int:
        """Bytes of the shipped wheels (not the tools)."""
        return sum(w.size for w in self.wheels)

    def to_json(self) -> dict[str, Any]:
        """The run dir's record of it (``from_json`` reads it back)."""
        return {"source": self.source, "kind": self.kind, "digest": self.digest,
                "platform": self.platform.to_json(),
                "wheels": [w.to_json() for w in self.wheels],
                "tools": [w.to_json() for w in self.tools],
                "held": [list(pin) for pin in self.held]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResolvedEnv:
        env = cls(source=str(data["source"]), kind=str(data["kind"]),
                  platform=Platform.from_json(data["platform"]),
                  wheels=tuple(Wheel.from_json(w) for w in data["wheels"]),
                  tools=tuple(Wheel.from_json(w) for w in data["tools"]),
                  held=tuple((str(n), str(v)) for n, v in data.get("held", [])))
        if "digest" in data and data["digest"] != env.digest:
            raise ValueError(f"digest {data['digest']} does not match its wheels "
                             f"({env.digest})")
        return env

"""STUB of env-A's module (the agreed interface, for env-B's code to compile against until env-A's
``venvs/resolved.py`` is merged over it): a resolved, content-addressed set of wheels."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Wheel:
    name: str
    """Normalized project name (PEP 503)."""
    version: str
    filename: str
    """The wheel's real file name (uv/pip need it to install)."""
    sha256: str
    """Hex digest of the file: its key in every store."""
    size: int

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "version": self.version, "filename": self.filename,
                "sha256": self.sha256, "size": self.size}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Wheel:
        return cls(str(data["name"]), str(data["version"]), str(data["filename"]),
                   str(data["sha256"]), int(str(data["size"])))


@dataclass(frozen=True)
class Platform:
    python: str
    """``3.11`` (major.minor)."""
    machine: str
    """``x86_64`` / ``aarch64``."""
    glibc: str
    """``2.36``; "" when not glibc."""


@dataclass(frozen=True)
class ResolvedEnv:
    source: str
    """The declared file's path, as given."""
    kind: str
    """``uv.lock`` | ``pylock.toml`` | ``requirements`` | ``pyproject``."""
    platform: Platform
    wheels: tuple[Wheel, ...]
    """Sorted by name; torch & its nvidia-*/triton deps and ptcluster are NOT here."""
    tools: tuple[Wheel, ...]
    """The uv wheel for this platform (travels with the environment)."""

    @property
    def digest(self) -> str:
        """sha256 over (platform, sorted (name, version, sha256)): the environment's key."""
        p = self.platform
        body = json.dumps([[p.python, p.machine, p.glibc],
                           sorted([w.name, w.version, w.sha256] for w in self.wheels)])
        return hashlib.sha256(body.encode()).hexdigest()

    def to_json(self) -> dict[str, object]:
        p = self.platform
        return {"source": self.source, "kind": self.kind, "digest": self.digest,
                "platform": {"python": p.python, "machine": p.machine, "glibc": p.glibc},
                "wheels": [w.to_json() for w in self.wheels],
                "tools": [w.to_json() for w in self.tools]}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> ResolvedEnv:
        p = data["platform"]
        assert isinstance(p, dict)
        wheels, tools = data["wheels"], data["tools"]
        assert isinstance(wheels, list) and isinstance(tools, list)
        return cls(str(data["source"]), str(data["kind"]),
                   Platform(str(p["python"]), str(p["machine"]), str(p["glibc"])),
                   tuple(Wheel.from_json(w) for w in wheels),
                   tuple(Wheel.from_json(w) for w in tools))

"""STUB of env-A's module (the agreed interface, for env-B's code to compile against until env-A's
``venvs/store.py`` is merged over it): the head's content-addressed store of wheels."""

from __future__ import annotations

from pathlib import Path

from ptcluster.venvs.resolved import Wheel

DEFAULT_ROOT = Path("~/.cache/ptcluster/wheels").expanduser()


class WheelStore:
    def __init__(self, root: Path = DEFAULT_ROOT) -> None:
        self.root = root

    def path(self, wheel: Wheel) -> Path:
        return self.root / wheel.sha256

    def has(self, sha256: str) -> bool:
        return (self.root / sha256).is_file()

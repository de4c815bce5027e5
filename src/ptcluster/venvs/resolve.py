"""STUB of env-A's module (the agreed entry point, for env-B's code to compile against until
env-A's ``venvs/resolve.py`` is merged over it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ptcluster.errors import UsageError
from ptcluster.venvs.resolved import Platform, ResolvedEnv
from ptcluster.venvs.store import WheelStore


def resolve(spec_file: Path, platform: Platform, *, find_links: Sequence[Path], refresh: bool,
            store: WheelStore, trusted: bool) -> ResolvedEnv:
    raise UsageError(f"cannot resolve {spec_file}: this build has no resolver yet",
                     "merge env-A's venvs/resolve.py")

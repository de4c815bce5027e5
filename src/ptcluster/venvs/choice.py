"""Which declared environment a command uses: ``--requirements`` (relative to the current
directory) wins over the cluster file's ``requirements:`` (relative to the file's folder);
``--find-links`` folders add to ``find_links:``. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ptcluster.cluster.model import ClusterSpec
from ptcluster.errors import UsageError
from ptcluster.venvs.problems import NOTHING_DECLARED


@dataclass(frozen=True)
class EnvChoice:
    requirements: Path
    """The declared file, as given (the flag's relative to the current directory)."""
    find_links: tuple[Path, ...]
    refresh: bool
    """Resolve again even when the file's resolution is cached."""
    trusted: bool
    """The user vouches for the file (``--trust-cluster-file``): it may name another index,
    and a package without a wheel is built from its source on the head."""


def env_choice(spec: ClusterSpec, requirements: str | None, find_links: Sequence[str],
               refresh: bool, trusted: bool) -> EnvChoice | None:
    """The environment of this command, or None (no key, no flag: the ranks run in setup's
    interpreter, as before)."""
    path = Path(requirements) if requirements else \
        Path(spec.requirements) if spec.requirements else None
    folders = (*(Path(f) for f in spec.find_links), *(Path(f) for f in find_links))
    if path is None:
        if find_links or refresh:
            flag = "--find-links" if find_links else "--refresh"
            raise UsageError.of(NOTHING_DECLARED, flag=flag)
        return None
    return EnvChoice(requirements=path, find_links=folders, refresh=refresh, trusted=trusted)

"""The four declared file kinds -> a :class:`Declared` (``pins``): ``uv.lock`` and
``pylock.toml`` are read in ``lockfiles``, a ``requirements*.txt`` and a ``pyproject.toml`` in
``reqfile``. Anything else is refused naming the four kinds."""

from __future__ import annotations

from pathlib import Path

from ptcluster.errors import UsageError
from ptcluster.venvs.lockfiles import read_lock
from ptcluster.venvs.pins import Declared
from ptcluster.venvs.problems import NOT_A_REQUIREMENTS_FILE
from ptcluster.venvs.reqfile import read_pyproject, read_requirements
from ptcluster.venvs.resolved import Platform


def kind_of(path: Path) -> str:
    """The kind of declared file ``path`` names, or an exit-2 error naming the four."""
    name = path.name
    if name == "uv.lock":
        return "uv.lock"
    if name == "pylock.toml" or (name.startswith("pylock.") and name.endswith(".toml")):
        return "pylock.toml"
    if name == "pyproject.toml":
        return "pyproject"
    if name.endswith((".txt", ".in")) and "requirements" in name:
        return "requirements"
    raise UsageError.of(NOT_A_REQUIREMENTS_FILE, path=path)


def read_declared(path: Path, platform: Platform | None) -> Declared:
    """The declared file at ``path``, of any of the four kinds (a lock's packages as they
    apply to ``platform``; None: the file's own checks only, its Python range not checked, as
    before the nodes' platforms are known)."""
    kind = kind_of(path)
    if kind == "requirements":
        return read_requirements(path)
    if kind == "pyproject":
        return read_pyproject(path, platform)
    return read_lock(path, kind, platform)

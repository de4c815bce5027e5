"""A node platform in the words each tool takes: wheel tags (which file of a release fits),
PEP 508 marker values (which packages a lock gives it), uv's ``--python-platform`` and pip's
``--platform`` values. Pure."""

from __future__ import annotations

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from ptcluster.errors import UsageError
from ptcluster.venvs.problems import PYTHON_EXCLUDED
from ptcluster.venvs.resolved import Platform

MACHINES = ("x86_64", "aarch64")
OLDEST_GLIBC = 17
"""manylinux2014 (glibc 2.17): the oldest wheels a node is offered."""
UV_GLIBCS = (17, 28, *range(31, 41))
"""The manylinux versions uv 0.13's ``--python-platform`` names (``x86_64-manylinux_2_36``)."""


def _check(platform: Platform) -> None:
    if platform.machine not in MACHINES:
        raise UsageError(f"a node's machine is {platform.machine}: ptcluster ships "
                         f"environments to {', '.join(MACHINES)} nodes only",
                         "leave `requirements` out for this cluster and install by hand")


def _glibc_minor(platform: Platform) -> int:
    major, _, minor = platform.glibc.partition(".")
    if major != "2" or not minor.isdigit():
        raise UsageError(f"the node platform's glibc {platform.glibc!r} is not 2.N",
                         "check the node (ldd --version)")
    return int(minor)


def linux_platforms(platform: Platform) -> list[str]:
    """The platform tags a node takes, best first: manylinux_2_N down to 2_17 (and the old
    aliases), then ``linux_<machine>`` (a wheel built on a head of the same kind); musl nodes
    take musllinux_1_2 and older."""
    _check(platform)
    m = platform.machine
    if not platform.glibc:
        return [f"musllinux_1_{n}_{m}" for n in (2, 1)] + [f"linux_{m}"]
    top = _glibc_minor(platform)
    tags = [f"manylinux_2_{n}_{m}" for n in range(top, OLDEST_GLIBC - 1, -1)]
    tags.append(f"manylinux2014_{m}")
    if m == "x86_64":
        tags += [f"manylinux2010_{m}", f"manylinux1_{m}"]
    return [*tags, f"linux_{m}"]


def python_tuple(platform: Platform) -> tuple[int, int]:
    major, _, minor = platform.python.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise UsageError(f"the node platform's Python {platform.python!r} is not X.Y",
                         "check the node's interpreter")
    return int(major), int(minor)


def tags_for(platform: Platform) -> list[Tag]:
    """Every wheel tag a CPython node of ``platform`` installs, best first."""
    plats = linux_platforms(platform)
    version = python_tuple(platform)
    return [*cpython_tags(version, platforms=plats), *compatible_tags(version, platforms=plats)]


def best_file(filenames: list[str], platform: Platform) -> str | None:
    """The wheel of ``filenames`` a node of ``platform`` prefers (None: none fits)."""
    rank = {tag: i for i, tag in enumerate(tags_for(platform))}
    best: tuple[int, str] | None = None
    for name in filenames:
        try:
            tags = parse_wheel_filename(name)[3]
        except InvalidWheelFilename:
            continue
        score = min((rank[t] for t in tags if t in rank), default=None)
        if score is not None and (best is None or score < best[0]):
            best = (score, name)
    return best[1] if best else None


def uv_platform(platform: Platform) -> str:
    """uv's ``--python-platform`` for ``platform`` (the newest manylinux it knows that the
    node's glibc runs)."""
    _check(platform)
    if not platform.glibc:
        return f"{platform.machine}-unknown-linux-musl"
    top = _glibc_minor(platform)
    fits = [n for n in UV_GLIBCS if n <= top]
    if not fits:
        raise UsageError(f"the node's glibc {platform.glibc} is older than 2.{OLDEST_GLIBC}, "
                         "the oldest that wheels are built for", "upgrade the node's system")
    return f"{platform.machine}-manylinux_2_{fits[-1]}"


def pip_platform_args(platform: Platform) -> list[str]:
    """pip's ``--platform`` options for ``platform`` (pip does not expand ``manylinux_2_N``
    to older ones itself), with ``--python-version``, ``--implementation`` and ``--abi``."""
    major, minor = python_tuple(platform)
    args = []
    for tag in linux_platforms(platform):
        args += ["--platform", tag]
    return [*args, "--python-version", f"{major}.{minor}", "--implementation", "cp",
            "--abi", f"cp{major}{minor}", "--abi", "abi3", "--abi", "none"]


def marker_env(platform: Platform) -> dict[str, str]:
    """PEP 508 marker values of a CPython node of ``platform`` (the patch version is not known
    on the head: ``.0``)."""
    return {"python_version": platform.python, "python_full_version": f"{platform.python}.0",
            "implementation_name": "cpython", "implementation_version": f"{platform.python}.0",
            "platform_python_implementation": "CPython", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux",
            "platform_machine": platform.machine, "platform_release": "",
            "platform_version": "", "extra": ""}


def head_platform() -> Platform:
    """This machine's platform: what ``ptcluster env`` computes the environment for (it asks
    no node; ``run`` and ``doctor`` use each node's own)."""
    import platform as host
    import sys
    libc, version = host.libc_ver()
    return Platform(python=f"{sys.version_info[0]}.{sys.version_info[1]}",
                    machine=host.machine(), glibc=version if libc == "glibc" else "")


def check_python(requires: str, platform: Platform | None, source: str) -> None:
    """Refuse a file whose ``requires-python`` excludes the nodes' Python (any patch
    release of it will do; None: not known yet, not checked)."""
    if not requires or platform is None:
        return
    try:
        allowed = SpecifierSet(requires)
    except InvalidSpecifier:
        raise UsageError(f"{source}: requires-python {requires!r} is not a version range",
                         "fix it, e.g. >=3.10") from None
    if not any(allowed.contains(f"{platform.python}.{patch}") for patch in (0, 99)):
        raise UsageError.of(PYTHON_EXCLUDED, source=source, requires=requires,
                            python=platform.python)

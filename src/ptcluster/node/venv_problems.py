"""What a node says of its project environment, declared (``venvs.*`` codes, ``node.problems``):
how it differs from its build (the full check's findings: ``venv_store.full_check``,
``doctor``'s ``environment`` check) and why it could not be built (``venv_agent``'s ``build``
answer). Each is sent as ``Declared.sent`` (code, what, fix, fields) and said on the head by
``errors.Problem.received``. The head's own refusals of an environment are ``venvs.problems``'s.
Standard library only: a part of ``node.venv_agent``."""

from ptcluster.node.problems import Declared

REBUILD = "run `ptcluster run` (it rebuilds the node's environment), or remove {env} by hand"
"""Every difference's fix: the environment at ``env`` is rebuilt, never patched."""

NEVER_BUILT = Declared(
    "venvs.never-built", "the environment was never built on the node",
    "the environment was never built here", "run `ptcluster run` (it builds it there)")
NO_MANIFEST = Declared(
    "venvs.no-manifest", "the environment's manifest is missing or unreadable",
    "{env} has no readable ptcluster-env.json (not a complete build)", REBUILD)
PACKAGE_MISSING = Declared(
    "venvs.package-missing", "a package of the lock is not installed",
    "package {name} {version} is missing (the lock has {version}, the node none)", REBUILD)
PACKAGE_DIFFERS = Declared(
    "venvs.package-differs", "a package's installed version is not the lock's",
    "package {name} differs: {have} here, {version} in the lock", REBUILD)
PACKAGE_EXTRA = Declared(
    "venvs.package-extra", "a package is installed that the lock does not have",
    "package {name} {version} is extra (not in the lock)", REBUILD)
FILE_MISSING = Declared(
    "venvs.file-missing", "a file of the build is gone",
    "{path} of {owner} is missing", REBUILD)
LINK_CHANGED = Declared(
    "venvs.link-changed", "a link of the build points elsewhere",
    "{path} of {owner} is a link to {target}, {was} at the build", REBUILD)
FILE_CHANGED = Declared(
    "venvs.file-changed", "a file of the build changed",
    "{path} of {owner} changed since the build (sha256 {was} then, {now} now)", REBUILD)
FILE_ADDED = Declared(
    "venvs.file-added", "a file was added to the environment after its build",
    "{path} ({owner}) was added since the build", REBUILD)
DIFFERENCES = (NEVER_BUILT, NO_MANIFEST, PACKAGE_MISSING, PACKAGE_DIFFERS, PACKAGE_EXTRA,
               FILE_MISSING, LINK_CHANGED, FILE_CHANGED, FILE_ADDED)
"""What the full check finds (``doctor``'s ``environment`` row)."""

AGAIN = "run again"
WHEEL_NOT_STORED = Declared(
    "venvs.wheel-not-stored", "a wheel to build with is not in the node's store",
    "wheel {filename} is not in this node's store", AGAIN)
CHANGED_IN_USE = Declared(
    "venvs.changed-in-use", "the environment changed, and a job runs in it",
    "its environment changed since the build ({why}) and {users} runs in it",
    "end that job (or wait for it; a warm pool of yours: `ptcluster warm stop`), then run "
    "again: the environment is rebuilt then")
BUILD_STOPPED = Declared(
    "venvs.build-stopped", "the build was stopped (the head ended it)", "stopped", AGAIN)
BUILD_UNWRITABLE = Declared(
    "venvs.build-unwritable", "the environment's folder could not be written",
    "building {path}: {error}", "check that file system")
DISK_FULL = Declared(
    "venvs.disk-full", "the disk is full where the environment is built",
    "the disk is full at {path} ({free} bytes free): {error}",
    "free space on that file system (`ptcluster venvs --prune` removes unused environments), "
    "then run again")
INSTALL_FAILED = Declared(
    "venvs.install-failed", "uv or pip failed to make the environment",
    "{tool} {step} failed: {last}",
    "run `ptcluster doctor` on this node; the wheels may not suit its platform")
NOT_BUILT = (WHEEL_NOT_STORED, CHANGED_IN_USE, BUILD_STOPPED, BUILD_UNWRITABLE, DISK_FULL,
             INSTALL_FAILED)
"""Why a node could not build the environment (its ``build`` answer: ``run``, ``env``)."""
TABLE = DIFFERENCES + NOT_BUILT

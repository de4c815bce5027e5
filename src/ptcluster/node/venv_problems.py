"""How a node's project environment differs from its build, declared (``venvs.*`` codes,
``node.problems``): the full check's findings (``venv_store.full_check``, ``doctor``'s
``environment`` check), each sent as ``Declared.sent`` (code, what, fix, fields) and said on
the head by ``errors.Problem.received``. The head's own refusals of an environment are
``venvs.problems``'s. Standard library only: a part of ``node.venv_agent``."""

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
TABLE = (NEVER_BUILT, NO_MANIFEST, PACKAGE_MISSING, PACKAGE_DIFFERS, PACKAGE_EXTRA, FILE_MISSING,
         LINK_CHANGED, FILE_CHANGED, FILE_ADDED)

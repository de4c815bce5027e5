"""What can go wrong with a project's environment, declared (``venvs.*`` codes,
``node.problems``): a requirements file ptcluster cannot use, or nodes it cannot serve.

Raised by entry (``UsageError.of(TORCH_DIFFERS, ...)``, ``Problem.of(PYTHON_DIFFERS, host,
...)``): tests and ``summary.json`` read the code and its fields, the docs' page the table."""

from __future__ import annotations

from ptcluster.cluster.trust import TRUST_IT
from ptcluster.node.problems import Declared

FOUR_KINDS = "a uv.lock, a pylock.toml (PEP 751), a requirements*.txt or a pyproject.toml"
"""The files an environment is read from."""

NOT_A_REQUIREMENTS_FILE = Declared(
    "venvs.not-a-requirements-file", "not a file an environment is read from",
    "{path}: not a file ptcluster reads an environment from", f"give {FOUR_KINDS}")
TORCH_DIFFERS = Declared(
    "venvs.torch-differs", "the file pins another torch than the nodes have",
    "the requirements pin torch {version}, but the nodes have torch {node_torch} (setup's, "
    "which the environment uses)",
    "install torch {version} on this machine and run `ptcluster setup` (it gives the nodes the "
    "head's torch version); or pin torch=={node_release}")
PTCLUSTER_DIFFERS = Declared(
    "venvs.ptcluster-differs", "the file pins another ptcluster than the nodes have",
    "the requirements pin ptcluster {version}, but the nodes have ptcluster {node_ptcluster} "
    "(setup's)",
    "run `ptcluster setup` from a head with ptcluster {version}; or pin "
    "ptcluster=={node_release}")
PYTHON_EXCLUDED = Declared(
    "venvs.python-excluded", "the file's requires-python leaves out the nodes' Python",
    "{source}: allows Python {requires}, but the nodes have Python {python}",
    "lock for the nodes' Python (requires-python that includes {python}), or give the nodes "
    "that Python with `ptcluster setup`")
PYTHON_DIFFERS = Declared(
    "venvs.python-differs", "a node's Python is not the environment's",
    "its Python is {have}, the environment ({source}) is resolved for Python {want}",
    "set python: to a Python {want} on this node, or resolve for its version")
MACHINE_DIFFERS = Declared(
    "venvs.machine-differs", "a node's machine is not the environment's",
    "its machine is {have}, the environment is resolved for {want}",
    "resolve for every node's platform")
NOTHING_DECLARED = Declared(
    "venvs.nothing-declared", "an environment's option without an environment",
    "{flag} applies to a declared environment, and there is none",
    "give --requirements FILE, or set `requirements:` in the cluster file")
NO_WHEEL = ("{source}: {name} {version} has no wheel for the nodes' platform ({platform})"
            "{links}")
"""What every refusal to build a package says first (``links``: `` in`` the --find-links
folders, or nothing)."""
BUILD_UNTRUSTED = Declared(
    "venvs.build-untrusted", "no wheel, and building one would run a file's code",
    NO_WHEEL + "; building it from its source runs its code on this machine",
    f"{TRUST_IT}, and have a compiler here; or give a folder with its wheel with --find-links")
BUILD_ELSEWHERE = Declared(
    "venvs.build-elsewhere", "no wheel, and this machine cannot build one for the nodes",
    NO_WHEEL + "; this machine (Python {here}, {machine}) cannot build one for the nodes",
    "build the wheel on a node and give its folder with --find-links")
BUILD_NO_COMPILER = Declared(
    "venvs.build-no-compiler", "no wheel, and no C compiler to build one",
    NO_WHEEL + ", and there is no C compiler here to build it",
    "install one (apt-get install build-essential), or give a folder with its wheel with "
    "--find-links")
BUILD_FAILED = Declared(
    "venvs.build-failed", "no wheel, and pip could not build one",
    NO_WHEEL + ", and pip could not build it here: {tail}",
    "give a folder with its wheel with --find-links")
INDEX_UNTRUSTED = Declared(
    "venvs.index-untrusted", "a requirements file names another index, and is not trusted",
    "{source}: fetches from {elsewhere}: a requirements file may name another index only "
    "when you trust it",
    f"{TRUST_IT}; else remove the line and give the wheels' folder with --find-links")
REQUIREMENTS_MISSING = Declared(
    "venvs.requirements-missing", "the requirements file is not there",
    "{path}: the requirements file is not there",
    "check the path (`requirements:` is relative to the cluster file's folder, --requirements "
    "to the current directory)")
NOT_A_FOLDER = Declared(
    "venvs.not-a-folder", "--find-links names no folder", "--find-links {folder}: not a folder",
    "give a folder of wheels")
NOT_READY = Declared(
    "venvs.not-ready", "some node could not get the project's environment",
    "no rank started: the project's environment is not ready on {hosts}: {said}",
    "fix what each node says, then run again (the other nodes keep what they built)")
TABLE = (REQUIREMENTS_MISSING, NOT_A_FOLDER, NOT_A_REQUIREMENTS_FILE, TORCH_DIFFERS,
         PTCLUSTER_DIFFERS, PYTHON_EXCLUDED, PYTHON_DIFFERS, MACHINE_DIFFERS, NOTHING_DECLARED,
         BUILD_UNTRUSTED, BUILD_ELSEWHERE, BUILD_NO_COMPILER, BUILD_FAILED, INDEX_UNTRUSTED,
         NOT_READY)

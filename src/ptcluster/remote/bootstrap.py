"""How node programs (the guard, the doctor's probe, the monitor's sampler) reach a node: a
fixed one-line command, then everything else over stdin.

The only text that passes through the node's shell is ``PYTHON -c BOOTSTRAP`` (quoted with
shlex); the guard's source and its JSON config (argv, env, paths) travel on the channel's
stdin, so no host, path or env value is ever re-parsed by a shell.
"""

from __future__ import annotations

import base64
import json
import zlib
from functools import lru_cache
from importlib import resources
from typing import Any

BOOTSTRAP = (
    "import sys,zlib,base64;"
    "exec(compile(zlib.decompress(base64.b64decode(sys.stdin.buffer.readline())),"
    "'ptcluster-guard','exec'))"
)


@lru_cache(maxsize=8)
def payload(package: str, filename: str) -> bytes:
    """Line 1 of a node program's stdin: its own source, compressed."""
    source = resources.files(package).joinpath(filename).read_bytes()
    return base64.b64encode(zlib.compress(source, 9)) + b"\n"


def node_argv(python: str) -> list[str]:
    """The command run on the node (locally, or as ssh's remote command)."""
    return [python, "-u", "-c", BOOTSTRAP]


def preamble(package: str, filename: str, config: dict[str, Any]) -> bytes:
    """What a node program reads first: its source, then its JSON config."""
    return payload(package, filename) + json.dumps(config).encode() + b"\n"


def guard_preamble(config: dict[str, Any]) -> bytes:
    return preamble("ptcluster.remote", "guard.py", config)


def probe_preamble(config: dict[str, Any]) -> bytes:
    return preamble("ptcluster.doctor", "probe.py", config)

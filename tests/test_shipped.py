"""Programs shipped to nodes and ranks run where ptcluster is not installed: they may import
only the standard library (node programs also the inlined modules; rank programs also torch).
A cheap AST check, plus: every packed node program compiles and says hello in the wire format."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib import resources

import pytest

from ptcluster.doctor.collect import PROBE
from ptcluster.monitor.watch import SAMPLER
from ptcluster.node import wire
from ptcluster.remote.bootstrap import GUARD, INLINED, pack_source, preamble

INLINED_MODULES = {f"{pkg}.{name[:-3]}" for pkg, name in INLINED} | {
    f"{prog.package}.{part[:-3]}" for prog in (GUARD, PROBE) for part in prog.parts}
NODE_PROGRAMS = [("ptcluster.node", "guard.py"), ("ptcluster.node", "facts.py"),
                 ("ptcluster.node", "sampler.py"), ("ptcluster.node", "wire.py"),
                 ("ptcluster.node", "netif.py"), ("ptcluster.node.rank", "shim.py"),
                 ("ptcluster.node", "proctree.py"), ("ptcluster.node", "rank_server.py"),
                 ("ptcluster.node", "accel.py")]
RANK_PROGRAMS = [("ptcluster.node.rank", "api.py"), ("ptcluster.node.rank", "allreduce.py"),
                 ("ptcluster.node.rank", "bench_worker.py")]
OPTIONAL = {"psutil", "pynvml"}  # imported inside try/except by the sampler


def imports(package: str, filename: str) -> set[str]:
    tree = ast.parse(resources.files(package).joinpath(filename).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def allowed(name: str, extra: set[str]) -> bool:
    top = name.split(".")[0]
    return top in sys.stdlib_module_names or name in extra or top in extra


@pytest.mark.parametrize("package, filename", NODE_PROGRAMS)
def test_node_programs_import_only_stdlib_and_inlined(package: str, filename: str) -> None:
    bad = {m for m in imports(package, filename)
           if not allowed(m, INLINED_MODULES | OPTIONAL | {"__future__"})}
    assert not bad, f"{filename} imports {bad}: nodes do not have them"


@pytest.mark.parametrize("package, filename", RANK_PROGRAMS)
def test_rank_programs_import_only_stdlib_and_torch(package: str, filename: str) -> None:
    bad = {m for m in imports(package, filename) if not allowed(m, {"torch", "__future__"})}
    assert not bad, f"{filename} imports {bad}: ranks have only torch"


@pytest.mark.parametrize("program", [GUARD, PROBE, SAMPLER])
def test_packed_program_compiles_and_says_hello(program, tmp_path) -> None:
    source = pack_source(program)
    compile(source, program.name, "exec")
    assert "from ptcluster" not in source  # the package imports were dropped
    if program is PROBE:
        return  # it collects facts before anything else; its frames are tested on the testbed
    config = {"interval": 0.2} if program is SAMPLER else {
        "job_id": "J", "argv": ["true"], "env": {}, "workdir": "/nonexistent-dir",
        "target": {}, "heartbeat_timeout": 15, "grace": 1}
    proc = subprocess.run([sys.executable, "-u", "-c", _BOOT, program.name, "-"],
                          input=preamble(program, config), capture_output=True, timeout=60)
    first = proc.stdout.decode().splitlines()[0]
    kind, payload = wire.split(first)
    assert kind == "hello" and wire.control(payload)["v"] == wire.VERSION
    if program is GUARD:  # a missing workdir is refused before anything starts
        kind, payload = wire.split(proc.stdout.decode().splitlines()[1])
        assert kind == "error" and "does not exist" in wire.control(payload)["problem"]


_BOOT = __import__("ptcluster.remote.bootstrap", fromlist=["BOOTSTRAP"]).BOOTSTRAP

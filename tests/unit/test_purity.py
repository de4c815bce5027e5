"""The job's decision core (``ptcluster.launch.supervise``) is pure: events and a clock in,
actions out. None of its modules does I/O, starts a thread or a process, opens a socket or reads
the wall clock, directly or through what it takes from ptcluster (as ``test_shipped`` checks what
node code may import). The rule, read from the source with ``ast``:

* from the standard library a core module may import only ``PURE_STDLIB`` (data structures,
  typing, text and number helpers); of ``signal`` only its constants (``signal.SIGKILL``: an
  action carries a signal number, the runner sends it);
* from ptcluster outside the core, only the modules of ``BOUNDARY`` (the plan and result data
  types, the runner's options, the two wire protocols), and of them only names whose code
  reaches nothing but ``PURE_STDLIB``: the check follows every name a core module uses into its
  definition (a class with its methods and the types its annotations name, a function, a
  constant), from module to module, down to the standard library;
* a method of such a type that is not pure is listed in ``IMPURE_METHODS`` with the reason,
  and no core module calls a method of that name.

The package ``__init__`` modules above the core (``ptcluster``, ``ptcluster.launch``) are not
the core's imports: they run once at import and are their packages' business.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import ptcluster

CORE = "ptcluster.launch.supervise"
PURE_STDLIB = frozenset({
    "__future__", "abc", "bisect", "collections", "dataclasses", "enum", "functools", "heapq",
    "ipaddress", "itertools", "json", "math", "operator", "re", "shlex", "signal", "statistics",
    "string",
    "textwrap", "types", "typing",
})
"""Standard-library modules (and their submodules) that compute only: no files, sockets,
processes, threads or clocks. ``os``, ``io``, ``pathlib``, ``socket``, ``selectors``,
``subprocess``, ``threading``, ``queue``, ``time``, ``logging``, ``secrets``... are not."""
SIGNAL_CONSTANT = re.compile(r"SIG[A-Z0-9_]+|Signals")
"""What may be taken of ``signal``: names and numbers of signals, never a handler or a kill."""
BOUNDARY = frozenset({
    "ptcluster.launch.plan",     # LaunchPlan (what the job is), AUTO_PORT
    "ptcluster.launch.options",  # RunOptions (the runner's knobs), where they move to
    "ptcluster.launch.result",   # RankRecord, NodeOutcome, Failure...: what the core fills in
    "ptcluster.node.wire",       # the head<->guard frames: Kind, VERSION, ReadyFacts, decoding
    "ptcluster.node.rank_wire",  # the rank<->guard records: the progress report kinds
    "ptcluster.remote.guard_replies",  # the schemas of the guard's frames' tables
    "ptcluster.errors",          # Problem: how a failure or a refusal is said
    "ptcluster.node.problems",   # CODE: what a declared problem's code looks like
})
"""The ptcluster modules outside the core that a core module may import from."""
IMPURE_METHODS = {
    ("ptcluster.launch.plan", "NodePlan", "guard_config"):
        "puts the head's hostname (socket.gethostname) in a guard's config: the runner's call",
}
"""(module, class, method) of types the core holds whose method is not pure, and why."""

ROOT = Path(ptcluster.__file__).parent
Ref = tuple[str, str, "str | None"]
"""What code reads: (kind, module, name): kind "stdlib", "ptcluster" or "other"; name None for
the module itself."""


def source(module: str) -> Path | None:
    """The file of a ptcluster module (None: no such module)."""
    rel = Path(*module.split(".")[1:])
    for path in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if module.startswith("ptcluster") and path.is_file():
            return path
    return None


def core_modules() -> list[str]:
    return [CORE, *sorted(f"{CORE}.{p.stem}" for p in (ROOT / "launch" / "supervise").glob("*.py")
                          if p.stem != "__init__")]


@functools.cache
def tree(module: str) -> ast.Module:
    path = source(module)
    assert path is not None, f"no module {module}"
    return ast.parse(path.read_text())


def kind(module: str) -> str:
    top = module.split(".")[0]
    return "ptcluster" if top == "ptcluster" else "stdlib" if top in sys.stdlib_module_names \
        else "other"


def imported(node: ast.Import | ast.ImportFrom) -> Iterator[Ref]:
    """What an import statement brings in."""
    if isinstance(node, ast.Import):
        yield from ((kind(a.name), a.name, None) for a in node.names)
        return
    assert node.level == 0, "relative import: write it absolute"
    base = node.module or ""
    for a in node.names:
        whole = f"{base}.{a.name}"
        if kind(base) == "ptcluster" and source(whole) is not None:
            yield "ptcluster", whole, None  # `from ptcluster.node import wire`
        else:
            yield kind(base), base, a.name


@functools.cache
def bindings(module: str) -> dict[str, Ref]:
    """Each top-level name of ``module``: where it comes from (``("ptcluster", module, name)``
    for the names it defines itself)."""
    found: dict[str, Ref] = {}
    for node in ast.walk(tree(module)):  # (imports under `if TYPE_CHECKING:` count too)
        if isinstance(node, ast.Import):
            for a, ref in zip(node.names, imported(node), strict=True):
                found[a.asname or a.name.split(".")[0]] = \
                    ref if a.asname else (ref[0], a.name.split(".")[0], None)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for a, ref in zip(node.names, imported(node), strict=True):
                found[a.asname or a.name] = ref
    for node in tree(module).body:
        targets: list[ast.expr] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = ("ptcluster", module, node.name)
        elif isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for name in (n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
            found[name.id] = ("ptcluster", module, name.id)
    return found


class _Reads(ast.NodeVisitor):
    """Every module-level name that code reads, as a :data:`Ref` (``mod.attr`` of an imported
    module: that attribute)."""

    def __init__(self, module: str) -> None:
        self.names = bindings(module)
        self.found: list[Ref] = []

    def visit_Import(self, node: ast.Import) -> None:
        """(What it binds counts where it is read: ``bindings`` has every import, also those
        inside a function; ``direct`` checks the core's import statements themselves.)"""

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        pass

    def visit_Attribute(self, node: ast.Attribute) -> None:
        ref = self.names.get(node.value.id) if isinstance(node.value, ast.Name) else None
        if ref is not None and ref[2] is None:  # an attribute of an imported module
            self.found.append((ref[0], ref[1], node.attr))
        else:
            self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        ref = self.names.get(node.id)  # (None: a builtin or a local name)
        if ref is not None and isinstance(node.ctx, ast.Load):  # (not a field's name)
            self.found.append(ref)


def reads(module: str, nodes: list[ast.AST]) -> list[Ref]:
    visitor = _Reads(module)
    for node in nodes:
        visitor.visit(node)
    return visitor.found


def definition(module: str, name: str) -> list[ast.AST] | None:
    """The statements that define ``name`` in ``module`` (a class without its listed impure
    methods); None when it is not defined there."""
    for node in tree(module).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            skip = {m for (mod, cls, m) in IMPURE_METHODS if (mod, cls) == (module, name)}
            return [*(n for n in node.body if getattr(n, "name", None) not in skip),
                    *node.decorator_list, *node.bases]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return [node]
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in {
                n.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for n in ast.walk(t) if isinstance(n, ast.Name)}:
            return [node]
    return None


def impure(ref: Ref) -> str | None:
    """Why ``ref`` (a standard-library or third-party name) is not pure, or None."""
    kind_, module, name = ref
    if kind_ == "other":
        return "not the standard library"
    if module.split(".")[0] not in PURE_STDLIB:
        return "does I/O, threads, processes or the clock"
    if module == "signal" and not (name and SIGNAL_CONSTANT.fullmatch(name)):
        return "more of signal than its constants"
    return None


def reach(start: str, refs: list[Ref]) -> list[str]:
    """Every impure thing ``refs`` (read by ``start``) lead to, each with its path."""
    problems: list[str] = []
    seen: set[tuple[str, str | None]] = set()
    todo = [(ref, start) for ref in refs]
    while todo:
        (kind_, module, name), path = todo.pop()
        where = f"{module}.{name}" if name else module
        if kind_ != "ptcluster":
            why = impure((kind_, module, name))
            if why is not None:
                problems.append(f"{path} -> {where}: {why}")
            continue
        if module == CORE or module.startswith(CORE + ".") or (module, name) in seen:
            continue  # (the core's modules are checked whole)
        seen.add((module, name))
        if name is None:
            problems.append(f"{path} -> {where}: a whole module (take names from it)")
        elif (body := definition(module, name)) is not None:
            todo += [(ref, f"{path} -> {where}") for ref in reads(module, body)]
        elif (ref := bindings(module).get(name)) is not None and ref[1:] != (module, name):
            todo.append((ref, path))  # a name it imports: follow it to its definition
        else:
            problems.append(f"{path} -> {where}: not found")
    return sorted(set(problems))


def direct(module: str, module_tree: ast.Module) -> list[str]:
    """What a core module imports that it may not (by the module it comes from)."""
    problems = []
    for node in ast.walk(module_tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or \
                (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            continue
        for kind_, mod, name in imported(node):
            where = f"{mod}.{name}" if name else mod
            if kind_ == "ptcluster" and not (mod == CORE or mod.startswith(CORE + ".")
                                             or mod in BOUNDARY):
                problems.append(f"{module} imports {where}: not in BOUNDARY")
            elif kind_ != "ptcluster" and name is None and mod == "signal":
                continue  # (what it takes of signal: checked where it is used)
            elif kind_ != "ptcluster" and (why := impure((kind_, mod, name))) is not None:
                problems.append(f"{module} imports {where}: {why}")
    return problems


@pytest.mark.parametrize("module", core_modules())
def test_a_core_module_imports_only_pure_modules(module: str) -> None:
    assert direct(module, tree(module)) == []


@pytest.mark.parametrize("module", core_modules())
def test_what_a_core_module_uses_reaches_no_io(module: str) -> None:
    assert reach(module, reads(module, list(tree(module).body))) == []


@pytest.mark.parametrize("module", core_modules())
def test_no_core_module_calls_a_listed_impure_method(module: str) -> None:
    methods = {m for (_, _, m) in IMPURE_METHODS}
    called = {n.attr for n in ast.walk(tree(module)) if isinstance(n, ast.Attribute)}
    assert not methods & called


def test_the_listed_impure_methods_exist_and_are_impure() -> None:
    """An entry of ``IMPURE_METHODS`` that became pure (or went away) is taken off the list."""
    for (module, cls, method), _why in IMPURE_METHODS.items():
        (body,) = [n for c in tree(module).body if isinstance(c, ast.ClassDef) and c.name == cls
                   for n in c.body if getattr(n, "name", None) == method]
        assert reach(f"{module}.{cls}", reads(module, [body])) != [], method


def test_the_check_finds_what_is_not_pure() -> None:
    """The rule itself, on code that breaks it: a direct import, and impurity found through a
    ptcluster name (a function, a constant's module, a whole module)."""
    bad = ast.parse("import os\nimport signal\nfrom time import monotonic\n"
                    "from ptcluster.remote import channel\nfrom ptcluster.node.wire import Kind\n"
                    "from collections.abc import Mapping\n")
    assert direct("x", bad) == [
        "x imports os: does I/O, threads, processes or the clock",
        "x imports time.monotonic: does I/O, threads, processes or the clock",
        "x imports ptcluster.remote.channel: not in BOUNDARY"]
    assert impure(("stdlib", "signal", "SIGKILL")) is None
    assert impure(("stdlib", "signal", "signal")) == "more of signal than its constants"
    assert impure(("other", "torch", None)) == "not the standard library"
    found = reach("x", [("ptcluster", "ptcluster.launch.plan", "new_job_id"),
                        ("ptcluster", "ptcluster.node.rank_wire", "connect"),
                        ("ptcluster", "ptcluster.node.wire", "hello"),
                        ("ptcluster", "ptcluster.node.wire", "split")])
    assert found == [
        "x -> ptcluster.launch.plan.new_job_id -> secrets.token_hex: does I/O, threads, "
        "processes or the clock",
        "x -> ptcluster.launch.plan.new_job_id -> time.strftime: does I/O, threads, processes "
        "or the clock",
        "x -> ptcluster.node.rank_wire.connect -> socket.AF_UNIX: does I/O, threads, processes "
        "or the clock",
        "x -> ptcluster.node.rank_wire.connect -> socket.SOCK_STREAM: does I/O, threads, "
        "processes or the clock",
        "x -> ptcluster.node.rank_wire.connect -> socket.socket: does I/O, threads, processes "
        "or the clock",
        "x -> ptcluster.node.wire.hello -> os.getpid: does I/O, threads, processes or the clock",
        "x -> ptcluster.node.wire.hello -> time.time: does I/O, threads, processes or the clock"]

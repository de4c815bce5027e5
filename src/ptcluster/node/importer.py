"""The import hook every shipped program starts with: its modules come from a dict, not a disk.

Nothing of ptcluster is installed where node code runs. The head (``remote.bootstrap``) sends a
program as this module's source, then ``{module: source}`` (the program's import closure) and
one call:

* ``run`` for a node program (the guard, the sampler, setup's agent, ...): the hook stays for
  the process's life and the program runs as ``__main__``, as ``python -m`` runs a module;
* ``load`` for a program that runs inside a user's process (the shim and its stack probe) or
  beside torch (torchrun's agent, the rank programs): its modules are imported, then the hook
  and every module it made are taken away again, before any of the user's code runs, so that
  code imports an installed ``ptcluster`` (or none) as it would without us.

Each module is compiled under its path in the package (``ptcluster/node/guard/agent.py``), and
``run`` gives its source to ``linecache``: a node's traceback shows the file, the line number and
the line. ``run`` prints tracebacks with ``traceback`` (the interpreter's own printer reads no
``linecache``). Standard library only, and Python 3.8's: this is the first code a node runs.
"""

from __future__ import annotations

import sys
from importlib.machinery import ModuleSpec
from types import CodeType, ModuleType

TYPE_CHECKING = False
if TYPE_CHECKING:  # (typing costs a bare interpreter 11 ms, importlib.abc 27: not in a rank)
    from typing import Any


class Shipped:
    """A meta path finder and its loader in one (as ``importlib``'s frozen importer): the
    modules of ``sources`` and the packages above them (empty: a package's ``__init__`` is the
    head's, never shipped); ``files``: what came with them (``{file name: text}``: the
    programs the guard hands on)."""

    def __init__(self, sources: dict[str, str], files: dict[str, str] | None = None,
                 lines: bool = True) -> None:
        self.sources = sources
        self.files = dict(files or {})
        self.lines = lines  # each module's source into ``linecache`` (not in a rank: ``load``)
        self.packages = {name.rsplit(".", i)[0] for name in sources
                         for i in range(1, name.count(".") + 1)}
        self.made: list[str] = []

    SHIPPED = True
    """Code that looks a module up as a fresh interpreter (a rank) would passes this finder by
    (``guard.prechecks.module_present``): a rank has an installed ``ptcluster``, or none."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname not in self.sources and fullname not in self.packages:
            return None
        spec = ModuleSpec(fullname, self,  # type: ignore[arg-type]  # a Loader by its methods
                          origin=self.filename(fullname), is_package=fullname in self.packages)
        spec.has_location = True
        return spec

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        self.made.append(module.__name__)
        exec(self.get_code(module.__name__), module.__dict__)

    def get_code(self, fullname: str) -> CodeType:
        filename, source = self.filename(fullname), self.get_source(fullname)
        if self.lines:
            import linecache

            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        return compile(source, filename, "exec", dont_inherit=True)

    def get_source(self, fullname: str) -> str:
        return self.sources.get(fullname, "")

    def is_package(self, fullname: str) -> bool:
        return fullname in self.packages

    def filename(self, fullname: str) -> str:
        path = fullname.replace(".", "/")
        return path + "/__init__.py" if fullname in self.packages else path + ".py"

    def remove(self) -> None:
        """Off ``sys.meta_path``, and every module it made out of ``sys.modules`` (and off its
        parent package, where that was not ours)."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for name in reversed(self.made):
            module = sys.modules.pop(name, None)
            parent, _, child = name.rpartition(".")
            if parent in sys.modules and getattr(sys.modules[parent], child, None) is module:
                delattr(sys.modules[parent], child)
        self.made.clear()


def run(sources: dict[str, str], main: str, files: dict[str, str] | None = None) -> None:
    """Run the node program ``main`` as ``__main__`` with ``sources`` importable (for good)."""
    import runpy
    import threading

    sys.meta_path.insert(0, Shipped(sources, files))
    sys.excepthook = _print_exception
    threading.excepthook = _print_thread_exception
    runpy.run_module(main, run_name="__main__", alter_sys=True)


def load(sources: dict[str, str], main: str) -> ModuleType:
    """The module ``main``, imported from ``sources``; the hook and the modules it made are
    gone again when this returns (the module's own functions keep what they imported). No
    ``linecache`` (every rank would import it, twice: the interpreter's own printer of a
    rank's traceback reads none)."""
    shipped = Shipped(sources, lines=False)
    sys.meta_path.insert(0, shipped)
    try:
        __import__(main)
        return sys.modules[main]
    finally:
        shipped.remove()


def _print_exception(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    import traceback

    traceback.print_exception(kind, exc, tb)


def _print_thread_exception(args: Any) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    sys.stderr.write(f"Exception in thread {name}:\n")
    _print_exception(args.exc_type, args.exc_value, args.exc_traceback)

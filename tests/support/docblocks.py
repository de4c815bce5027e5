"""The shell blocks of the docs' pages: which run here, which are marked not to (and why).

A ```bash block is a script; a ```console block is commands (``$ `` lines) and the output they
show, which the test checks line by line in order (``...`` stands for any text, as doctest's
ELLIPSIS). A block preceded by ``<!-- not-run: REASON -->`` is not run; the reason is required.
A block preceded by ``<!-- testbed: REASON -->`` needs nodes: it is not run on this machine alone
but on a 2+1+1 namespace testbed, with its ``cluster.yaml`` in the current directory
(tests/testbed/test_docs_testbed.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
TESTED_PAGES = ("getting-started.md", "guides/*.md")
"""The pages whose shell blocks must run (or say why not): the ones a user follows."""

_FENCE = re.compile(r"^```(\w*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*(?P<kind>not-run|testbed):\s*(?P<why>.*?)\s*-->$")
SHELL = ("bash", "console", "sh", "shell")
_FILES_ONLY = re.compile(r"(cat > \S+ <<'(\w+)'\n(?:.*\n)*?\2\n)+")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    text: str
    not_run: str | None
    """The reason given in the marker, or None for a block that runs on this machine."""
    testbed: bool = False
    """Marked ``testbed``: runs on the namespace testbed (``not_run`` says so)."""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def writes_files(self) -> bool:
        """An unmarked bash block that only writes files (``cat > F <<'EOF'`` … ``EOF``): what a
        later block, the testbed's too, may use."""
        return (self.lang == "bash" and self.not_run is None
                and _FILES_ONLY.fullmatch(self.text + "\n") is not None)

    def commands(self) -> str:
        """The script to run: the block itself, or a console block's ``$`` lines."""
        if self.lang != "console":
            return self.text
        return "\n".join(line[2:] for line in self.text.splitlines() if line.startswith("$ "))

    def expected(self) -> list[str]:
        """A console block's output lines (empty for a bash block)."""
        if self.lang != "console":
            return []
        return [line for line in self.text.splitlines()
                if line.strip() and not line.startswith("$ ")]


def blocks(page: Path) -> list[Block]:
    """Every shell block of ``page``, in order."""
    rel = page.relative_to(DOCS).as_posix()
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        body = []
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        i += 1
        if lang in SHELL:
            prev = lines[start - 1].strip() if start else ""
            marker = _NOT_RUN.match(prev)
            found.append(Block(rel, start + 1, lang, "\n".join(body),
                               marker.group("why") if marker else None,
                               bool(marker) and marker.group("kind") == "testbed"))
    return found


def user_pages() -> list[Path]:
    return sorted({p for pattern in TESTED_PAGES for p in DOCS.glob(pattern)})


def matches_in_order(expected: list[str], actual: str) -> list[str]:
    """The expected lines not found in ``actual``'s lines in that order (``...``: any text; a run
    of spaces: any run of spaces, as a table's column widens with what it holds, e.g. a
    duration of 12.6 s on a loaded machine where the page shows 2.3 s)."""
    got = actual.splitlines()
    missing, at = [], 0
    for want in expected:
        pattern = re.compile(".*".join(re.sub(r"(?:\\ )+", r"\\s+", re.escape(part))
                                       for part in want.split("...")) + r"\s*$")
        for j in range(at, len(got)):
            if pattern.match(got[j]):
                at = j + 1
                break
        else:
            missing.append(want)
    return missing


def run_block(block: Block, cwd: Path, tools: Path, src: Path) -> str | None:
    """Run ``block`` in ``cwd`` as a reader would type it, with ``ptcluster`` and ``python`` on
    PATH as after ``source .venv/bin/activate`` (``tools``: a folder for the two, made here;
    ``src``: the checkout's code). None when it exited 0 and showed its output, else why not."""
    tools.mkdir(exist_ok=True)
    launcher = tools / "ptcluster"
    launcher.write_text(f"#!/bin/sh\nexec {sys.executable} -m ptcluster \"$@\"\n")
    launcher.chmod(0o755)
    python = tools / "python"  # a script, not a link: a link to a venv's python is outside it
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "COLUMNS": "100",
           "PYTHONPATH": str(src)}
    env.pop("PTCLUSTER_CLUSTER", None)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.commands()], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    if proc.returncode != 0:
        return f"{block.id} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
    missing = matches_in_order(block.expected(), proc.stdout)
    if missing:
        return f"{block.id}: output lines not seen (in order): {missing}\n{proc.stdout[-3000:]}"
    return None

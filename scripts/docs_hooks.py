"""MkDocs hooks (``hooks:`` in mkdocs.yml): add the generated pages at every build.

The reference pages come from the code (``ptcluster.cli.reference``), and the design pages are
ARCHITECTURE.md and SECURITY.md from the repository's root, so neither is ever a stale copy in
``docs/``. ``File.generated`` (MkDocs >= 1.6) adds a page that exists only in the build.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# this checkout's code, not whatever ptcluster the venv has installed
sys.path.insert(0, str(ROOT / "src"))

from mkdocs.structure.files import File, Files  # noqa: E402

from ptcluster.cli import reference  # noqa: E402

COPIED = {"design/architecture.md": "ARCHITECTURE.md", "design/security.md": "SECURITY.md"}
"""Pages that are a file of the repository's root, as it is."""


def on_files(files: Files, config: Any) -> Files:
    for path in reference.PAGES:
        files.append(File.generated(config, path, content=reference.render(path)))
    for path, source in COPIED.items():
        files.append(File.generated(config, path, content=(ROOT / source).read_text()))
    files.append(File.generated(config, "design/benchmarks.md",
                                content=benchmarks_page(Path(config["docs_dir"]))))
    return files


def benchmarks_page(docs: Path) -> str:
    """design/benchmarks.md: every script of benchmarks/ with what it measures (its docstring's
    first paragraph), its command, and the pages that report its latest figures."""
    import ast

    lines = ["# Benchmarks", "",
             "Scripts under `benchmarks/` measure ptcluster against a baseline run the same way "
             "(plain torchrun, the blog recipe, a bare timing loop); they print ratios and are "
             "not asserted in tests. Each figure is reported on the page that explains the "
             "behaviour it measures, with how it was measured. Run one with "
             "`.venv/bin/python benchmarks/NAME.py` (the testbed ones as root).", "",
             "| benchmark | what it measures | script last changed | figures on |",
             "| --- | --- | --- | --- |"]
    pages = {p: p.read_text() for p in sorted(docs.rglob("*.md"))}
    for script in sorted((ROOT / "benchmarks").glob("[!_]*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        what = " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")
        where = [f"[{p.stem}]({p.relative_to(docs / 'design').as_posix()})"
                 if p.is_relative_to(docs / "design") else
                 f"[{p.stem}](../{p.relative_to(docs).as_posix()})"
                 for p, text in pages.items() if script.name in text]
        lines.append(f"| `{script.name}` | {what} | {_last_commit(script)} | "
                     f"{', '.join(where) or '—'} |")
    lines.append("")
    return "\n".join(lines)


def _last_commit(path: Path) -> str:
    """The commit (short hash, date) that last changed ``path``; "—" outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h %cs", "--", str(path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"`{out}`" if out else "—"

"""MkDocs hooks (``hooks:`` in mkdocs.yml): add the generated pages at every build.

The reference pages come from the code (``scripts/docs_reference.py``, beside this file), and
the design pages are ARCHITECTURE.md and SECURITY.md from the repository's root, so neither is
ever a stale copy in ``docs/``. ``File.generated`` (MkDocs >= 1.6) adds a page that exists only
in the build.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# this checkout's code, not whatever ptcluster the venv has installed
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

import docs_reference as reference  # noqa: E402
from mkdocs.structure.files import File, Files  # noqa: E402

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


def benchmarks_page(docs: Path, results: Path = ROOT / "benchmarks" / "results") -> str:
    """design/benchmarks.md: every script of benchmarks/ with what it measures (its docstring's
    first paragraph), how to run it, its latest recorded figures (benchmarks/results/, written by
    benchmarks/record.py: the date, the commit, the machine) and the pages that explain them."""
    import ast

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import record

    scripts = [s for s in sorted((ROOT / "benchmarks").glob("[!_]*.py")) if s.stem != "record"]
    pages = {p: p.read_text() for p in sorted(docs.rglob("*.md"))}
    lines = ["# Benchmarks", "",
             "Scripts under `benchmarks/` measure ptcluster against a baseline run the same way "
             "in the same run (plain torchrun, the blog recipe, a bare timing loop, the same "
             "command without the feature); they print ratios and are never asserted in tests: "
             "these are noisy machines. Each one's latest figures below are what it printed, "
             "kept by `benchmarks/record.py` with the date, the commit and the machine; the "
             "guides explain what the figures mean. Record one with", "",
             "```bash", ".venv/bin/python benchmarks/record.py NAME [its options]", "```", "",
             "(the testbed ones as root: they build their own nodes).", "",
             "| benchmark | what it measures | latest figures |", "| --- | --- | --- |"]
    sections = []
    for script in scripts:
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        paragraphs = doc.split("\n\n")
        what = " ".join(paragraphs[0].split())
        result = results / f"{script.stem}.txt"
        fields, output = record.read(result) if result.is_file() else ({}, "")
        when = f"{fields['date'][:10]}, `{fields['commit'].split()[0]}`" if fields else "—"
        lines.append(f"| [`{script.name}`](#{script.stem}) | "
                     f"{what.replace('|', chr(92) + '|')} | {when} |")
        where = [f"[{p.stem}]({p.relative_to(docs / 'design').as_posix()})"
                 if p.is_relative_to(docs / "design") else
                 f"[{p.stem}](../{p.relative_to(docs).as_posix()})"
                 for p, text in pages.items() if script.name in text]
        sections += [f"## {script.stem}", "", what, ""]
        usage = [p.strip() for p in paragraphs if p.strip().startswith(
            (".venv/", "sudo ", "PYTHONPATH=", "torchrun"))]
        if usage:
            sections += ["```bash", *usage[-1].splitlines(), "```", ""]
        if fields:
            sections += [f"Latest figures: {fields['date']}, commit `{fields['commit']}`, "
                         f"{fields['machine']}, Python {fields['python']}, torch "
                         f"{fields['torch']}; `{fields['command']}` took {fields['seconds']} s "
                         f"and exited {fields['exit']}.", "",
                         "```text", output.rstrip(), "```", ""]
        else:
            sections += ["Not recorded with `benchmarks/record.py` yet"
                         + (": the figures quoted on the pages below were measured by hand, "
                            "with how, on those pages." if where else "."), ""]
        if where:
            sections += [f"Explained on: {', '.join(where)}.", ""]
    return "\n".join(lines + [""] + sections)

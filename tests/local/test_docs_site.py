"""The docs site, for real: ``mkdocs build --strict`` offline, and every shell block of the pages
a user follows run as a user would type it (``tests.support.docblocks``: a block marked
``<!-- not-run: REASON -->`` is skipped and counted; an unmarked one must run, and a console
block's output must show)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html import unescape
from pathlib import Path

import pytest

from tests.support.docblocks import blocks, run_block, user_pages

ROOT = Path(__file__).resolve().parents[2]


_EXTERNAL = re.compile(
    r"""<script[^>]+src=["']?https?:|<link[^>]+href=["']?https?:|url\(\s*["']?https?:"""
    r"""|@import\s+["']?https?:|fonts\.googleapis|fonts\.gstatic""", re.I)


def test_the_site_builds_strictly_and_reads_offline(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (a broken link or a missing page fails), then no page, style or
    script of the built site loads anything from the network (Material's Google Fonts are off:
    ``theme.font: false``)."""
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    pages = list(site.rglob("*.html"))
    assert len(pages) > 20
    for path in [*pages, *site.rglob("*.css"), *site.rglob("*.js")]:
        hit = _EXTERNAL.search(path.read_text(errors="replace"))
        assert hit is None, f"{path.relative_to(site)} loads from the network: {hit.group(0)!r}"
    shown = [f"{path.relative_to(site)}: {hit}" for path in pages for hit in _stray_escapes(path)]
    assert not shown, "backslashes or backticks shown as text:\n" + "\n".join(shown)
    commands = (site / "reference/commands/index.html").read_text()
    assert "--max-restarts" in commands and "--trust-cluster-file" in commands
    assert "nodes[].ssh.reuse" in (site / "reference/cluster-file/index.html").read_text()
    assert "Security" in (site / "design/security/index.html").read_text()


def _stray_escapes(page: Path) -> list[str]:
    """What a reader would see as markup on ``page``: ``\\|`` (an escape Markdown keeps outside
    a table and inside a code span), a backtick outside code (a code span cut short by one of
    its own backticks) or a code span ending in a backslash (one cut at ``\\```). Code blocks
    (``<pre>``) may show both, as a shell would take them."""
    html = re.sub(r"<(pre|script)\b.*?</\1>", "", page.read_text(), flags=re.S)
    outside_code = re.sub(r"<code\b.*?</code>", "", html, flags=re.S)
    hits = [m.group(0) for m in re.finditer(r".{0,40}\\</code>", html)]
    for pattern, markup in ((r"\\\|", html), ("`", outside_code)):
        text = unescape(re.sub(r"<[^>]+>", "", markup))
        hits += [text[max(0, m.start() - 40):m.end() + 20] for m in re.finditer(pattern, text)]
    return hits


@pytest.mark.slow
@pytest.mark.parametrize("page", [p.relative_to(ROOT / "docs").as_posix() for p in user_pages()])
def test_the_pages_shell_blocks_run(page: str, tmp_path: Path) -> None:
    """The page's runnable blocks in order, in one fresh directory (a later block may use what an
    earlier one made, as a reader's would); each must exit 0 and show its console output."""
    found = blocks(ROOT / "docs" / page)
    runnable = [b for b in found if b.not_run is None]
    if not runnable:
        pytest.skip(f"{page}: no shell block to run here ({len(found)} marked, with reasons)")
    work = tmp_path / "work"
    work.mkdir()
    for b in runnable:
        failed = run_block(b, work, tmp_path / "bin", ROOT / "src")
        assert failed is None, failed


def test_a_recorded_benchmark_shows_on_the_benchmarks_page(tmp_path: Path) -> None:
    """``benchmarks/record.py`` runs a real benchmark (a small one), keeps what it printed with the
    date, the commit and the machine, and the site's benchmarks page shows those figures; the
    records the repository holds all parse and name a benchmark that exists."""
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "benchmarks/record.py", "doctor_checks_scale",
                           "--nodes", "64", "--repeat", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "PTCLUSTER_BENCH_RESULTS": str(results)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import docs_hooks
    import record

    fields, output = record.read(results / "doctor_checks_scale.txt")
    assert fields["command"] == "benchmarks/doctor_checks_scale.py --nodes 64 --repeat 1"
    assert re.fullmatch(r"[0-9a-f]{7,} \d{4}-\d\d-\d\d.*", fields["commit"]), fields
    assert fields["exit"] == "0" and "cores" in fields["machine"]
    row = next(line for line in output.splitlines() if line.startswith("| 64 |"))
    assert row in proc.stdout
    page = docs_hooks.benchmarks_page(ROOT / "docs", results)
    section = page.split("\n## doctor_checks_scale\n")[1].split("\n## ")[0]
    assert row in section and fields["date"] in section and fields["commit"] in section
    unrecorded = page.split("\n## launch_fanout\n")[1].split("\n## ")[0].strip().split("\n\n")
    # (its paragraphs: what it measures, its usage, then that no figures are kept)
    assert unrecorded[2].startswith("Not recorded with `benchmarks/record.py` yet"), unrecorded
    assert not any(part.startswith("Latest figures") for part in unrecorded), unrecorded
    for kept in (ROOT / "benchmarks" / "results").glob("*.txt"):
        fields, output = record.read(kept)
        assert (ROOT / "benchmarks" / f"{fields['benchmark']}.py").is_file(), kept
        assert kept.stem == fields["benchmark"] and output.strip(), kept

"""The docs' blocks that need nodes, on a 2+1+1 namespace testbed: every shell block of the
pages a user follows marked ``<!-- testbed: … -->`` runs with the testbed's cluster file as
``./cluster.yaml`` (what ``ptcluster init`` would have written), and its console output must show
(``tests.support.docblocks``). A bash block of the page that only writes a file runs first, as
the reader had run it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.docblocks import blocks, run_block, user_pages

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
ON_TESTBED = [b for page in user_pages() for b in blocks(page) if b.testbed]


def test_some_blocks_are_for_the_testbed() -> None:
    assert any(b.page == "getting-started.md" for b in ON_TESTBED)


@pytest.mark.parametrize("page", sorted({b.page for b in ON_TESTBED}))
def test_the_pages_testbed_blocks_run_on_2_1_1_nodes(page: str, testbed, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "cluster.yaml").write_text(
        testbed.cluster_yaml([2, 1, 1], python=sys.executable, workdir=str(work)))
    # the page's testbed blocks in order, after the files its earlier blocks wrote (a script)
    for b in blocks(ROOT / "docs" / page):
        if not (b.testbed or b.writes_files):
            continue
        failed = run_block(b, work, tmp_path / "bin", ROOT / "src")
        assert failed is None, failed

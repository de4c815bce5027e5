"""`bench --predict` on the testbed with its links shaped by `tc tbf`: at 100 Mbit/s, a job with
a 21 MB gradient and little compute (``tests/support/biggrad.py``) is slower on 2 and 3 nodes
than on 1; the prediction says so, and the measurement shows it. The margins hold on a loaded
machine: at 100 Mbit/s the all-reduce alone takes ~1.7 s (2 nodes) and ~2.2 s (3 nodes) a step,
the compute tens of milliseconds (a slow CPU makes it hundreds, still far below). How close the
figures are (±25 %) is ``benchmarks/predict_accuracy.py``'s to measure, not this test's."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.head import run_head
from tests.support.testbed import shaped

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

BIGGRAD = str(Path(__file__).resolve().parents[1] / "support" / "biggrad.py")
ONE_THREAD = "env: {OMP_NUM_THREADS: '1'}\n"


def qdiscs(testbed) -> str:
    out = []
    for node in testbed.nodes:
        for prefix, dev in (([], node.veth_host),
                            (["ip", "netns", "exec", node.netns], "veth0")):
            out.append(subprocess.run([*prefix, "tc", "qdisc", "show", "dev", dev],
                                      capture_output=True, text=True, timeout=20).stdout)
    return "".join(out)


def test_shaping_is_removed_even_on_failure(testbed) -> None:
    with pytest.raises(RuntimeError), shaped(testbed, "100mbit"):
        assert qdiscs(testbed).count("tbf") == 6  # both ends of every node's link
        raise RuntimeError("a failing test")
    assert "tbf" not in qdiscs(testbed)


def samples_per_s(cluster: str, cwd: Path) -> float:
    code, head = run_head(["run", "--cluster", cluster, BIGGRAD, "--warmup", "1", "--steps",
                           "2"], cwd, timeout=300)
    text = "\n".join(head.lines + head.err)
    assert code == 0, text[-3000:]
    return float(re.findall(r"samples_per_s=([0-9.]+)", text)[-1])


def test_a_slow_link_is_predicted_and_measured_slower(testbed, tmp_path) -> None:
    clusters = {k: testbed.write_cluster(tmp_path, [1] * k, extra=ONE_THREAD)
                for k in (1, 2, 3)}
    with shaped(testbed, "100mbit"):
        code, head = run_head(["bench", "--cluster", clusters[3], "--predict", "--json",
                               "--steps", "3", "--warmup-steps", "2", "-n", "2", "--",
                               BIGGRAD, "--steps", "1000"], tmp_path, timeout=300)
        assert code == 0, "\n".join(head.err)[-3000:]
        out = json.loads("\n".join(head.lines))
        measured = [samples_per_s(clusters[k], tmp_path) for k in (1, 2, 3)]
    assert "tbf" not in qdiscs(testbed)
    predicted = [row["samples_per_s"] for row in out["rows"]]
    assert [row["nodes"] for row in out["rows"]] == [1, 2, 3]
    assert out["measured"]["grad_bytes"] >= 20e6
    assert predicted[1] < predicted[0] and predicted[2] < predicted[0], predicted
    assert measured[1] < measured[0] and measured[2] < measured[0], measured
    assert [row["bound"] for row in out["rows"][1:]] == ["network", "network"]
    assert out["slower"] == [{"nodes": 2, "than": 1}, {"nodes": 3, "than": 1}], out["verdict"]
    assert out["link"]["pays_off_gbit"] > out["link"]["now_gbit"], out["verdict"]  # faster
    assert len(out["verdict"]) == 3  # (the one rendering of each: unit test_predict)

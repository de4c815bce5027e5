"""``data:`` in a cluster file (refused unless vouched for), ``run --data SRC[=DEST]`` and the
ranks' ``PTCLUSTER_DATA*`` variables."""

from __future__ import annotations

import pytest

from ptcluster.cluster import parse_cluster_text
from ptcluster.cluster.model import DataSpec
from ptcluster.errors import SpecError, UsageError
from ptcluster.push.entries import entries, from_flag, with_data

FILE = """nodes: [a, b]
env: {PTCLUSTER_DATA: mine, X: "1"}
data:
  - {name: train, src: data/train, dest: /data/train}
  - {name: Val_2, src: /abs/val}
"""


def test_data_entries_of_a_trusted_file() -> None:
    spec = parse_cluster_text(FILE, "c.yaml", trusted=True, code_dir="/proj")
    assert spec.data == (DataSpec("TRAIN", "/proj/data/train", "/data/train"),
                         DataSpec("VAL_2", "/abs/val", "/abs/val"))
    ranks = dict(with_data(spec, spec.data).env)
    assert ranks == {"X": "1", "PTCLUSTER_DATA_TRAIN": "/data/train",
                     "PTCLUSTER_DATA_VAL_2": "/abs/val", "PTCLUSTER_DATA": "/data/train"}


def test_data_of_a_file_not_vouched_for_is_refused() -> None:
    with pytest.raises(SpecError) as refused:
        parse_cluster_text(FILE, "c.yaml", code_dir="/proj")
    from ptcluster.cluster.trust import data_risk

    said = refused.value
    assert (said.source, said.path, said.detail) == ("c.yaml", "data", data_risk())
    assert "--trust-cluster-file" in str(said.fix)


@pytest.mark.parametrize("entry, words", [
    ("[{name: 'a-b', src: x}]", "is not a new name"),
    ("[{name: a, src: x}, {name: A, src: y}]", "is not a new name"),
    ("[{name: a, src: x, dest: rel/path}]", "is not an absolute path"),
    ("[{name: a}]", "data[0].src"),
    ("[{name: a, src: x, mode: 1}]", "unknown key"),
    ("{name: a}", "must be a list"),
])
def test_bad_data_entries(entry: str, words: str) -> None:
    with pytest.raises(SpecError) as bad:
        parse_cluster_text(f"nodes: [a]\ndata: {entry}\n", "c.yaml", trusted=True)
    assert words in str(bad.value)


def test_data_flags() -> None:
    spec = parse_cluster_text("nodes: [a]\ndata: [{name: shards, src: /s}]\n", "c.yaml",
                              trusted=True)
    got = entries(spec, ("/x/shards", "/y/my-set=/data/set"))
    assert got == (DataSpec("SHARDS", "/s", "/s"), DataSpec("SHARDS_2", "/x/shards", "/x/shards"),
                   DataSpec("MY_SET", "/y/my-set", "/data/set"))
    for bad in ("=/d", "/x=", "/x=rel"):
        with pytest.raises(UsageError):
            from_flag(bad)


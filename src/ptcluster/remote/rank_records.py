"""The records ptcluster's own rank programs report (``ptcluster.report``: the guard passes
them on to the head's ``on_data``), checked where the head receives them: the bench worker's
``start``, ``row`` and ``pair`` (``node.rank.bench_wire``; ``bench.sweep``) and the step
probe's ``predict`` record (``node.rank.step_probe.PredictRecord``; ``bench.probe``), which
a user's process sends.

Each schema names exactly the keys of the TypedDict beside the code that writes the record
(``tests/unit/test_readmit.py`` compares them), built from :mod:`ptcluster.remote.replies`'
checks. A record that fails raises :class:`~ptcluster.remote.replies.BadReply`
(``node.record-refused``): ``bench --predict`` says it as the probe's failure; a bench row
that fails is noted by the run as an unusable record.
"""

from __future__ import annotations

from typing import Any, cast

from ptcluster.node.rank.bench_wire import PairDone, RowDone, Started
from ptcluster.node.rank.step_probe import PredictRecord
from ptcluster.remote.diagnoses import RECORD_REFUSED
from ptcluster.remote.replies import (
    _bad,
    boolean,
    checked,
    figure,
    listing,
    number,
    one_of,
    optional,
    record,
    word,
)

MOST = 2**62
"""Bound on a count (elements, bytes, wrong elements, a batch)."""
MOST_RANKS = 2**31
MOST_STEPS = 1 << 20
"""Most measured steps in a ``predict`` record (``--steps`` is the user's)."""
MOST_BUCKETS = 1 << 16
"""Most gradient buckets of a step."""

START = record({"world_size": number(1, MOST_RANKS), "backend": word, "device": word})
"""``bench_wire.Started`` (the worker's ``start``, its ``kind`` aside)."""
ROW = record({"op": word, "count": number(0, MOST), "seconds": figure,
              "wrong": number(0, MOST)})
"""``bench_wire.RowDone``."""
PAIR = record({"a": number(0, MOST_RANKS), "b": number(0, MOST_RANKS), "seconds": figure})
"""``bench_wire.PairDone``."""


def bucket(where: str, value: Any) -> None:
    """``[bytes, ready_s, done_s]`` of one gradient bucket."""
    if not isinstance(value, list) or len(value) != 3:
        raise _bad(where, value, "[bytes, ready_s, done_s]")
    for i, item in enumerate(value):
        figure(f"{where}[{i}]", item)


STEP = record({"step_s": figure, "batch": number(0, MOST), "eval": boolean,
               "buckets": optional(listing(bucket, MOST_BUCKETS)), "ddp": boolean})
"""``step_probe.MeasuredStep``."""
PREDICT = record({"kind": one_of("predict"), "world_size": number(1, MOST_RANKS),
                  "steps": listing(STEP, MOST_STEPS)})
"""``step_probe.PredictRecord``."""


def started(data: Any) -> Started:
    """The bench worker's ``start`` (without its ``kind``), checked. Raises ``BadReply``."""
    return cast(Started, checked(START, "the bench's start", data, RECORD_REFUSED))


def row_done(data: Any) -> RowDone:
    """The bench worker's ``row`` (without its ``kind``), checked. Raises ``BadReply``."""
    return cast(RowDone, checked(ROW, "the bench's row", data, RECORD_REFUSED))


def pair_done(data: Any) -> PairDone:
    """The bench worker's ``pair`` (without its ``kind``), checked. Raises ``BadReply``."""
    return cast(PairDone, checked(PAIR, "the bench's pair", data, RECORD_REFUSED))


def predict_record(data: Any) -> PredictRecord:
    """The step probe's ``predict`` record, checked. Raises ``BadReply``."""
    return cast(PredictRecord, checked(PREDICT, "the predict record", data, RECORD_REFUSED))

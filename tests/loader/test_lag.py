"""The lag of a stream over a job (NOTE [lag] in herald/loader/kafka/source.py): the bounded
history and the report block built from it."""

from __future__ import annotations

import numpy as np
import pytest

from herald.job.report import lag as lag_block
from herald.loader.kafka.records import Chunk
from herald.loader.lag import LagHistory


def _lag(records: dict[int, int], event_s: float | None = None) -> dict:
    return {"records": records, "event_time_s": event_s}


def test_history_keeps_an_even_sketch_within_its_bound():
    h = LagHistory(max_points=8)
    for step in range(1, 101):
        h.add(step, _lag({0: 1000 - step, 1: 5}))
    assert len(h.points) < 8
    steps = [p[0] for p in h.points]
    assert steps[0] == 1 and steps == sorted(steps)
    assert len(set(np.diff(steps))) == 1  # evenly spaced over the whole run
    assert h.peak_records == 999 + 5 and h.last == _lag({0: 900, 1: 5})


def test_history_of_a_source_without_lag_is_none():
    h = LagHistory()
    for step in range(5):
        h.add(step, None)
    assert h.summary() is None and h.last is None


def test_summary_and_report_lines():
    h = LagHistory()
    h.add(1, _lag({0: 40, 1: 2}, 3.5))
    h.add(2, _lag({0: 0, 1: 0}, 0.0))
    rep = {"lag": h.summary()}
    assert rep["lag"]["records"] == {"final": {"0": 0, "1": 0}, "final_total": 0, "peak": 42}
    assert rep["lag"]["event_time_s"] == {"final": 0.0, "peak": 3.5}
    assert rep["lag"]["series"] == [[1, 42, 3.5], [2, 0, 0.0]]
    (line,) = lag_block.lines(rep)
    assert line.startswith("lag behind the stream's end: 0 records at the end (peak 42); event time 0.0 s")
    assert lag_block.shown(rep) and not lag_block.shown({})


def test_history_refuses_a_bound_below_two():
    with pytest.raises(ValueError, match="max_points"):
        LagHistory(max_points=1)


def test_chunk_timestamp_of_a_record():
    z = np.zeros(0, np.int64)
    chunk = Chunk(0, None, z, z, np.zeros(0, bool), (0, 0), z, z, [])  # type: ignore[arg-type]
    chunk.record_at, chunk.record_ms = np.array([3, 4, 7], np.int64), np.array([10, -1, 30], np.int64)
    assert [chunk.timestamp_ms(o) for o in (3, 4, 5, 7, 9)] == [10, -1, -1, 30, -1]

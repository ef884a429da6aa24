"""One save/restore harness for every source, for the GlobalBatcher and for the
GlobalBatches producer.

``check_source_resume`` reads a source with random read sizes, stops at random
points, saves ``state_dict()`` (through JSON, as a checkpoint would), opens a fresh
source, loads the state and reads on; the concatenation must equal an
uninterrupted run row for row, and the final skip counts must match.
``check_batcher_resume`` does the same batch by batch for any batch iterator with
``state_dict``/``load_state_dict`` (and, when it has them, equal ``info`` counts and
equal ``sample_ids``/``position`` of every batch).
"""

from __future__ import annotations

import json

import numpy as np

from herald.loader.batch import SampleBatch


def read_all(source, rng, max_read=700):
    parts = []
    while True:
        b = source.read(int(rng.integers(1, max_read)))
        if b is None:
            return parts
        parts.append(b)


def check_source_resume(make_source, *, trials=3, seed=0, max_read=700):
    rng = np.random.default_rng(seed)
    with make_source() as s:
        full = SampleBatch.concat(read_all(s, rng, max_read))
        full_stats = s.stats
    assert len(full) > 0
    for _ in range(trials):
        stop_rows = int(rng.integers(0, len(full) + 1))
        with make_source() as s:
            got = []
            n = 0
            while n < stop_rows:
                b = s.read(int(rng.integers(1, max_read)))
                if b is None:
                    break
                got.append(b)
                n += len(b)
            state = json.loads(json.dumps(s.state_dict()))
        with make_source() as s2:
            s2.load_state_dict(state)
            assert s2.stats["rows"] == n
            got += read_all(s2, rng, max_read)
            assert SampleBatch.concat(got).equals(full), f"resume after {n} rows differs"
            assert s2.stats["rows"] == full_stats["rows"]
            assert s2.stats["skipped"] == full_stats["skipped"]
    return full


def _tracked(b, i):
    """(sample ids, position) recorded for batch ``i``, when the iterator records them."""
    if not hasattr(b, "sample_ids"):
        return None
    ids, pos = b.sample_ids(i), b.position(i)
    return (None if ids is None else ids.tolist(), pos)


def _drain(b, start, n=None):
    out, tracked = [], []
    for batch in b:
        tracked.append(_tracked(b, start + len(out)))
        out.append(batch)
        if n is not None and len(out) == n:
            break
    return out, tracked


def check_batcher_resume(make_batcher, *, trials=2, seed=0):
    rng = np.random.default_rng(seed)
    with make_batcher() as b:
        full, full_tracked = _drain(b, 0)
        full_info = getattr(b, "info", None)
    assert full
    for _ in range(trials):
        stop = int(rng.integers(0, len(full) + 1))
        with make_batcher() as b:
            got, tracked = _drain(b, 0, stop) if stop else ([], [])
            state = json.loads(json.dumps(b.state_dict()))
        with make_batcher() as b2:
            b2.load_state_dict(state)
            more, more_tracked = _drain(b2, stop)
            got, tracked = got + more, tracked + more_tracked
            assert getattr(b2, "info", None) == full_info, f"resume after {stop} batches: info differs"
        assert len(got) == len(full), f"resume after {stop} batches: {len(got)} != {len(full)} batches"
        for i, (x, y) in enumerate(zip(got, full)):
            assert x.equals(y), f"resume after {stop} batches: batch {i} differs"
        assert tracked == full_tracked, f"resume after {stop} batches: sample ids or positions differ"
    return full

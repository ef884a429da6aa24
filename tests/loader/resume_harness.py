"""One save/restore harness for every source and for the GlobalBatcher (STYLE habit 8).

``check_source_resume`` reads a source with random read sizes, stops at random
points, saves ``state_dict()`` (through JSON, as a checkpoint would), opens a fresh
source, loads the state and reads on; the concatenation must equal an
uninterrupted run row for row, and the final skip counts must match.
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


def check_batcher_resume(make_batcher, *, trials=2, seed=0):
    rng = np.random.default_rng(seed)
    with make_batcher() as b:
        full = list(b)
    assert full
    for _ in range(trials):
        stop = int(rng.integers(0, len(full) + 1))
        with make_batcher() as b:
            got = [next(b) for _ in range(stop)]
            state = json.loads(json.dumps(b.state_dict()))
        with make_batcher() as b2:
            b2.load_state_dict(state)
            got += list(b2)
        assert len(got) == len(full), f"resume after {stop} batches: {len(got)} != {len(full)} batches"
        for i, (x, y) in enumerate(zip(got, full)):
            assert x.equals(y), f"resume after {stop} batches: batch {i} differs"
    return full

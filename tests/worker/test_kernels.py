"""The worker's numba kernels and grouping helpers equal the numpy code they replace."""

import numpy as np
import pytest

from herald.errors import ProtocolError
from herald.scheduler.plan import KeySet
from herald.worker.psio import positions, table_groups
from herald.worker.kernels import segment_unique_jit


def test_segment_unique_equals_np_unique_per_segment():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lens = rng.integers(0, 40, rng.integers(0, 5))
        segs = [rng.integers(0, int(rng.choice([3, 100, 2**64 - 1])), n, dtype=np.uint64) for n in lens]
        bounds = np.zeros(len(segs) + 1, np.int64)
        np.cumsum(lens, out=bounds[1:])
        values = np.concatenate(segs) if segs else np.zeros(0, np.uint64)
        uniq, inv, ub = np.empty_like(values), np.empty(values.shape[0], np.int64), np.empty(len(segs) + 1, np.int64)
        segment_unique_jit(values, bounds, uniq, inv, ub)
        for t, seg in enumerate(segs):
            u, i = np.unique(seg, return_inverse=True)
            assert np.array_equal(uniq[ub[t]:ub[t + 1]], u) and np.array_equal(inv[bounds[t]:bounds[t + 1]], i)


def test_table_masks_select_what_boolean_masks_select():
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 500):
        table = rng.integers(0, 26, n).astype(np.int32)
        got = [(t, idx.tolist()) for t, idx in table_groups(table)]
        assert got == [(int(t), np.flatnonzero(table == t).tolist()) for t in np.unique(table)]


def test_positions_finds_rows_and_rejects_unused_keys():
    uniq = np.array([3, 9, 2**63 + 1, 5], np.uint64)  # table 0: [3, 9, 2**63+1], table 1: [5], table 2: []
    bounds = np.array([0, 3, 4, 4], np.int64)
    keys = KeySet(np.array([1, 0, 0, 0], np.int32), np.array([5, 2**63 + 1, 3, 9], np.uint64))
    assert positions(uniq, bounds, keys).tolist() == [3, 2, 0, 1]
    for t, i in ((0, 4), (1, 3), (2, 3), (3, 3)):
        with pytest.raises(ProtocolError):
            positions(uniq, bounds, KeySet(np.array([t], np.int32), np.array([i], np.uint64)))

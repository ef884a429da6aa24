"""The LRU-bounded PS table (NOTE [bounded ps], Persia §4.2.2)."""

import numpy as np
import pytest

from herald.contracts.tables import TableConfig
from herald.errors import ProtocolError
from herald.ps.table import EmbeddingTable


def _table(max_rows, dim=4, optimizer=None):
    kwargs = {"optimizer": optimizer} if optimizer else {}
    return EmbeddingTable(TableConfig("t", dim, **kwargs), 0, seed=7, max_resident_rows=max_rows)


def _keys(a):
    return np.asarray(a, np.uint64)


def test_resident_rows_never_exceed_the_bound_while_more_ids_stream_through():
    t = _table(100)
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(300):
        keys = np.unique(rng.integers(0, 5000, 40)).astype(np.uint64)
        seen.update(keys.tolist())
        rows, _ = t.pull(keys)
        assert rows.shape == (keys.shape[0], t.width)
        assert t.n_rows <= 100
    assert len(seen) > 1000
    assert t.evicted >= len(seen) - 100


def test_least_recently_used_rows_go_first_and_come_back_reinitialised():
    t = _table(64)
    fresh = EmbeddingTable(TableConfig("t", 4), 0, seed=7)
    first = _keys(range(64))
    before, _ = t.pull(first)
    t.push_rows(first[32:], before[32:] + 1.0)  # rows 32..63 touched again: recent
    t.pull(_keys(range(1000, 1004)))  # 4 new keys: evicts among rows 0..31 only
    keys, rows = t.snapshot()
    resident = set(keys.tolist())
    assert resident.issuperset(range(32, 64)) and resident.issuperset(range(1000, 1004))
    gone = sorted(set(range(32)) - resident)
    assert 4 <= len(gone) <= 32
    again, _ = t.pull(_keys(gone))  # an evicted row is re-initialised
    expect, _ = fresh.pull(_keys(gone))
    np.testing.assert_array_equal(again, expect)
    kept, _ = t.pull(first[32:])  # survivors keep their values
    np.testing.assert_array_equal(kept, before[32:] + 1.0)


def test_rows_of_open_aggregations_are_never_evicted():
    t = _table(16, dim=2)
    keys = _keys(range(16))
    t.pull(keys)
    grads = np.ones((8, 2), np.float32)
    t.push_grad(keys[:8], grads, np.full(8, 2, np.uint16), step=1, rank=0)  # open: waits for rank 1
    t.pull(_keys(range(100, 108)))  # evicts 8 rows: not 0..7
    resident = set(t.snapshot()[0].tolist())
    assert resident.issuperset(range(8))
    before = t.pull(keys[:8])[0].copy()
    t.push_grad(keys[:8], grads, np.full(8, 2, np.uint16), step=1, rank=1)  # completes after the move
    after = t.pull(keys[:8])[0]
    assert t.open_aggregations == 0
    assert not np.array_equal(before, after)
    with pytest.raises(ProtocolError, match="max_resident_rows"):
        t.push_grad(keys[:8], grads, np.full(8, 2, np.uint16), step=2, rank=0)
        t.pull(_keys(range(200, 216)))  # 16 new keys, 8 rows pinned by step 2: cannot fit


def test_a_request_larger_than_the_bound_is_refused_before_anything_changes():
    t = _table(10)
    t.pull(_keys(range(5)))
    with pytest.raises(ProtocolError, match="raise --ps-max-rows"):
        t.pull(_keys(range(100, 111)))
    assert t.n_rows == 5 and t.evicted == 0


def test_evicted_rows_read_again_counts_each_insert_of_an_evicted_key_once():
    """NOTE [evictions read again]: a key evicted and inserted again counts once per insert,
    whether it is resident now or evicted again since; a restore folds the count in."""
    t = _table(16)
    t.pull(_keys(range(16)))
    assert t.evicted == 0 and t.evicted_read_again == 0
    t.pull(_keys(range(100, 116)))  # every row of 0..15 evicted, none read again
    assert t.evicted == 16 and t.evicted_read_again == 0
    t.pull(_keys(range(4)))  # 4 evicted keys inserted again (resident now)
    assert t.evicted_read_again == 4
    t.pull(_keys(range(200, 216)))  # evicts them again: still 4 inserts
    gone = set(range(4)) - set(t.snapshot()[0].tolist())
    assert t.evicted_read_again == 4 and len(gone) >= 1
    t.pull(_keys(sorted(gone)))  # and inserted a second time
    assert t.evicted_read_again == 4 + len(gone)
    keys, rows = t.snapshot()
    t.load(keys.copy(), rows.copy())  # a restore: the count stays, the memory starts afresh
    assert t.evicted_read_again == 4 + len(gone)
    t.pull(_keys(range(300, 316)))
    t.pull(_keys(range(100, 101)))  # evicted before the restore: not remembered
    assert t.evicted_read_again == 4 + len(gone)

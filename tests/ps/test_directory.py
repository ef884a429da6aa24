"""NOTE [table directory]: every address of a shard's directory names its table's current
arrays, published in one place and checked after every publish in the tests."""

import numpy as np
import pytest

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.ps.directory import DEBUG_ENV, DirectoryError, TableDirectory, check_directory, debug_checks
from herald.ps.kernels.directory import D_CLOCKS, D_MARKS, D_ROOM
from herald.ps.store import TableSet
from herald.ps.table import EmbeddingTable


def _tables(n=2, **kw):
    store = TableSet()
    cfg = OptimizerConfig(name="adagrad")
    tables = [EmbeddingTable(TableConfig(f"t{i}", 4, cfg), i, 0, 16, tableset=store, **kw) for i in range(n)]
    return store, tables


def test_the_tests_check_every_publish():
    assert debug_checks()
    store, _ = _tables()
    assert store.directory.debug
    check_directory(store.directory)


def test_production_does_not_check(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert not debug_checks() and not TableSet().directory.debug
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert not debug_checks()


def test_the_check_catches_a_stale_address():
    store, tables = _tables()
    tables[1].pull(np.arange(40, dtype=np.uint64))  # grown: its arrays replaced and republished
    check_directory(store.directory)
    d = store.directory.d
    d[1, D_CLOCKS] += 8
    with pytest.raises(DirectoryError, match=r"table 1 \('t1'\).*clocks.*without a publish"):
        check_directory(store.directory)
    d[1, D_CLOCKS] -= 8
    d[0, D_ROOM] += 1
    with pytest.raises(DirectoryError, match="room"):
        check_directory(store.directory)


def test_a_missed_publish_is_caught(monkeypatch):
    """An array replaced without its directory row rewritten (here: publish forgotten)."""
    store, tables = _tables()
    monkeypatch.setattr(TableDirectory, "publish", lambda self, t: None)
    tables[0].reserve(5000)
    with pytest.raises(DirectoryError, match=r"table 0 \('t0'\).*rows.*without a publish"):
        check_directory(store.directory)


def test_every_publish_runs_the_check(monkeypatch):
    store, tables = _tables()
    store.directory.d[0, D_MARKS] += 4
    with pytest.raises(DirectoryError, match="row_marks"):
        tables[1].reserve(5000)  # table 1's publish checks every table
    monkeypatch.setenv(DEBUG_ENV, "0")
    quiet, tables = _tables()
    quiet.directory.d[0, D_MARKS] += 4
    tables[1].reserve(5000)  # not checked


def test_a_table_replaces_its_arrays_only_through_install():
    _, (table, _) = _tables()
    with pytest.raises(AttributeError):
        table.arrays.rows = np.zeros((16, table.width), np.float32)
    with pytest.raises(DirectoryError, match="not arrays of a table"):
        table.arrays.install(weights=np.zeros(3))


def test_a_restore_and_an_eviction_republish():
    store, (bounded,) = _tables(1, max_resident_rows=64)
    table = EmbeddingTable(TableConfig("t", 4), 1, 0, 16, tableset=store)
    keys = np.arange(100, dtype=np.uint64)
    for start in range(0, 400, 50):
        bounded.pull(keys[:50] + np.uint64(start))  # evictions compact and rebuild the map
    table.load(keys, np.ones((100, table.width), np.float32))
    check_directory(store.directory)
    assert bounded.evicted > 0 and table.n_rows == 100
    assert np.array_equal(table.pull(keys[:3])[0], np.ones((3, table.width), np.float32))

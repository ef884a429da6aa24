"""NOTE [ps limits] and the aggregation timeout of NOTE [ps aggregation], on a
:class:`ShardServer` driven in-process (the same messages a client sends)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import ConfigError
from herald.ps.config import ShardLimits
from herald.ps.server import ShardServer
from herald.ps.store import ROW_OVERHEAD_BYTES
from herald.ps.table import FIRST_ROWS
from herald.ps.wire import PS
from tests.fakes import as_frames, shard_request
from tests.ps.test_step_message import _step_frames

_RID = iter(range(1, 1 << 30))


def _pull(server, keys, table=0):
    return shard_request(
        server, {"op": "pull", "rid": next(_RID), "cid": 1, "parts": [{"table": table}]}, [np.asarray(keys, np.uint64)]
    )


def _push(server, keys, grads, contributors, step=0, rank=0):
    keys = np.asarray(keys, np.uint64)
    return shard_request(
        server,
        {"op": "push_grad", "rid": next(_RID), "cid": 1, "step": step, "rank": rank, "parts": [{"table": 0}]},
        [keys, np.asarray(grads, np.float32), np.full(keys.shape[0], contributors, np.uint16)],
    )


def _declare(server, tables, workers=None):
    header = {"op": "declare", "rid": next(_RID), "cid": 1, "tables": [t.to_dict() for t in tables]}
    if workers is not None:
        header["workers"] = workers
    return shard_request(server, header)[0]


def test_limits_are_validated():
    with pytest.raises(ConfigError, match="max_dim"):
        ShardLimits(max_dim=0)
    with pytest.raises(ConfigError, match="65535"):
        ShardLimits(max_contributors=70_000)
    with pytest.raises(ConfigError, match="max_dim=4096"):
        ShardServer(0, 1, tables=[TableConfig("huge", 1 << 20)])


def test_too_many_keys_in_one_request_are_refused_before_any_change():
    server = ShardServer(0, 1, tables=[TableConfig("t", 4)], limits=ShardLimits(max_keys_per_request=100))
    h, _ = _pull(server, np.arange(101))
    assert not h["ok"] and "max_keys_per_request=100" in h["message"] and "101 keys" in h["message"]
    assert server.stats()["tables"]["t"]["rows"] == 0
    assert _pull(server, np.arange(100))[0]["ok"]


def test_dims_and_table_bytes_are_checked_without_overflow():
    server = ShardServer(0, 1, tables=[TableConfig("t", 4)])
    for dim in (4097, 1 << 20, 1 << 62):  # 2**62: row_width * 4 overflows int64, not Python ints
        big = TableConfig("big", dim, OptimizerConfig("adam"))
        h = _declare(server, [server.tables[0].cfg, big])
        assert not h["ok"] and h["error"] == "config" and "max_dim=4096" in h["message"], h
    assert len(server.tables) == 1
    limits = ShardLimits(max_dim=1 << 62, max_table_bytes=1 << 40)
    with pytest.raises(ConfigError, match="max_table_bytes"):
        ShardServer(0, 1, tables=[TableConfig("big", 1 << 62)], limits=limits)


def test_a_table_never_grows_past_max_table_bytes():
    row = 4 * 4  # dim 4, sgd: 16 bytes per row
    server = ShardServer(0, 1, tables=[TableConfig("t", 4)], limits=ShardLimits(max_table_bytes=100 * row))
    assert _pull(server, np.arange(80))[0]["ok"]
    h, _ = _pull(server, np.arange(80, 120))  # 40 unseen keys: 120 rows > 100
    assert not h["ok"] and "max_table_bytes=1600" in h["message"] and "'t'" in h["message"]
    assert server.stats()["tables"]["t"]["rows"] == 80
    keys = np.concatenate([np.arange(60), np.arange(80, 100), np.arange(80, 100)])  # 20 unseen, repeated
    assert _pull(server, keys)[0]["ok"]
    stats = server.stats()["tables"]["t"]
    assert stats["rows"] == 100 and stats["bytes"] <= 100 * row


def test_contributors_and_ranks_are_bounded_by_the_workers():
    server = ShardServer(0, 1, tables=[TableConfig("t", 2)])
    g = np.ones((3, 2), np.float32)
    h, _ = _push(server, [1, 2, 3], g, 65535)
    assert not h["ok"] and "max_contributors=1024" in h["message"]
    assert _declare(server, server.tables and [server.tables[0].cfg], workers=2)["ok"]
    h, _ = _push(server, [1, 2, 3], g, 3)
    assert not h["ok"] and "2 workers" in h["message"] and "contributors 3" in h["message"]
    h, _ = _push(server, [1, 2, 3], g, 1, rank=2)
    assert not h["ok"] and "rank 2" in h["message"]
    h = _declare(server, [server.tables[0].cfg], workers=3)
    assert not h["ok"] and "2 workers" in h["message"]
    assert server.stats()["tables"]["t"]["rows"] == 0 and server.stats()["open_aggregations"] == 0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradients_are_refused_and_nothing_is_stored(bad):
    server = ShardServer(0, 1, tables=[TableConfig("emb", 2, init="zeros")])
    _pull(server, [7])
    g = np.ones((3, 2), np.float32)
    g[2, 1] = bad
    for contributors in (1, 2):
        h, _ = _push(server, [7, 8, 9], g, contributors)
        assert not h["ok"] and h["error"] == "protocol", h
        assert "'emb'" in h["message"] and "key 9" in h["message"] and "NaN or infinity" in h["message"]
    stats = server.stats()
    assert stats["tables"]["emb"]["rows"] == 1 and stats["open_aggregations"] == 0
    assert np.array_equal(_pull(server, [7])[1][0], np.zeros((1, 2), np.float32))


def test_an_open_aggregation_is_aborted_after_its_timeout_and_named():
    """One rank declares 2 contributors and the other never pushes: the aggregation is
    aborted after aggregation_timeout_ms, the missing rank is named in stats, later
    pushes to that step are refused, and checkpoints work again."""
    server = ShardServer(
        0,
        1,
        tables=[TableConfig("t", 2)],
        limits=ShardLimits(aggregation_timeout_ms=5000),
        checkpoint_root="/nonexistent",
    )  # NOTE [ps admin ops]: the path below is inside it
    assert _declare(server, [server.tables[0].cfg], workers=2)["ok"]
    keys = np.arange(10)
    assert _push(server, keys, np.ones((10, 2)), 2, step=5, rank=0)[0]["ok"]
    assert server.stats()["open_aggregations"] == 10
    ckpt = {"op": "checkpoint", "rid": next(_RID), "cid": 1, "dir": "/nonexistent/never-written"}
    h, _ = shard_request(server, ckpt)
    assert not h["ok"] and "aggregations are open" in h["message"]
    assert server.expire_aggregations() == []  # not yet
    reports = server.expire_aggregations(time.monotonic() + 5.0)
    assert len(reports) == 1
    stats = server.stats()
    assert stats["open_aggregations"] == 0
    assert stats["counters"]["aggregations_aborted"] == 1 and stats["counters"]["aggregation_keys_aborted"] == 10
    (report,) = stats["aborted"]
    assert report["table"] == "t" and report["step"] == 5 and report["missing_ranks"] == [1]
    assert report["ranks_pushed"] == [0] and report["contributors"] == [2] and report["open_keys"] == 10
    h, _ = _push(server, keys, np.ones((10, 2)), 2, step=5, rank=1)  # the late rank
    assert not h["ok"] and "aborted" in h["message"] and "[1]" in h["message"]
    # rows were unmarked: a pull no longer counts pending keys; the next step aggregates normally
    _pull(server, keys)
    assert server.stats()["pull_pending_keys"] == 0
    assert _push(server, keys, np.ones((10, 2)), 2, step=6, rank=0)[0]["ok"]
    assert _push(server, keys, np.ones((10, 2)), 2, step=6, rank=1)[0]["applied"] == 10


def test_checkpoint_is_possible_again_after_an_abort(tmp_path):
    server = ShardServer(
        0, 1, tables=[TableConfig("t", 2)], limits=ShardLimits(aggregation_timeout_ms=1), checkpoint_root=tmp_path
    )
    assert _push(server, np.arange(4), np.ones((4, 2)), 2, step=0, rank=0)[0]["ok"]
    time.sleep(0.01)
    (report,) = server.expire_aggregations()
    assert "unknown" in report["missing_ranks"]  # workers never declared: says how to name them
    h, _ = shard_request(server, {"op": "checkpoint", "rid": next(_RID), "cid": 1, "dir": str(tmp_path)})
    assert h["ok"], h


def test_max_rows_bounds_resident_rows_and_counts_evictions():
    server = ShardServer(0, 1, tables=[TableConfig("t", 4)], limits=ShardLimits(max_rows=50))
    rng = np.random.default_rng(1)
    pulled = []
    for _ in range(40):
        keys = np.unique(rng.integers(0, 10_000, 30))
        h, arrays = _pull(server, keys)
        pulled.append(keys)
        assert h["op"] != "error" and arrays[0].shape[1] == 4
        assert server.stats()["tables"]["t"]["rows"] <= 50
    stats = server.stats()["tables"]["t"]
    assert stats["evicted_rows"] >= 40 * 25 - 50
    # NOTE [evictions read again]: each pull of a key evicted earlier is counted once
    evicted = np.setdiff1d(np.concatenate(pulled), server.tables[0].snapshot()[0].astype(np.int64))[:20]
    assert evicted.shape[0] == 20
    assert _pull(server, evicted)[0]["op"] != "error"
    assert server.stats()["tables"]["t"]["evicted_rows_read_again"] == stats["evicted_rows_read_again"] + 20
    with pytest.raises(ConfigError, match="max_rows"):
        ShardLimits(max_rows=-1)


# ------------------------------------------------------------------ rows, shard bytes, table count
def _push_rows(server, keys, rows, table=0, advance=None):
    keys = np.asarray(keys, np.uint64)
    header = {"op": "push_rows", "rid": next(_RID), "cid": 1, "parts": [{"table": table}]}
    arrays = [keys, np.asarray(rows, np.float32)]
    if advance is not None:  # NOTE [clock frames]: the clocked path stores rows through the same kernel
        header["advance"] = True
        arrays.append(np.full(keys.shape[0], advance, np.uint64))
    return shard_request(server, header, arrays)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("advance", [None, 1])
def test_non_finite_rows_are_refused_and_nothing_is_stored(bad, advance):
    server = ShardServer(0, 1, tables=[TableConfig("emb", 2, OptimizerConfig("adagrad"), init="zeros")])
    _pull(server, [7])
    before = _pull(server, [7])[1][0].copy()
    rows = np.ones((3, 4), np.float32)
    rows[2, 3] = bad  # in the optimizer state: the whole row is checked
    h, _ = _push_rows(server, [7, 8, 9], rows, advance=advance)
    assert not h["ok"] and h["error"] == "protocol", h
    assert "'emb'" in h["message"] and "key 9" in h["message"] and "NaN or infinity" in h["message"]
    assert server.stats()["tables"]["emb"]["rows"] == 1  # keys 8 and 9 not inserted, 7 not written
    assert np.array_equal(_pull(server, [7])[1][0], before)
    assert _push_rows(server, [7, 8, 9], np.ones((3, 4), np.float32), advance=advance)[0]["ok"]  # finite: stored
    assert np.array_equal(_pull(server, [8])[1][0], np.ones((1, 4), np.float32))


def test_non_finite_rows_in_a_step_message_are_refused_before_any_change():
    """NOTE [step messages]: a step's push_rows section goes through the same check."""
    server = ShardServer(0, 1, tables=[TableConfig("emb", 2, init="zeros")])
    rows = np.ones((2, 2), np.float32)
    rows[0, 0] = np.nan
    grads = ([0], [5], np.ones((1, 2), np.float32), np.array([1], np.uint16))
    ((peer, frames),) = server.receive(
        "w0", _step_frames(0, 0, 1, next(_RID), rows=([0, 0], [3, 4], rows), grads=grads)
    )
    h, _ = PS.unpack(as_frames(frames))
    assert peer == "w0" and not h["ok"] and "key 3" in h["message"] and "NaN or infinity" in h["message"]
    assert server.stats()["tables"]["emb"]["rows"] == 0  # neither the rows nor the gradient's key
    rows[0, 0] = 0.5
    ((_, frames),) = server.receive("w0", _step_frames(1, 0, 1, next(_RID), rows=([0, 0], [3, 4], rows), grads=grads))
    assert PS.unpack(as_frames(frames))[0]["ok"]
    assert np.array_equal(_pull(server, [3, 4])[1][0], rows)


def test_shard_bytes_bound_every_table_together():
    """max_shard_bytes: rows allocated over all tables (4 x width + 96 bytes each); growth
    past it and declares past it are refused before any change, naming the option."""
    row = 4 * 4 + ROW_OVERHEAD_BYTES  # dim 4, sgd
    limit = 3 * FIRST_ROWS * row  # three tables' first rows
    tables = [TableConfig("a", 4), TableConfig("b", 4)]
    server = ShardServer(0, 1, tables=tables, limits=ShardLimits(max_shard_bytes=limit))
    assert server.store.nbytes() == 2 * FIRST_ROWS * row
    assert _pull(server, np.arange(2 * FIRST_ROWS - 48))[0]["ok"]  # 'a' grows into the third table's share
    h, _ = _pull(server, np.arange(2 * FIRST_ROWS - 48, 2 * FIRST_ROWS + 100))  # 148 new rows: past the share
    assert not h["ok"] and f"max_shard_bytes={limit}" in h["message"] and "--max-shard-bytes" in h["message"], h
    assert "'a'" in h["message"] and server.stats()["tables"]["a"]["rows"] == 2 * FIRST_ROWS - 48
    h, _ = _push_rows(server, [1 << 40], np.ones((1, 4)), table=1)  # 'b' within its first rows: fine
    assert h["ok"], h
    h, _ = _pull(server, np.arange(FIRST_ROWS + 1), table=1)  # 'b' would grow: no room left
    assert not h["ok"] and "--max-shard-bytes" in h["message"] and server.stats()["tables"]["b"]["rows"] == 1
    h = _declare(server, [*tables, TableConfig("c", 4)])
    assert not h["ok"] and h["error"] == "config" and f"max_shard_bytes={limit}" in h["message"], h
    assert len(server.tables) == 2 and server.store.nbytes() <= limit
    assert np.array_equal(_pull(server, [1 << 40], table=1)[1][0], np.ones((1, 4), np.float32))
    assert _pull(server, np.arange(100))[0]["ok"]  # rows held are served as before


def test_the_number_of_tables_is_bounded():
    with pytest.raises(ConfigError, match="65536"):
        ShardLimits(max_tables=70_000)
    tables = [TableConfig(f"t{i}", 2) for i in range(3)]
    with pytest.raises(ConfigError, match="max_tables=2.*--max-tables"):
        ShardServer(0, 1, tables=tables, limits=ShardLimits(max_tables=2))
    server = ShardServer(0, 1, tables=tables[:2], limits=ShardLimits(max_tables=2))
    h = _declare(server, tables)
    assert not h["ok"] and h["error"] == "config" and "3 tables" in h["message"] and "--max-tables" in h["message"]
    assert len(server.tables) == 2 and _declare(server, tables[:2])["ok"]
    assert _pull(server, [1, 2], table=1)[0]["ok"]


def test_a_restore_is_held_to_the_shard_bytes_before_any_change(tmp_path):
    row = 4 * 4 + ROW_OVERHEAD_BYTES
    src = ShardServer(0, 1, tables=[TableConfig("a", 4)], checkpoint_root=tmp_path)
    assert _pull(src, np.arange(3000))[0]["ok"]
    h, _ = shard_request(src, {"op": "checkpoint", "rid": next(_RID), "cid": 1, "dir": str(tmp_path / "c")})
    assert h["ok"], h

    def restore(limit):
        server = ShardServer(
            0, 1, tables=[TableConfig("a", 4)], checkpoint_root=tmp_path, limits=ShardLimits(max_shard_bytes=limit)
        )
        return server, shard_request(
            server, {"op": "restore", "rid": next(_RID), "cid": 1, "dir": str(tmp_path / "c")}
        )[0]

    fits, reply = restore(3000 * row)  # the rows fit, their power-of-two arrays would not: exact arrays
    assert reply["ok"], reply["message"]
    assert fits.stats()["tables"]["a"]["rows"] == 3000 and fits.store.nbytes() <= 3000 * row
    assert np.array_equal(_pull(fits, np.arange(3000))[1][0], _pull(src, np.arange(3000))[1][0])
    small, reply = restore(2000 * row)
    assert not reply["ok"] and "max_shard_bytes" in reply["message"] and "--max-shard-bytes" in reply["message"]
    assert small.stats()["tables"]["a"]["rows"] == 0

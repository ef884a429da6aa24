"""NOTE [embedding clocks]: the PS's per-row global clock c_g (HET §3.3, §4.1), and NOTE
[clock frames]: clocks riding on pulls (the conditional pull) and on push_rows (advances)."""

from __future__ import annotations

import numpy as np
import pytest

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import ProtocolError
from herald.ps.server import ShardServer
from herald.ps.table import EmbeddingTable
from herald.ps.wire import PS, pack_clocks, unpack_clocks, valid_copies
from tests.fakes import shard_request

SGD = TableConfig("t", 4, OptimizerConfig("sgd", lr=0.1))
ADAGRAD = TableConfig("a", 4, OptimizerConfig("adagrad", lr=0.1))


def _keys(*ids):
    return np.array(ids, np.uint64)


def _clocks(table, keys):
    """c_g of ``keys`` read by a conditional pull without cached copies (every row fetched)."""
    c_g, rows, _ = table.pull_clocked(keys, np.zeros(0, np.uint64), 0)
    assert rows.shape == (keys.shape[0], table.width)
    return c_g


def _rows(table, n, value=1.0):
    return np.full((n, table.width), value, np.float32)


def test_each_applied_gradient_ticks_the_clock_once():
    t = EmbeddingTable(SGD, 0, seed=0)
    keys = _keys(1, 2, 3)
    g = np.ones((3, 4), np.float32)
    t.push_grad(keys, g, np.ones(3, np.uint16), step=0, rank=0)
    assert _clocks(t, keys).tolist() == [1, 1, 1]
    # keys 1, 2 shared by two workers: applied (and ticked) when the second contribution arrives
    t.push_grad(keys, g, np.array([2, 2, 1], np.uint16), step=1, rank=0)
    assert _clocks(t, keys).tolist() == [1, 1, 2]
    t.push_grad(_keys(1, 2), g[:2], np.array([2, 2], np.uint16), step=1, rank=1)
    assert _clocks(t, keys).tolist() == [2, 2, 2]
    assert _clocks(t, _keys(9)).tolist() == [0]  # an unseen row starts at 0


def test_push_rows_advances_and_rejects_bad_advances():
    t = EmbeddingTable(SGD, 0, seed=0)
    keys = _keys(5, 6)
    assert t.push_rows(keys, _rows(t, 2), np.array([3, 0], np.uint64)).tolist() == [3, 0]
    assert t.push_rows(keys, _rows(t, 2, 2.0), np.array([1, 7], np.uint64)).tolist() == [4, 7]
    assert t.push_rows(keys, _rows(t, 2)) is None  # a plain write-back: clocks unchanged
    assert _clocks(t, keys).tolist() == [4, 7]
    with pytest.raises(ProtocolError, match="clock advances must be uint64"):
        t.push_rows(keys, _rows(t, 2), np.array([1, 2], np.int64))
    with pytest.raises(ProtocolError, match="clock advances must be uint64"):
        t.push_rows(keys, _rows(t, 2), np.array([1, 2, 3], np.uint64))
    with pytest.raises(ProtocolError, match="appears twice"):
        t.push_rows(_keys(5, 5), _rows(t, 2), np.array([1, 1], np.uint64))
    assert _clocks(t, keys).tolist() == [4, 7]  # nothing was stored


def test_conditional_pull_sends_rows_only_of_copies_not_valid():
    t = EmbeddingTable(SGD, 0, seed=0)
    keys = _keys(1, 2, 3, 4, 5)
    t.push_rows(keys, np.arange(5 * t.width, dtype=np.float32).reshape(5, t.width), _keys(5, 5, 5, 9, 0))
    # s = 2: copies at c_c 3 (5 <= 5: valid), 2 (5 > 4: fetched), 7 (ahead of the PS: valid); keys 4, 5 unchecked
    c_g, rows, pending = t.pull_clocked(keys, _keys(3, 2, 7), 2)
    assert c_g.tolist() == [5, 5, 5, 9, 0] and pending == 0
    assert np.array_equal(rows, t.pull(keys[[1, 3, 4]])[0])  # the fetched ones, in key order
    c_g, rows, _ = t.pull_clocked(keys, _keys(5, 5, 5, 9, 0), 0)  # s = 0: only latest copies are valid
    assert rows.shape == (0, t.width)
    with pytest.raises(ProtocolError, match="cached clocks"):
        t.pull_clocked(keys[:2], _keys(1, 2, 3), 1)


def test_valid_copies_is_checkvalids_second_condition_without_overflow():
    top = np.uint64(2**64 - 1)
    c_c, c_g = np.array([0, 3, 5, top], np.uint64), np.array([2, 6, 1, top], np.uint64)
    assert valid_copies(c_c, c_g, 2).tolist() == [True, False, True, True]
    assert valid_copies(np.array([0], np.uint64), np.array([top], np.uint64), 2**62).tolist() == [False]


def test_clock_frames_are_narrow_and_widen_back():
    for top, dt in ((0, "|u1"), (255, "|u1"), (256, "<u2"), (2**16, "<u4"), (2**32, "<u8"), (2**64 - 1, "<u8")):
        c = np.array([1, top], np.uint64)
        packed = pack_clocks(c)
        assert packed.dtype.str == dt and np.array_equal(unpack_clocks(packed, "x", 2), c)
    assert pack_clocks(np.zeros(0, np.uint64)).dtype.str == "|u1"
    with pytest.raises(ProtocolError, match="clock frame"):
        unpack_clocks(np.zeros(2, np.int64), "x", 2)
    with pytest.raises(ProtocolError, match="clock frame"):
        unpack_clocks(np.zeros(3, np.uint8), "x", 2)
    assert unpack_clocks(np.zeros(1, np.uint8), "x", 2, prefix=True).dtype == np.uint64


def test_clocks_follow_their_rows_through_growth_and_lru_eviction():
    t = EmbeddingTable(SGD, 0, seed=0, capacity_rows=16, max_resident_rows=32)
    first = np.arange(20, dtype=np.uint64)
    t.push_rows(first, _rows(t, 20), first + np.uint64(100))
    t.pull(np.arange(20, 40, dtype=np.uint64))  # grows, then evicts the least recently used rows
    assert t.evicted > 0
    kept = t.row_keys[: t.n_rows]
    survivors = kept[kept < 20]
    assert survivors.size and np.array_equal(t.clocks[: t.n_rows][kept < 20], survivors + np.uint64(100))


# ------------------------------------------------------------------ the frames on a shard
def _ask(server, header, arrays):
    return shard_request(server, dict(header, cid=1), arrays)


def test_push_rows_advance_moves_c_g_and_read_clocks_replies_it():
    server = ShardServer(0, 1, tables=[SGD, ADAGRAD])
    keys = _keys(1, 2)
    t = server.tables[0]
    h, out = _ask(
        server,
        {"op": "push_rows", "rid": 1, "parts": [{"table": 0}], "advance": True},
        [keys, _rows(t, 2), np.array([4, 1], np.uint8)],
    )
    assert h["ok"] and out == [] and "parts" not in h
    assert _clocks(t, keys).tolist() == [4, 1]
    h, (c_g,) = _ask(
        server,
        {"op": "push_rows", "rid": 2, "parts": [{"table": 0}], "advance": True, "read_clocks": True},
        [keys, _rows(t, 2), np.array([300, 0], np.uint16)],
    )
    assert h["ok"] and c_g.dtype.str == "<u2" and c_g.tolist() == [304, 1]
    # a retried request is answered from the reply cache, clocks included, and not applied twice
    h, (again,) = _ask(
        server,
        {"op": "push_rows", "rid": 2, "parts": [{"table": 0}], "advance": True, "read_clocks": True},
        [keys, _rows(t, 2), np.array([300, 0], np.uint16)],
    )
    assert again.tolist() == [304, 1] and _clocks(t, keys).tolist() == [304, 1]
    # compressed rows (NOTE [wire compression]): the advance frame still ends each part
    a = server.tables[1]
    payload = np.ones((2, 4), np.float16)
    h, (c_g,) = _ask(
        server,
        {"op": "push_rows", "rid": 3, "parts": [{"table": 1}], "advance": True, "read_clocks": True, "wire": "fp16"},
        [keys, payload, np.full(2, 0.5, np.float32), np.ones((2, a.width - 4), np.float32), np.array([2, 3], np.uint8)],
    )
    assert h["ok"] and c_g.tolist() == [2, 3]
    assert np.array_equal(a.pull(keys)[0][:, :4], np.full((2, 4), 0.5, np.float32))


def test_conditional_pull_on_a_shard():
    server = ShardServer(0, 1, tables=[SGD])
    t = server.tables[0]
    keys = _keys(1, 2, 3)
    t.push_rows(keys, _rows(t, 3), _keys(10, 10, 10))
    h, (c_g, rows) = _ask(
        server, {"op": "pull", "rid": 1, "parts": [{"table": 0}], "staleness": 2}, [keys, np.array([8, 7], np.uint8)]
    )  # key 1 valid, key 2 not, key 3 unchecked
    assert h["ok"] and c_g.tolist() == [10, 10, 10] and c_g.dtype.str == "|u1"
    assert np.array_equal(rows, t.pull(keys[1:])[0])
    h, (plain,) = _ask(server, {"op": "pull", "rid": 2, "parts": [{"table": 0}]}, [keys])  # unchanged
    assert h["ok"] and plain.shape == (3, t.width)
    assert server.stats()["counters"]["pull_valid_keys"] == 1


@pytest.mark.parametrize(
    "header, arrays, match",
    [
        ({"op": "pull", "staleness": 1}, [_keys(1, 2), np.zeros(3, np.uint8)], "clock frame"),  # c_c > n
        ({"op": "pull", "staleness": 1}, [_keys(1, 2), np.zeros(2, np.float32)], "clock frame"),  # dtype
        ({"op": "pull", "staleness": 1}, [_keys(1, 2)], "frames"),  # no clocks
        ({"op": "pull", "staleness": -1}, [_keys(1, 2), np.zeros(2, np.uint8)], "staleness"),
        (
            {"op": "push_rows", "advance": True},
            [_keys(1, 2), np.ones((2, 4), np.float32), np.zeros(3, np.uint8)],
            "clock frame",
        ),
        (
            {"op": "push_rows", "advance": True},
            [_keys(1, 2), np.ones((2, 4), np.float32), np.zeros((2, 1), np.uint8)],
            "clock frame",
        ),
        (
            {"op": "push_rows", "advance": True},
            [_keys(1, 2), np.ones((2, 4), np.float32), np.zeros(2, np.int64)],
            "cannot send",
        ),
        ({"op": "push_rows", "advance": True}, [_keys(1, 2), np.ones((2, 4), np.float32)], "frames"),
        (
            {"op": "push_rows", "advance": 1},
            [_keys(1, 2), np.ones((2, 4), np.float32), np.zeros(2, np.uint8)],
            "true or false",
        ),
        ({"op": "push_rows", "read_clocks": True}, [_keys(1, 2), np.ones((2, 4), np.float32)], "needs advance"),
    ],
)
def test_malformed_clock_frames_are_refused(header, arrays, match):
    server = ShardServer(0, 1, tables=[SGD])
    if match == "cannot send":  # the PS protocol does not even carry it
        with pytest.raises(ProtocolError, match=match):
            PS.pack(header, arrays)
        return
    h, _ = _ask(server, dict(header, rid=1, parts=[{"table": 0}]), arrays)
    assert not h["ok"] and h["error"] == "protocol" and match in h["message"], h
    assert _clocks(server.tables[0], _keys(1, 2)).tolist() == [0, 0]  # nothing changed
    assert server.tables[0].pull(_keys(1, 2))[0][0, 0] != 1.0 or header["op"] == "pull"


def test_mutated_clock_frames_never_fail_inside_the_shard():
    """2,000 valid and mutated conditional pulls and advancing push_rows (dtypes, shapes, frame
    counts, flags): each is served or refused as a protocol error, never an internal one."""
    rng = np.random.default_rng(5)
    server = ShardServer(0, 1, tables=[SGD, ADAGRAD])
    dtypes = [np.uint8, np.uint16, np.uint32, np.uint64, np.int64, np.float32, np.int8]
    for rid in range(1, 2001):
        t = int(rng.integers(2))
        width = server.tables[t].width
        n = int(rng.integers(0, 6))
        keys = rng.choice(np.arange(50, dtype=np.uint64), n, replace=False)
        clock = rng.integers(0, 300, int(rng.integers(0, n + 2))).astype(dtypes[int(rng.integers(len(dtypes)))])
        if rng.random() < 0.5:
            header = {"op": "pull", "staleness": int(rng.choice([0, 2, 2**62, -1]))}
            arrays = [keys, clock]
        else:
            header = {"op": "push_rows", "advance": bool(rng.random() < 0.9), "read_clocks": bool(rng.random() < 0.5)}
            arrays = [keys, np.zeros((n, width + int(rng.random() < 0.1)), np.float32), clock]
        if rng.random() < 0.1:
            arrays = arrays[:-1]
        if rng.random() < 0.1:
            arrays = arrays + arrays
        if clock.dtype.str not in PS.dtypes:
            continue
        h, _ = _ask(server, dict(header, rid=rid, parts=[{"table": t}]), arrays)
        assert h["ok"] or h["error"] == "protocol", h
    assert server.stats()["counters"].get("errors_internal", 0) == 0

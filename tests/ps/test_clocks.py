"""NOTE [embedding clocks]: the PS's per-row global clock c_g (HET §3.3, §4.1)."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from herald.errors import ProtocolError
from herald.ps import OptimizerConfig, TableConfig
from herald.ps.server import ShardServer
from herald.ps.table import EmbeddingTable
from herald.ps.wire import PS

SGD = TableConfig("t", 4, OptimizerConfig("sgd", lr=0.1))


def _keys(*ids):
    return np.array(ids, np.uint64)


def _clocks(table, keys):
    return table.advance_clocks(keys, np.zeros(keys.shape[0], np.uint64))


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
    assert _clocks(t, _keys(9)).tolist() == [0]   # an unseen row starts at 0


def test_advance_adds_and_rejects_bad_advances():
    t = EmbeddingTable(SGD, 0, seed=0)
    keys = _keys(5, 6)
    assert t.advance_clocks(keys, np.array([3, 0], np.uint64)).tolist() == [3, 0]
    assert t.advance_clocks(keys, np.array([1, 7], np.uint64)).tolist() == [4, 7]
    assert t.advance_clocks(_keys(5, 5), np.array([1, 1], np.uint64)).tolist() == [6, 6]
    with pytest.raises(ProtocolError, match="clock advances must be uint64"):
        t.advance_clocks(keys, np.array([1, 2], np.int64))


def test_clocks_follow_their_rows_through_growth_and_lru_eviction():
    t = EmbeddingTable(SGD, 0, seed=0, capacity_rows=16, max_resident_rows=32)
    first = np.arange(20, dtype=np.uint64)
    t.advance_clocks(first, first + np.uint64(100))
    t.pull(np.arange(20, 40, dtype=np.uint64))           # grows, then evicts the least recently used rows
    assert t.evicted > 0
    kept = t.row_keys[:t.n_rows]
    survivors = kept[kept < 20]
    assert survivors.size and np.array_equal(t.clocks[:t.n_rows][kept < 20], survivors + np.uint64(100))


def _frames(frames):
    return [zmq.Frame(bytes(f.buffer if isinstance(f, zmq.Frame) else f)) for f in frames]


def test_clocks_op_on_a_shard():
    server = ShardServer(0, 1, tables=[SGD])
    keys = _keys(1, 2)
    req = PS.pack({"op": "clocks", "rid": 1, "cid": 1, "parts": [{"table": 0}]}, [keys, np.array([4, 0], np.uint64)])
    header, (got,) = PS.unpack(_frames(server.handle(_frames(req))))
    assert header["ok"] and got.dtype == np.uint64 and got.tolist() == [4, 0]
    bad = PS.pack({"op": "clocks", "rid": 2, "cid": 1, "parts": [{"table": 0}]}, [keys, np.zeros(3, np.uint64)])
    header, _ = PS.unpack(_frames(server.handle(_frames(bad))))
    assert not header["ok"] and "shape" in header["message"]

"""NOTE [clock frames] through the client and the worker's PS I/O: a conditional pull and
clock advances on push_rows against two in-process shards, requests split by shard and by
``max_keys_per_request``, and the bytes the executor counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from herald.contracts.job import JobSpec
from herald.contracts.plan import CachePlan, KeySet
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.ps import PSClient, compress
from herald.worker import psio
from herald.worker.clocks import advancing
from herald.worker.executor import PlanExecutor
from tests.fakes import InProcessPS

TABLES = (
    TableConfig("a", 4, OptimizerConfig("adagrad", lr=0.1)),
    TableConfig("b", 4, OptimizerConfig("adagrad", lr=0.2)),
)
WIDTH = TABLES[0].row_width


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two PS shards served in-process on threads; stopped afterwards."""
    with InProcessPS(TABLES, num_shards=2, workdir=tmp_path_factory.mktemp("ps")) as ps:
        yield ps.addresses


def _keys(n, table_of, base=1000):
    ids = np.arange(base, base + n, dtype=np.uint64) * np.uint64(7919)
    return KeySet(np.array([table_of(i) for i in range(n)], np.int32), ids)


@pytest.mark.parametrize("wire_dtype", ["fp32", "int8"])
def test_conditional_pull_and_advances_across_shards_and_split_requests(shards, wire_dtype):
    ps = PSClient(shards, TABLES, timeout_ms=5000, wire_dtype=wire_dtype)
    ps.max_keys_per_request = 3  # several requests per shard: each part keeps its checked keys first
    try:
        keys = _keys(24, lambda i: i % 2, base=2000 if wire_dtype == "fp32" else 3000)  # fresh clocks
        rows = np.random.default_rng(0).standard_normal((24, WIDTH)).astype(np.float32)
        rows[:, 4:] = np.abs(rows[:, 4:])  # Adagrad sums
        advance = np.arange(24, dtype=np.uint64) * np.uint64(100 if wire_dtype == "fp32" else 1)
        assert np.array_equal(psio.push_rows_async(ps, keys, rows, advance, read_clocks=True).wait(), advance)
        ps.take_traffic()
        plain = psio.pull_keys(ps, keys, WIDTH)
        plain_traffic = ps.take_traffic()
        # checked copies: every third key, at c_c = c_g - 2 (valid under s = 2) or c_g - 3 (not)
        checked = np.arange(24) % 3 == 0
        c_c = advance.copy()
        c_c[checked & (np.arange(24) % 2 == 0)] -= np.minimum(c_c[checked & (np.arange(24) % 2 == 0)], 2)
        c_c[checked & (np.arange(24) % 2 == 1)] -= np.minimum(c_c[checked & (np.arange(24) % 2 == 1)], 3)
        clocked = np.arange(24) % 4 != 1  # some keys go in a plain pull
        checked &= clocked
        got = psio.fetch_async(ps, keys, WIDTH, clocked, checked, c_c, 2)()
        valid = checked & (advance - c_c <= 2)
        assert valid.any() and (checked & ~valid).any()
        assert np.array_equal(got.fetched, ~valid)
        assert np.array_equal(got.clocks, np.where(clocked, advance, 0))
        assert np.array_equal(got.rows[~valid], plain[~valid])
        # the frames as they went: the checked copies' c_c out (one or two bytes a key: each clock
        # frame as narrow as its values allow), and back the clocks but no row of a valid copy
        traffic = ps.take_traffic()
        width = 1 if wire_dtype == "int8" else 2
        assert traffic["requests"] >= plain_traffic["requests"]  # a plain and a conditional pull, split
        row = compress.row_bytes(wire_dtype, 4) + 4 * (WIDTH - 4)
        assert traffic["bytes_received"] - plain_traffic["bytes_received"] <= (
            -row * int(valid.sum()) + width * int(clocked.sum()) + 2048
        )
    finally:
        ps.close()


def test_executor_counts_the_clock_frames(shards):
    job = JobSpec(tables=TABLES, dense_dim=1, ps=tuple(shards), timeout_ms=5000, capacity_rows=64, num_workers=1)
    ex = PlanExecutor(job, 0, 1, torch.device("cpu"), cache_device="cpu")
    try:
        keys = _keys(8, lambda i: 0)
        ex.cache.put(keys, np.ones((8, WIDTH), np.float32))
        plan = CachePlan(
            KeySet.empty(),
            np.zeros(0, bool),
            KeySet.empty(),
            KeySet.empty(),
            np.zeros(0, np.uint16),
            KeySet.empty(),
            keys,
        )
        ex.take_traffic()  # the declaration's
        wait = ex.push_plan(plan, write=advancing(ex.ps, np.full(8, 3, np.uint64), read_clocks=True))
        ex.wait_writes()
        clocked = ex.take_traffic()
        before = psio.pull_keys(ex.ps, keys, WIDTH)
        assert np.array_equal(before, np.ones((8, WIDTH), np.float32))
        assert wait().tolist() == [3] * 8 and wait().tolist() == [3] * 8  # the reply is kept
        ex.take_traffic()
        assert ex.push_plan(plan) is None  # a plain plan push: no clocks
        ex.wait_writes()
        plain = ex.take_traffic()
        # the frames as sent: the same requests plus one byte of advance per key (and header
        # fields) out, one byte of c_g per key back
        assert clocked["ps_requests"] == plain["ps_requests"] >= 1
        assert 8 <= clocked["bytes_pushed"] - plain["bytes_pushed"] <= 8 + 64 * plain["ps_requests"]
        assert 8 <= clocked["bytes_pulled"] - plain["bytes_pulled"] <= 8 + 64 * plain["ps_requests"]
        assert plain["bytes_pushed"] >= 8 * (2 + 8 + 4 * WIDTH)  # tables, keys and rows at least
    finally:
        ex.close()


def test_client_counts_compressed_frames_as_they_go(shards):
    """``take_traffic`` counts the frames sent and received: an fp16 client's pull brings
    half the embedding bytes of an fp32 one (the report's wire_bytes are these counts)."""
    keys = _keys(64, lambda i: i % 2, base=9000)
    got = {}
    for wire in ("fp32", "fp16"):
        ps = PSClient(shards, TABLES, timeout_ms=5000, wire_dtype=wire)
        try:
            ps.take_traffic()
            psio.pull_keys(ps, keys, WIDTH)
            got[wire] = ps.take_traffic()
        finally:
            ps.close()
    assert got["fp32"]["requests"] == got["fp16"]["requests"] == 2
    saved = got["fp32"]["bytes_received"] - got["fp16"]["bytes_received"]
    per_row = compress.row_bytes("fp32", 4) - compress.row_bytes("fp16", 4)  # the embedding part's bytes saved
    assert per_row > 0 and 64 * per_row - 128 <= saved <= 64 * per_row  # less the bigger headers

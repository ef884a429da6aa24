"""Step messages (NOTE [step messages] in herald/ps/stepped.py): one request per worker
per shard per step whose pulls a shard answers once every rank's writes of the step are
applied; in this thread (``ShardServer.receive``) and over real shards and sockets."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import ProtocolError
from herald.ps import LocalShards, PSClient
from herald.ps.config import ShardLimits
from herald.ps.server import ShardServer
from herald.ps.wire import PS
from tests.fakes import as_frames

TABLES = [TableConfig(f"t{i}", 4, OptimizerConfig("adagrad", lr=0.1)) for i in range(3)]


def _step_frames(step, rank, workers, rid, rows=None, grads=None, pull=None, cid=None, dense=None):
    """The frames of one step message (one flat part per section), as PSClient packs them."""
    sections, arrays = [], []
    for op, sec in (("push_rows", rows), ("push_grad", grads), ("pull", pull)):
        if sec is not None:
            tables, keys, *rest = sec
            frames = [np.asarray(tables, np.uint16), np.asarray(keys, np.uint64), *rest]
            sections.append({"op": op, "frames": len(frames)})
            arrays += frames
    if dense is not None:
        sections.append({"op": "dense", "frames": 1})
        arrays.append(dense)
    header = {
        "op": "step",
        "rid": rid,
        "cid": cid if cid is not None else 100 + rank,
        "step": step,
        "rank": rank,
        "workers": workers,
        "sections": sections,
    }
    return as_frames(PS.pack(header, arrays))


def _pull(server, tables, keys, rid=9999):
    header = {"op": "pull", "rid": rid, "cid": 1, "parts": [{"flat": True}]}
    h, arrays = PS.unpack(
        as_frames(
            server.handle(as_frames(PS.pack(header, [np.asarray(tables, np.uint16), np.asarray(keys, np.uint64)])))
        )
    )
    assert h["ok"], h
    return arrays[0]


def test_pulls_wait_for_every_rank_and_read_the_step_writes():
    """Rank 0's message is held (no reply) until rank 1's comes; then both get their pulls,
    read after both ranks' gradient (summed, 2 contributors) and row pushes were applied:
    the same rows a shard gives when the writes come as separate requests first."""
    ref, srv = ShardServer(0, 1, tables=TABLES, seed=1), ShardServer(0, 1, tables=TABLES, seed=1)
    keys = np.array([5, 6, 7], np.uint64)
    tabs = np.array([0, 1, 2], np.uint16)
    g0, g1 = np.full((3, 4), 0.5, np.float32), np.full((3, 4), -0.25, np.float32)
    two = np.full(3, 2, np.uint16)
    rows = np.ones((1, TABLES[0].row_width), np.float32)
    # the reference: the writes as their own requests, then a pull
    for rank, g in ((0, g0), (1, g1)):
        header = {
            "op": "push_grad",
            "rid": 1 + rank,
            "cid": 50 + rank,
            "step": 3,
            "rank": rank,
            "parts": [{"flat": True}],
        }
        assert PS.unpack(as_frames(ref.handle(as_frames(PS.pack(header, [tabs, keys, g, two])))))[0]["ok"]
    header = {"op": "push_rows", "rid": 3, "cid": 52, "parts": [{"flat": True}]}
    assert PS.unpack(as_frames(ref.handle(as_frames(PS.pack(header, [tabs[:1], np.array([9], np.uint64), rows])))))[0][
        "ok"
    ]
    want = _pull(ref, [0, 1, 2, 0], [5, 6, 7, 9])

    assert srv.receive("w0", _step_frames(3, 0, 2, 1, grads=(tabs, keys, g0, two), pull=([0, 1], [5, 6]))) == []
    replies = srv.receive(
        "w1", _step_frames(3, 1, 2, 1, rows=(tabs[:1], [9], rows), grads=(tabs, keys, g1, two), pull=([2, 0], [7, 9]))
    )
    assert [p for p, _ in replies] == ["w0", "w1"]
    got = [PS.unpack(as_frames(frames)) for _, frames in replies]
    assert all(h["ok"] and h["op"] == "step" for h, _ in got)
    assert np.array_equal(got[0][1][0], want[:2]) and np.array_equal(got[1][1][0], want[2:])
    assert srv.counters["steps_released"] == 1 and srv.counters["step_messages"] == 2
    barrier = srv.stats()["step_barrier"]  # NOTE [step barrier timing]: rank 1 came last
    assert barrier["released"] == 1 and barrier["last_rank"] == {"1": 1}
    assert 0 <= barrier["spread_ms_mean"] == barrier["spread_ms_max"] and barrier["release_ms_mean"] >= 0


def _push_rows(server, tables, keys, rows, rid):
    header = {"op": "push_rows", "rid": rid, "cid": 60, "parts": [{"flat": True}]}
    frames = [np.asarray(tables, np.uint16), np.asarray(keys, np.uint64), rows]
    assert PS.unpack(as_frames(server.handle(as_frames(PS.pack(header, frames)))))[0]["ok"]


def _rows(n, value):
    return np.full((n, TABLES[0].row_width), value, np.float32)


def test_a_pull_resolved_on_arrival_reads_the_rows_written_after_it_through_growth():
    """NOTE [pulls resolved on arrival]: rank 0's pull finds its slots when its message
    comes; rank 1's write-backs then insert 2,000 keys (table 0 grows past its first 1,024
    rows: its rows move to a new array) and overwrite the pulled keys. Rank 0 reads the
    rows written, as from a shard where the writes came first as their own request."""
    ref, srv = ShardServer(0, 1, tables=TABLES, seed=1), ShardServer(0, 1, tables=TABLES, seed=1)
    keys = np.arange(2000, dtype=np.uint64)
    _push_rows(ref, np.zeros(2000), keys, _rows(2000, 0.5), 1)
    want = _pull(ref, [0, 1, 0], [5, 6, 7])
    assert srv.receive("w0", _step_frames(0, 0, 2, 1, pull=([0, 1, 0], [5, 6, 7]))) == []
    replies = dict(srv.receive("w1", _step_frames(0, 1, 2, 1, rows=(np.zeros(2000), keys, _rows(2000, 0.5)))))
    assert srv.tables[0].rows.shape[0] >= 2048
    h, arrays = PS.unpack(as_frames(replies["w0"]))
    assert h["ok"] and np.array_equal(arrays[0], want) and np.all(arrays[0][[0, 2]] == 0.5)


def test_a_bounded_table_reads_a_held_pull_at_the_release():
    """With an LRU-bounded table (NOTE [bounded ps]) rows move when rows are evicted (the
    table is compacted), so a held pull is resolved at the release: rank 1's write-backs
    evict older rows, the rows of rank 0's pulled keys move down, and rank 0 reads them
    where they are, as a shard gives when the writes come first."""
    shards = [ShardServer(0, 1, tables=TABLES, seed=1, limits=ShardLimits(max_rows=600)) for _ in range(2)]
    for srv in shards:  # 200 keys least recently used, then keys 5 and 7
        _pull(srv, np.zeros(200), np.arange(1000, 1200), rid=1)
        _pull(srv, [0, 0], [5, 7], rid=2)
    ref, srv = shards
    new = np.arange(3000, 3500, dtype=np.uint64)
    _push_rows(ref, np.zeros(500), new, _rows(500, 0.5), 3)
    want = _pull(ref, [0, 0], [5, 7])
    assert srv.receive("w0", _step_frames(0, 0, 2, 3, pull=([0, 0], [5, 7]))) == []
    replies = dict(srv.receive("w1", _step_frames(0, 1, 2, 3, rows=(np.zeros(500), new, _rows(500, 0.5)))))
    assert srv.tables[0].evicted > 0
    h, arrays = PS.unpack(as_frames(replies["w0"]))
    assert h["ok"] and np.array_equal(arrays[0], want) and not np.any(arrays[0] == 0.5)


def test_the_step_barrier_times_the_wait_for_the_last_rank():
    """The spread a shard counts covers the time between the first and the last rank's
    message of a step (here at least the 30 ms rank 0 waits), and names the last rank."""
    srv = ShardServer(0, 1, tables=TABLES, seed=1)
    g = (np.array([0], np.uint16), np.array([5], np.uint64), np.ones((1, 4), np.float32), np.array([2], np.uint16))
    for step in range(2):
        first, last = (1, 0) if step else (0, 1)
        assert srv.receive("a", _step_frames(step, first, 2, 10 + step, grads=g)) == []
        time.sleep(0.03)
        assert len(srv.receive("b", _step_frames(step, last, 2, 10 + step, grads=g))) == 2
    barrier = srv.stats()["step_barrier"]
    assert barrier["released"] == 2 and barrier["last_rank"] == {"0": 1, "1": 1}
    assert barrier["spread_ms_max"] >= barrier["spread_ms_mean"] >= 30.0


def test_retry_while_held_is_readdressed_and_answered_once():
    """A repeated step request while held is not applied twice; its reply goes to the new
    routing id, and a repeat after the release is answered from the reply cache."""
    srv = ShardServer(0, 1, tables=TABLES, seed=1)
    g = (np.array([0], np.uint16), np.array([5], np.uint64), np.ones((1, 4), np.float32), np.array([2], np.uint16))
    assert srv.receive("a", _step_frames(0, 0, 2, 7, grads=g)) == []
    assert srv.receive("a2", _step_frames(0, 0, 2, 7, grads=g)) == []  # Lazy Pirate resend, new socket
    replies = srv.receive("b", _step_frames(0, 1, 2, 7, grads=g))
    assert sorted(p for p, _ in replies) == ["a2", "b"]
    assert srv.counters["push_grad_keys"] == 2 and srv.counters["duplicate_requests"] == 1
    again = srv.receive("a3", _step_frames(0, 0, 2, 7, grads=g))
    assert [p for p, _ in again] == ["a3"] and PS.unpack(as_frames(again[0][1]))[0]["ok"]


def test_bad_step_messages_are_refused_and_a_lost_rank_is_named(capsys):
    """Malformed sections and a rank at or above workers get error replies; a step whose
    other rank never comes is refused after aggregation_timeout_ms, naming that rank."""
    srv = ShardServer(0, 1, tables=TABLES, seed=1)
    bad = as_frames(
        PS.pack(
            {
                "op": "step",
                "rid": 1,
                "cid": 1,
                "step": 0,
                "rank": 0,
                "workers": 1,
                "sections": [{"op": "pull", "frames": 2}, {"op": "push_rows", "frames": 3}],
            }
        )
    )
    ((_, frames),) = srv.receive("x", bad)
    assert "section 1" in PS.unpack(as_frames(frames))[0]["message"]
    ((_, frames),) = srv.receive("x", _step_frames(0, 2, 2, 2))
    assert "rank 2 is not below workers=2" in PS.unpack(as_frames(frames))[0]["message"]
    assert srv.receive("x", _step_frames(5, 0, 2, 3, pull=([0], [1]))) == []
    ((peer, frames, kept),) = srv.steps.tick(now=10**9)
    assert kept is None  # an expired step's error reply is not kept for retries
    head = PS.unpack(as_frames(frames))[0]
    assert peer == "x" and not head["ok"] and "ranks [1]" in head["message"]
    assert "ranks [1]" in capsys.readouterr().err
    with pytest.raises(ProtocolError, match="receive"):
        srv.handle(_step_frames(6, 0, 2, 4))


def test_dense_slices_are_summed_in_rank_order_and_sent_to_every_rank():
    """NOTE [dense gradients on the shards]: the reply of every rank ends with the same
    sum, rank 0's slice plus rank 1's plus rank 2's in that order, whatever order the
    messages came in; the pulls before it are unchanged."""
    srv = ShardServer(0, 1, tables=TABLES, seed=1)
    rng = np.random.default_rng(3)
    dense = [(rng.standard_normal(1000) * 10.0 ** rng.integers(-6, 6, 1000)).astype(np.float32) for _ in range(3)]
    want = (dense[0] + dense[1]) + dense[2]
    assert not np.array_equal(want, (dense[2] + dense[1]) + dense[0]), "the order must matter for this data"
    assert srv.receive("w2", _step_frames(1, 2, 3, 1, dense=dense[2])) == []
    assert srv.receive("w0", _step_frames(1, 0, 3, 1, pull=([0], [5]), dense=dense[0])) == []
    replies = srv.receive("w1", _step_frames(1, 1, 3, 1, dense=dense[1]))
    got = {peer: PS.unpack(as_frames(frames)) for peer, frames in replies}
    assert sorted(got) == ["w0", "w1", "w2"]
    for peer, (head, arrays) in got.items():
        assert head["ok"] and head["dense"] == 1000 and np.array_equal(arrays[-1], want), peer
    assert np.array_equal(got["w0"][1][0], _pull(srv, [0], [5]))  # the pull, ahead of the sum


@pytest.mark.parametrize("second", [None, np.zeros(999, np.float32), np.zeros(1000, np.float16)])
def test_ranks_disagreeing_on_the_dense_gradient_all_get_errors(second):
    """A step where one rank sends no dense slice, a slice of another length, or not
    float32 (refused on its own), answers with errors: no rank may step with a partial sum."""
    srv = ShardServer(0, 1, tables=TABLES, seed=1)
    assert srv.receive("w0", _step_frames(1, 0, 2, 1, dense=np.ones(1000, np.float32))) == []
    replies = srv.receive("w1", _step_frames(1, 1, 2, 1, dense=second))
    heads = [PS.unpack(as_frames(frames))[0] for _, frames in replies]
    assert len(heads) == (1 if second is not None and second.dtype != np.float32 else 2)
    assert all(not h["ok"] and "dense" in h["message"] for h in heads)


def test_three_ranks_over_two_real_shards_get_one_dense_sum():
    """Three clients over 2 real shards: each gets the rank-order sum of the three dense
    gradients in place, both shards' slices, with its pulls; P = 1 leaves shard 0 no slice."""
    rng = np.random.default_rng(1)
    keys = np.arange(1, 50, dtype=np.uint64)
    with LocalShards(num_shards=2, tables=TABLES, seed=2) as shards:
        clients = [PSClient(shards.addresses, TABLES, timeout_ms=20_000) for _ in range(3)]
        try:
            for size in (1001, 1):
                dense = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
                want = (dense[0] + dense[1]) + dense[2]
                bufs, out = [d.copy() for d in dense], [None] * 3

                def run(r):
                    out[r] = np.array(
                        clients[r]
                        .step_async(size, r, 3, pull=((keys % 3).astype(np.uint16), keys), dense=bufs[r])
                        .wait()
                    )

                threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                assert all(np.array_equal(b, want) for b in bufs), size
                assert all(o is not None and o.shape == (keys.shape[0], TABLES[0].row_width) for o in out)
        finally:
            for c in clients:
                c.close()


@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_two_clients_over_real_shards_read_what_separate_requests_give(wire):
    """Two workers (threads, own clients) over 2 real shards, requests split by a small
    max_keys_per_request: each step's pulls equal the rows of a PS fed the same writes as
    separate requests followed by pulls."""
    rng = np.random.default_rng(0)
    keys = np.arange(1, 400, dtype=np.uint64) * 7919
    tabs = (keys % 3).astype(np.uint16)
    with LocalShards(num_shards=2, tables=TABLES, seed=2) as a, LocalShards(num_shards=2, tables=TABLES, seed=2) as b:
        clients = [PSClient(a.addresses, TABLES, timeout_ms=20_000, wire_dtype=wire) for _ in range(2)]
        ref = PSClient(b.addresses, TABLES, timeout_ms=20_000, wire_dtype=wire)
        for c in clients:
            c.max_keys_per_request = 60
        try:
            for step in range(3):
                grads = [rng.standard_normal((keys.shape[0], 4)).astype(np.float32) for _ in range(2)]
                contrib = np.full(keys.shape[0], 2, np.uint16)
                own = [keys[:200] + np.uint64(1 + r) for r in range(2)]  # each rank's plan pushes
                rows = [np.abs(rng.standard_normal((200, TABLES[0].row_width))).astype(np.float32) for _ in range(2)]
                pulls = [keys[::2] if r == 0 else np.concatenate([keys[1::2], own[0][:5]]) for r in range(2)]
                out = [None, None]

                def run(r):
                    out[r] = np.array(
                        clients[r]
                        .step_async(
                            step,
                            r,
                            2,
                            rows=(tabs[:200], own[r], rows[r]),
                            grads=(tabs, keys, grads[r], contrib),
                            pull=((pulls[r] % 3).astype(np.uint16), pulls[r]),
                        )
                        .wait()
                    )

                threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                for r in range(2):
                    ref.push_grad_flat_async(tabs, keys, grads[r], contrib, step, r).wait()
                    ref.push_rows_flat_async(tabs[:200], own[r], rows[r]).wait()
                for r in range(2):
                    want = ref.pull_flat_async((pulls[r] % 3).astype(np.uint16), pulls[r]).wait()
                    assert np.array_equal(out[r], want), (step, r)
        finally:
            for c in clients + [ref]:
                c.close()

"""Flat parts (NOTE [ps wire protocol]) and the flat kernels (NOTE [table directory]): a
shard serving every table of a request in one kernel call stores bit for bit what the
per-table path computes (``init_rows`` and ``apply_gradients`` per table, NOTE [ps
aggregation]'s rank-order sums), and the client's flat operations route, split and
reassemble keys of many tables (shards in this thread: no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import ConfigError, ProtocolError
from herald.ps import PSClient, apply_gradients, init_rows, shard_of
from herald.ps.server import ShardServer
from herald.ps.wire import PS
from tests.fakes import shard_request

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
SEED = 3


def _tables(name: str, n: int = 3, dim: int = 8) -> list[TableConfig]:
    """``n`` tables of one optimizer (one shape), each with its own hyperparameters and init."""
    return [
        TableConfig(
            f"{name}{i}",
            dim,
            OptimizerConfig(name, lr=0.05 * (i + 1), weight_decay=0.01 * i, initial_accumulator=0.1 * i),
            init=("uniform", "normal", "zeros")[i % 3],
        )
        for i in range(n)
    ]


def _flat(server, op, tables, keys, *arrays, rid, **header):
    h = dict(header, op=op, rid=rid, cid=1, parts=[{"flat": True}])
    return shard_request(server, h, [np.asarray(tables, np.uint16), np.asarray(keys, np.uint64), *arrays])


def _per_table(server, op, tables, keys, *arrays, rid, **header):
    """The same request as per-table parts (the layout before flat parts)."""
    tables, keys = np.asarray(tables), np.asarray(keys, np.uint64)
    parts, frames = [], []
    for t in np.unique(tables).tolist():
        m = tables == t
        parts.append({"table": t})
        frames += [keys[m], *[a[m] for a in arrays]]
    return shard_request(server, dict(header, op=op, rid=rid, cid=1, parts=parts), frames)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_flat_requests_store_what_the_per_table_path_computes(name):
    """Random steps of 3 ranks over 3 tables, keys of all tables interleaved in one flat
    part, contributors 1..3, random arrival orders: every row equals the per-table
    reference bit for bit, and a shard fed the same requests as per-table parts agrees."""
    cfgs = _tables(name)
    rng = np.random.default_rng(11)
    flat, per = ShardServer(0, 1, tables=cfgs, seed=SEED), ShardServer(0, 1, tables=cfgs, seed=SEED)
    universe = {t: rng.choice(np.arange(1, 10**6, dtype=np.uint64), 60, replace=False) for t in range(3)}
    ref = {t: dict(zip(universe[t].tolist(), init_rows(cfgs[t], t, universe[t], SEED))) for t in range(3)}
    rid = iter(range(1, 10**6))
    for step in range(6):
        pushes = {}  # rank -> {(t, key): grad}
        for r in range(3):
            pushes[r] = {
                (t, int(k)): rng.standard_normal(8).astype(np.float32)
                for t in range(3)
                for k in rng.choice(universe[t], 25, replace=False)
            }
        contributors = {}
        for r in range(3):
            for tk in pushes[r]:
                contributors[tk] = contributors.get(tk, 0) + 1
        for r in rng.permutation(3).tolist():
            items = list(pushes[r].items())
            order = rng.permutation(len(items))  # tables interleaved, keys in any order
            tables = np.array([items[i][0][0] for i in order])
            keys = np.array([items[i][0][1] for i in order], np.uint64)
            grads = np.stack([items[i][1] for i in order])
            contrib = np.array([contributors[items[i][0]] for i in order], np.uint16)
            for server, send in ((flat, _flat), (per, _per_table)):
                h, _ = send(server, "push_grad", tables, keys, grads, contrib, rid=next(rid), step=step, rank=r)
                assert h["ok"], h
        for tk in contributors:  # the reference: rank-order sum from 0, one application per (key, step)
            total = np.zeros(8, np.float32)
            for r in range(3):
                if tk in pushes[r]:
                    total += pushes[r][tk]
            row = ref[tk[0]][tk[1]][None, :].copy()
            apply_gradients(row, total[None, :], cfgs[tk[0]])
            ref[tk[0]][tk[1]] = row[0]
        if step == 3:  # a write-back in the middle, also flat
            tables = np.repeat(np.arange(3), 5)
            keys = np.concatenate([universe[t][:5] for t in range(3)])
            rows = rng.standard_normal((15, cfgs[0].row_width)).astype(np.float32)
            rows[:, 8:] = np.abs(rows[:, 8:])
            for server, send in ((flat, _flat), (per, _per_table)):
                assert send(server, "push_rows", tables, keys, rows, rid=next(rid))[0]["ok"]
            for t, k, row in zip(tables.tolist(), keys.tolist(), rows):
                ref[t][k] = row.copy()
    tables = np.repeat(np.arange(3), 60)
    keys = np.concatenate([universe[t] for t in range(3)])
    h, (got,) = _flat(flat, "pull", tables, keys, rid=next(rid))
    h2, (got2,) = _flat(per, "pull", tables, keys, rid=next(rid))
    want = np.stack([ref[t][k] for t, k in zip(tables.tolist(), keys.tolist())])
    assert h["ok"] and np.array_equal(got, want) and np.array_equal(got2, want)
    assert flat.stats()["open_aggregations"] == 0


def test_flat_parts_check_shapes_tables_and_keys_before_any_change():
    sgd, ada = _tables("sgd", 2), _tables("adagrad", 1)
    server = ShardServer(0, 2, tables=sgd + ada, seed=SEED)
    keys = np.arange(200, dtype=np.uint64)
    mine = {t: keys[shard_of(t, keys, 2) == 0][:6] for t in range(3)}
    other = keys[shard_of(0, keys, 2) == 1][:1]
    g = np.ones((4, 8), np.float32)
    rid = iter(range(1, 1000))
    # the same id in two tables is two keys; a (table, key) twice is refused
    same = np.array([mine[0][0], mine[1][0]], np.uint64) if mine[0][0] == mine[1][0] else None
    if same is not None:
        assert _flat(server, "push_grad", [0, 1], same, g[:2], np.ones(2, np.uint16), rid=next(rid), step=0, rank=0)[0][
            "ok"
        ]
    h, _ = _flat(
        server,
        "push_grad",
        [0, 1, 0],
        [mine[0][1], mine[1][1], mine[0][1]],
        g[:3],
        np.ones(3, np.uint16),
        rid=next(rid),
        step=0,
        rank=0,
    )
    assert not h["ok"] and "appears twice" in h["message"]
    cases = [
        (("pull", [0, 2], [mine[0][2], mine[2][2]]), "row width"),  # adagrad has another shape
        (("pull", [0, 3], [mine[0][2], mine[0][3]]), "unknown table"),
        (("pull", [0, 0], [mine[0][2], other[0]]), "belongs to shard 1"),
        (("push_grad", [0, 0], mine[0][2:4], np.ones((2, 4), np.float32), np.ones(2, np.uint16)), "shape"),
    ]
    before = server.stats()["tables"]
    for (op, tables, ks, *arrays), match in cases:
        h, _ = _flat(server, op, tables, ks, *arrays, rid=next(rid), step=1, rank=0)
        assert not h["ok"] and h["error"] == "protocol" and match in h["message"], (op, h)
    assert server.stats()["tables"] == before  # nothing inserted
    bad = {"op": "pull", "rid": next(rid), "cid": 1, "parts": [{"flat": True}]}
    h, _ = shard_request(server, bad, [np.zeros(2, np.uint32), mine[0][:2]])
    assert not h["ok"] and "tables frame" in h["message"]
    h, _ = shard_request(server, dict(bad, rid=next(rid), parts=[{"flat": True, "table": 0}]), [mine[0][:2]])
    assert not h["ok"] and "must be a map" in h["message"]
    # two flat parts of two shapes in one request; a table in two parts of a push is refused
    h, (a, b) = shard_request(
        server,
        {"op": "pull", "rid": next(rid), "cid": 1, "parts": [{"flat": True}, {"flat": True}]},
        [np.zeros(2, np.uint16), mine[0][:2], np.full(2, 2, np.uint16), mine[2][:2]],
    )
    assert h["ok"] and a.shape == (2, sgd[0].row_width) and b.shape == (2, ada[0].row_width)
    h, _ = shard_request(
        server,
        {"op": "push_rows", "rid": next(rid), "cid": 1, "parts": [{"flat": True}, {"table": 0}]},
        [np.zeros(1, np.uint16), mine[0][4:5], np.ones((1, 8), np.float32), mine[0][5:6], np.ones((1, 8), np.float32)],
    )
    assert not h["ok"] and "two parts" in h["message"]


def test_a_multi_part_push_grad_is_checked_whole_before_any_part_applies():
    cfgs = _tables("sgd", 2) + _tables("adam", 1)
    server = ShardServer(0, 1, tables=cfgs, seed=SEED)
    keys = np.arange(1, 5, dtype=np.uint64)
    before = _flat(server, "pull", [0] * 4, keys, rid=1)[1][0].copy()
    g8, g_bad = np.ones((4, 8), np.float32), np.ones((4, 8), np.float32)
    g_bad[3, 0] = np.nan
    header = {"op": "push_grad", "rid": 2, "cid": 1, "step": 0, "rank": 0, "parts": [{"flat": True}, {"table": 2}]}
    h, _ = shard_request(
        server, header, [np.zeros(4, np.uint16), keys, g8, np.ones(4, np.uint16), keys, g_bad, np.ones(4, np.uint16)]
    )
    assert not h["ok"] and "NaN" in h["message"]
    assert np.array_equal(_flat(server, "pull", [0] * 4, keys, rid=3)[1][0], before)  # part 1 not applied
    h, _ = shard_request(
        server,
        dict(header, rid=4),
        [np.zeros(4, np.uint16), keys, g8, np.full(4, 2, np.uint16), keys, g8, np.ones(4, np.uint16)],
    )
    assert h["ok"] and h["applied"] == 4 and server.stats()["open_aggregations"] == 4


# ------------------------------------------------------------------ the client, shards in this thread
def _loopback(servers, tables, **kw) -> PSClient:
    """A PSClient whose requests go straight to ``servers[shard].handle`` (no sockets)."""
    client = PSClient(
        [f"inproc://flat-test-{id(servers)}-{i}" for i in range(len(servers))], tables, declare=False, **kw
    )
    client.link.post = lambda req: client.link.accept(servers[req.shard].handle(req.frames))
    return client


@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_client_flat_ops_route_split_and_reassemble(wire):
    cfgs = _tables("rowwise_adagrad", 4)
    servers = [ShardServer(s, 3, tables=cfgs, seed=SEED) for s in range(3)]
    client = _loopback(servers, cfgs, wire_dtype=wire)
    client.max_keys_per_request = 7  # several requests per shard
    rng = np.random.default_rng(5)
    tables = rng.integers(0, 4, 50)
    keys = rng.integers(0, 1 << 40, 50).astype(np.uint64)
    got = client.pull_flat_async(tables, keys).wait()
    by_table = client.pull_async({t: keys[tables == t] for t in range(4)}).wait()
    for t in range(4):
        assert np.array_equal(got[tables == t], by_table[t])
    grads = rng.standard_normal((50, 8)).astype(np.float32)
    uniq = np.unique(np.stack([tables, keys.astype(np.int64)]), axis=1).shape[1] == 50
    assert uniq
    assert client.push_grad_flat_async(tables, keys, grads, np.ones(50, np.uint16), step=0, rank=0).wait() == 50
    after = client.pull_flat_async(tables, keys).wait()
    assert not np.array_equal(after[:, :8], got[:, :8])
    # a conditional pull: checked keys whose copy is still valid are not sent
    checked = np.arange(50) % 2 == 0
    c_g, fetched, rows, _ = client.pull_clocked_flat_async(tables, keys, checked, np.ones(50, np.uint64), 0)[0].wait()
    assert c_g.tolist() == [1] * 50 and fetched.tolist() == (~checked).tolist()
    assert np.array_equal(rows[fetched], after[fetched])
    with pytest.raises(ConfigError):
        client.pull_flat_async(np.full(2, 9), keys[:2])
    with pytest.raises(ProtocolError, match="appears twice"):
        client.push_rows_flat_async([0, 0], [keys[0], keys[0]], np.ones((2, cfgs[0].row_width), np.float32)).wait()


def test_client_sends_one_flat_part_per_shard_with_tables_grouped():
    cfgs = _tables("sgd", 5)
    server = ShardServer(0, 1, tables=cfgs, seed=SEED)
    client = _loopback([server], cfgs)
    seen = []
    post = client.link.post

    def spy(req):
        header = PS.unpack_header(req.frames[0])
        seen.append((header["parts"], np.frombuffer(memoryview(req.frames[1]), np.uint16).copy()))
        post(req)

    client.link.post = spy
    tables = np.array([3, 1, 3, 0, 1, 4, 0])
    rows = client.pull_flat_async(tables, np.arange(7, dtype=np.uint64)).wait()
    assert rows.shape == (7, 8) and len(seen) == 1
    parts, sent = seen[0]
    assert parts == [{"flat": True}] and sent.tolist() == sorted(tables.tolist())
    assert rows.flags.owndata  # reordered into key order
    rows2 = client.pull_flat_async(np.sort(tables), np.arange(7, dtype=np.uint64)).wait()
    assert not rows2.flags.owndata  # grouped already, one shard: a view of the reply frame

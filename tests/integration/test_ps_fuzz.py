"""Fuzz a live shard with 10,000 random and mutated messages (NOTE [ps wire protocol]):
every message gets a reply, the shard keeps serving, and known rows stay unchanged."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
import zmq

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.ps import LocalShards, PSClient, shard_of
from herald.ps.wire import PS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TABLES = [TableConfig("a", 8, OptimizerConfig("adagrad")), TableConfig("b", 4, OptimizerConfig("adam"))]
N_MESSAGES = 10_000
SAFE_OPS = ["pull", "push_grad", "push_rows", "stats", "ping"]  # never shutdown/checkpoint/restore/declare


def _own(table: int, keys: np.ndarray) -> np.ndarray:
    return keys[shard_of(table, keys, 2) == 0]


def _valid(rng: random.Random, fuzz_keys: list[np.ndarray], rid: int):
    op = rng.choice(SAFE_OPS)
    t = rng.randrange(2)
    dim, width = TABLES[t].dim, TABLES[t].row_width
    keys = fuzz_keys[t][: rng.randrange(1, 40)]
    n = keys.size
    header = {"op": op, "rid": rid, "cid": 7, "parts": [{"table": t}], "step": rng.randrange(3), "rank": 0}
    arrays = {
        "pull": [keys],
        "push_grad": [keys, np.ones((n, dim), np.float32), np.ones(n, np.uint16)],
        "push_rows": [keys, np.zeros((n, width), np.float32)],
    }.get(op, [])
    if arrays and rng.random() < 0.5:  # a flat part (NOTE [ps wire protocol]): the tables frame first
        tables = np.full(n, t, np.uint16)
        if rng.random() < 0.1:
            tables[rng.randrange(n)] = rng.choice([1 - t, 7, 65535])  # another shape, or unknown
        header["parts"] = [{"flat": True}]
        arrays = [tables] + arrays
    return header, arrays


def _mutate(rng: random.Random, header: dict, arrays: list) -> list[bytes]:
    frames = [bytes(memoryview(f)) for f in PS.pack(header, arrays)]
    kind = rng.randrange(10)
    if kind == 0:  # pure garbage
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
    if kind == 1:  # flip bytes in the header
        h = bytearray(frames[0])
        for _ in range(rng.randrange(1, 4)):
            h[rng.randrange(len(h))] = rng.randrange(256)
        frames[0] = bytes(h)
    elif kind == 2:  # replace a header field by a wrong value
        h = msgpack.unpackb(frames[0])
        field = rng.choice(["op", "rid", "cid", "parts", "arrays", "v", "step", "rank"])
        h[field] = rng.choice(
            [
                None,
                -1,
                2**63,
                "x",
                [],
                {},
                [[1]],
                3.5,
                "shutdownx",
                [{"table": 99}],
                [{"table": -1}],
                [["<u8", [5]]],
                [["<f4", [1, 2, 3]]],
                1,
                2,
                True,
                [[[1], [2]]],
                [["<u8", [2**40]]],
                [["<u8", [2**39, 2**39]]],
            ]
        )
        frames[0] = msgpack.packb(h)
    elif kind == 3 and len(frames) > 1:  # drop a frame
        del frames[rng.randrange(1, len(frames))]
    elif kind == 4:  # extra frame
        frames.append(rng.randbytes(rng.randrange(0, 32)))
    elif kind == 5 and len(frames) > 1:  # truncate or extend an array frame
        i = rng.randrange(1, len(frames))
        frames[i] = frames[i][: -rng.randrange(1, 9)] if rng.random() < 0.5 else frames[i] + b"\0" * 4
    elif kind == 6 and len(frames) > 1:  # wrong dtype/shape in the descriptor, sizes kept
        h = msgpack.unpackb(frames[0])
        i = rng.randrange(len(h["arrays"]))
        dt, shape = h["arrays"][i]
        h["arrays"][i] = [rng.choice(sorted(PS.dtypes)), list(reversed(shape)) if rng.random() < 0.5 else shape]
        frames[0] = msgpack.packb(h)
    elif kind == 7:  # keys of another shard / random keys (valid shape)
        if len(frames) > 1:
            frames[1] = rng.randbytes(len(frames[1]))
    elif kind == 8:  # random bytes in an array frame (may be valid: then it is a real op)
        if len(frames) > 2:
            i = rng.randrange(2, len(frames))
            frames[i] = rng.randbytes(len(frames[i]))
    else:  # untouched valid message
        pass
    return frames


def test_fuzz_10000_messages_keep_the_shard_serving():
    with LocalShards(num_shards=2, tables=TABLES, seed=5) as sh:
        client = PSClient(sh.addresses, TABLES, timeout_ms=10_000)
        known = {t: _own(t, np.arange(0, 3000, dtype=np.uint64)) for t in range(2)}
        client.push_grad_async(
            {
                t: (k, np.ones((k.size, TABLES[t].dim), np.float32), np.ones(k.size, np.uint16))
                for t, k in known.items()
            },
            step=0,
            rank=0,
        ).wait()
        before = client.pull_async(known).wait()
        fuzz_keys = [_own(t, np.arange(10**6, 10**6 + 400, dtype=np.uint64)) for t in range(2)]

        rng = random.Random(1234)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(sh.addresses[0])
        replies = errors = 0
        try:
            for start in range(0, N_MESSAGES, 250):
                for i in range(start, start + 250):
                    header, arrays = _valid(rng, fuzz_keys, i)
                    sock.send_multipart(_mutate(rng, header, arrays))
                for _ in range(250):
                    assert sock.poll(20_000), f"shard stopped answering after {replies} replies"
                    frames = sock.recv_multipart()
                    h = msgpack.unpackb(frames[0])
                    replies += 1
                    errors += not h["ok"]
                    if not h["ok"]:
                        assert h["error"] in ("protocol", "config"), h
        finally:
            sock.close()
        assert replies == N_MESSAGES and errors > N_MESSAGES // 3
        assert sh.procs[0].poll() is None
        after = client.pull_async(known).wait()  # still answers correctly
        for t in known:
            assert np.array_equal(after[t], before[t])
        stats = client.stats()[0]
        assert stats["counters"]["errors"] >= errors and "errors_internal" not in stats["counters"]
        client.close()

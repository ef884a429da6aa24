"""NOTE [ps wire protocol]: the PS protocol over herald.wire, and the server's error replies."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from herald.contracts.tables import TableConfig
from herald.errors import ProtocolError
from herald.ps import shard_of
from herald.ps.server import ShardServer
from herald.ps.wire import CLOCK_DTYPES, PART_FRAMES, PS, put_rows
from tests.fakes import as_frames, shard_request


def test_round_trip_is_zero_copy_views():
    keys = np.arange(5, dtype=np.uint64)
    grads = np.ones((5, 3), np.float32)
    msg = PS.pack({"op": "x"}, [keys, grads])
    header = PS.unpack_header(msg[0])
    frames = as_frames(msg[1:])
    a, b = PS.unpack_arrays(header, frames)
    assert a.dtype == np.uint64 and np.array_equal(a, keys) and b.shape == (5, 3)
    assert np.shares_memory(a, np.frombuffer(frames[0].buffer, np.uint8))


def test_part_frames_use_the_protocol_dtypes():
    payloads = {"<f2", "<u2", "|i1"}  # NOTE [wire compression]
    assert {dt for spec in PART_FRAMES.values() for _, dt in spec} | payloads | set(CLOCK_DTYPES) == PS.dtypes


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 1, "op": "x", "arrays": []}),
        msgpack.packb({"v": PS.version, "op": "x", "arrays": [["<f8", [3]]]}),
        msgpack.packb({"v": PS.version, "op": "x", "arrays": [["<u8", [-1]]]}),
        msgpack.packb({"v": PS.version, "op": "x", "arrays": [["<u8", [1, 2, 3]]]}),
        msgpack.packb({"v": PS.version, "op": "x", "arrays": "no"}),
        msgpack.packb({"v": PS.version, "op": "x", "frames": []}),
    ],
)
def test_bad_headers_raise(bad):
    with pytest.raises(ProtocolError, match="ps: "):
        PS.unpack_header(bad)


def test_pack_refuses_dtypes_the_ps_does_not_carry():
    with pytest.raises(ProtocolError, match="cannot send"):
        PS.pack({"op": "pull"}, [np.zeros(3, np.int64)])


def test_frame_sizes_must_match_header():
    header = PS.unpack_header(PS.pack({"op": "x"}, [np.zeros(4, np.uint64)])[0])
    with pytest.raises(ProtocolError, match="bytes"):
        PS.unpack_arrays(header, as_frames([b"\0" * 31]))
    with pytest.raises(ProtocolError, match="frames"):
        PS.unpack_arrays(header, [])


def test_reply_rows_go_back_in_key_order_and_a_bad_frame_is_refused():
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    out = np.zeros((5, 3), np.float32)
    put_rows(out, np.array([4, 0, 2, 1]), rows, "pull reply")
    assert out[[4, 0, 2, 1]].tolist() == rows.tolist() and out[3].tolist() == [0, 0, 0]
    whole = np.zeros((4, 3), np.float32)
    put_rows(whole, None, rows, "pull reply")
    assert np.array_equal(whole, rows)
    # a shard's frame of another width, length or dtype never reaches the kernel (no bounds checks)
    for bad in (rows[:, :2], rows[:3], rows.view(np.uint32)):
        with pytest.raises(ProtocolError, match=r"pull reply: rows must be float32 \[4, 3\]"):
            put_rows(out, np.array([4, 0, 2, 1]), bad, "pull reply")


def test_server_rejects_and_keeps_state():
    t = TableConfig("t", 4)
    server = ShardServer(0, 2, tables=[t], seed=1)
    keys = np.arange(100, dtype=np.uint64)
    mine = keys[shard_of(0, keys, 2) == 0]
    other = keys[shard_of(0, keys, 2) == 1]
    h, (rows,) = shard_request(server, {"op": "pull", "rid": 1, "cid": 1, "parts": [{"table": 0}]}, [mine])
    assert h["ok"] and rows.shape == (mine.size, 4)
    cases = [
        ({"op": "pull", "rid": 2, "cid": 1, "parts": [{"table": 0}]}, [other], "belongs to shard 1"),
        ({"op": "pull", "rid": 3, "cid": 1, "parts": [{"table": 9}]}, [mine], "unknown table"),
        ({"op": "fly", "rid": 4, "cid": 1}, [], "unknown op"),
        ({"op": "pull", "rid": 5, "cid": 1, "parts": [{"table": 0}]}, [mine.astype(np.float32)], "must be"),
        (
            {"op": "push_rows", "rid": 6, "cid": 1, "parts": [{"table": 0}]},
            [mine, np.zeros((mine.size, 5), np.float32)],
            "shape",
        ),
        (
            {"op": "push_grad", "rid": 7, "cid": 1, "step": 0, "rank": 0, "parts": [{"table": 0}]},
            [mine, np.zeros((mine.size, 4), np.float32)],
            "frames",
        ),
        ({"op": "declare", "rid": 8, "cid": 1, "tables": [{"name": "t", "dim": 5}]}, [], "conflicting"),
    ]
    for header, arrays, match in cases:
        h, _ = shard_request(server, header, arrays)
        assert not h["ok"] and match in h["message"], (header, h)
        assert h["rid"] == header["rid"]
    h, (rows2,) = shard_request(server, {"op": "pull", "rid": 9, "cid": 1, "parts": [{"table": 0}]}, [mine])
    assert np.array_equal(rows, rows2)
    assert server.stats()["counters"]["errors"] == len(cases)


def test_repeated_mutating_request_is_answered_from_the_reply_cache():
    t = TableConfig("t", 2)
    server = ShardServer(0, 1, tables=[t])
    keys = np.arange(3, dtype=np.uint64)
    push = {"op": "push_grad", "rid": 11, "cid": 42, "step": 0, "rank": 0, "parts": [{"table": 0}]}
    arrays = [keys, np.ones((3, 2), np.float32), np.ones(3, np.uint16)]
    assert shard_request(server, push, arrays)[0]["applied"] == 3
    assert shard_request(server, push, arrays)[0]["applied"] == 3  # retry: same reply, not applied twice
    assert server.stats()["counters"]["duplicate_requests"] == 1
    assert server.stats()["counters"]["rows_updated"] == 3


def test_reply_cache_keeps_only_replies_a_client_may_still_retry():
    # NOTE [reply cache]: done_below releases a client's replies, and a late copy of a
    # request below it is dropped, never applied again
    server = ShardServer(0, 1, tables=[TableConfig("t", 2)])
    keys = np.arange(3, dtype=np.uint64)
    arrays = [keys, np.ones((3, 2), np.float32), np.ones(3, np.uint16)]

    def push(rid, done_below, cid=42):
        return {
            "op": "push_grad",
            "rid": rid,
            "cid": cid,
            "step": rid,
            "rank": 0,
            "done_below": done_below,
            "parts": [{"table": 0}],
        }

    for rid in range(1, 6):
        assert shard_request(server, push(rid, rid), arrays)[0]["applied"] == 3
    assert server.stats()["replies_kept"] == 1  # rid 5's: rids 1-4 were released
    shard_request(server, push(1, 1, cid=7), arrays)  # another client's is kept beside it
    assert server.stats()["replies_kept"] == 2
    updated = server.stats()["counters"]["rows_updated"]
    assert shard_request(server, push(5, 5), arrays)[0]["applied"] == 3  # a retry: answered from the cache
    assert server.receive(b"peer", PS.pack(push(2, 2), arrays)) == []  # a late copy of an answered request
    counters = server.stats()["counters"]
    assert counters["rows_updated"] == updated and counters["duplicate_requests"] == 2
    h, _ = shard_request(server, push(6, -1), arrays)
    assert not h["ok"] and "done_below" in h["message"]


def test_server_answers_another_version_with_the_expected_one():
    server = ShardServer(0, 1, tables=[TableConfig("t", 2)])
    old = msgpack.packb({"v": 1, "op": "ping", "rid": 3, "cid": 1, "frames": []})
    h, arrays = PS.unpack(as_frames(server.handle([zmq.Frame(old)])))
    assert not h["ok"] and h["error"] == "protocol" and f"expected version {PS.version}" in h["message"]
    assert h["rid"] == -1 and h["op"] == "" and arrays == []

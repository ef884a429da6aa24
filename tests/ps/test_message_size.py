"""NOTE [message size limits] on a PS shard's socket (an in-process shard, real sockets):
its bound follows from its limits, the largest legitimate step message passes, and a
frame over the bound is neither delivered nor buffered while the shard serves on."""

from __future__ import annotations

import numpy as np

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.ps import PSClient
from herald.ps.config import DENSE_MAX_BYTES, ShardLimits, largest_frame_bytes
from herald.ps.wire import PS
from tests import rawpeer
from tests.fakes import InProcessPS, dealer

KEYS, DIM = 16384, 64  # the widest rows' request (12.6 MB) exceeds DENSE_MAX_BYTES
LIMITS = ShardLimits(max_keys_per_request=KEYS, max_dim=DIM)
#: Adam at max_dim: the widest row the limits allow (3 * 64 + 1 floats)
WIDE = TableConfig("wide", DIM, OptimizerConfig("adam"))


def test_the_bound_is_a_full_request_of_the_widest_rows():
    assert largest_frame_bytes(LIMITS) == KEYS * WIDE.row_width * 4 == KEYS * 193 * 4 > DENSE_MAX_BYTES
    # tight limits still admit a BSP step message's dense slice (NOTE [dense gradients on the shards])
    assert largest_frame_bytes(ShardLimits(max_keys_per_request=10, max_dim=1)) == DENSE_MAX_BYTES > 10 * 4 * 4
    # the defaults: ~48 GiB of rows, bounded by the shard's memory (3/4 of this host's, NOTE [ps limits])
    assert largest_frame_bytes(ShardLimits()) == min((1 << 20) * (3 * 4096 + 1) * 4, ShardLimits().max_shard_bytes)
    assert largest_frame_bytes(ShardLimits(max_shard_bytes=1 << 28)) == 1 << 28


def test_an_oversized_frame_is_dropped_unseen_and_the_shard_serves_on():
    rng = np.random.default_rng(0)
    tables, keys = np.zeros(KEYS, np.uint16), np.arange(KEYS, dtype=np.uint64)
    rows = rng.standard_normal((KEYS, WIDE.row_width)).astype(np.float32)
    with (
        InProcessPS([WIDE], limits=LIMITS) as ps,
        PSClient(ps.addresses, [WIDE], timeout_ms=30_000, num_workers=1) as client,
    ):
        # the largest step message of these limits: every section a full request, its rows the widest
        grads = (tables, keys + KEYS, rng.standard_normal((KEYS, DIM)).astype(np.float32), np.ones(KEYS, np.uint16))
        pulled = client.step_async(0, 0, 1, rows=(tables, keys, rows), grads=grads, pull=(tables, keys)).wait()
        np.testing.assert_array_equal(pulled, rows)

        server = ps.servers[0]
        before = dict(server.counters)
        stranger = dealer(ps.addresses[0], b"stranger")
        try:
            frames = PS.pack({"op": "push_rows", "rid": 1, "cid": 7, "parts": [{"flat": True}]}, [tables, keys, rows])
            over = PS.max_frame_bytes(largest_frame_bytes(LIMITS)) + 1  # one byte over the socket's bound
            stranger.send_multipart([*frames[:3], bytes(over)], copy=False)
            assert not stranger.poll(1000)  # no reply: a delivered request, even a bad one, is answered
            stranger.send_multipart(PS.pack({"op": "ping", "rid": 2, "cid": 7}))
            assert stranger.poll(30_000), "the shard answered no ping after the drop"
            assert PS.unpack(stranger.recv_multipart())[0]["ok"]
        finally:
            stranger.close(linger=0)
        assert rawpeer.claim_frame(ps.addresses[0], 3 << 30) < 16 << 20  # a 3 GB claim: cut off, not read
        counted = {k: v for k, v in server.counters.items() if before.get(k) != v}
        assert not any(k.startswith("errors") for k in counted), counted  # the oversized one was never seen
        np.testing.assert_array_equal(client.pull(0, keys), rows)  # its own client is still served

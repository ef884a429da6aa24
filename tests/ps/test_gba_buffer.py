"""NOTE [gba tokens]: GBA's gradient buffer (GBA §4.1, eq. (1)) and its shard ops."""

from __future__ import annotations

import numpy as np
import pytest

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import ProtocolError
from herald.ps.gba import Contribution, GradientBuffer, aggregate_rows
from herald.ps.server import ShardServer
from tests.fakes import shard_request

SGD = TableConfig("t", 2, OptimizerConfig("sgd", lr=1.0))


def _c(token, slot, keys=(), value=1.0, dense=None):
    k = np.array(keys, np.uint64)
    return Contribution(
        token,
        slot,
        0,
        [(0, k, np.full((k.shape[0], 2), value, np.float32))],
        None if dense is None else np.array(dense, np.float32),
    )


def _buffer(m, iota):
    applied = []
    buf = GradientBuffer(m, iota, lambda t, k, g: applied.append((buf.global_step - 1, t, k.tolist(), g.tolist())))
    return buf, applied


def test_exactly_m_contributions_make_one_global_step():
    buf, applied = _buffer(3, 0)
    assert buf.add(_c(0, 0, [1], 1.0)) == {"global_step": 0, "staleness": 0, "dropped": 0}
    buf.add(_c(0, 2, [1, 2], 2.0))
    assert buf.global_step == 0 and not applied and buf.pending == 2
    buf.add(_c(0, 1, [2], 4.0))
    assert buf.global_step == 1 and buf.pending == 0
    # one application per key, the sum of the three contributions
    assert applied == [(0, 0, [1, 2], [[3.0, 3.0], [6.0, 6.0]])]
    assert [tuple(h) for h in buf.history] == [(0, 3, 0)]


def test_stale_contributions_are_dropped_and_counted():
    buf, applied = _buffer(2, 1)
    buf.add(_c(0, 0, [1], 1.0))
    buf.add(_c(1, 0, [1], 1.0))  # a fast worker's next token: kept (k - tau = -1)
    assert buf.global_step == 1
    buf.add(_c(1, 1, [1], 1.0))
    buf.add(_c(2, 0, [1], 1.0))
    assert buf.global_step == 2
    buf.add(_c(2, 1, [1], 1.0))
    r = buf.add(_c(0, 1, [1], 100.0))  # the straggler's token 0 at step 2: 2 - 0 > iota = 1
    assert r == {"global_step": 2, "staleness": 2, "dropped": 1}
    assert buf.global_step == 3
    assert applied[-1] == (2, 0, [1], [[1.0, 1.0]])  # its gradient never reached the table
    assert buf.counters["dropped"] == 1 and buf.counters["staleness_max"] == 2
    assert buf.counters["contributions"] == 6 and buf.counters["kept"] == 5
    assert [tuple(h) for h in buf.history][-1] == (2, 2, 1)


def test_within_the_threshold_a_late_gradient_is_kept():
    buf, _ = _buffer(2, 1)
    buf.add(_c(0, 0, [5], 1.0))
    buf.add(_c(1, 0, [5], 1.0))
    r = buf.add(_c(0, 1, [5], 1.0))  # 1 - 0 <= 1
    assert r["staleness"] == 1 and not r["dropped"]
    assert buf.counters["dropped"] == 0


def test_repeated_or_out_of_range_slots_are_rejected_without_change():
    buf, _ = _buffer(2, 0)
    buf.add(_c(0, 0, [1]))
    with pytest.raises(ProtocolError, match="already received"):
        buf.add(_c(0, 0, [1]))
    with pytest.raises(ProtocolError, match="slot 2"):
        buf.add(_c(0, 2, [1]))
    assert buf.pending == 1
    buf.add(_c(0, 1, [1]))
    with pytest.raises(ProtocolError, match="already received"):  # a completed token is remembered
        buf.add(_c(0, 1, [1]))
    with pytest.raises(ProtocolError, match="capacity"):
        GradientBuffer(0, 0, lambda *a: None)


def test_dense_log_sums_kept_gradients_and_marks_empty_steps():
    buf, _ = _buffer(2, 0)
    buf.add(_c(0, 0, dense=[1.0, 2.0]))
    buf.add(_c(0, 1, dense=[3.0, 4.0]))
    buf.add(_c(1, 0, dense=[1.0, 1.0]))
    buf.add(_c(1, 1, dense=[1.0, 1.0]))
    grads, kept = buf.dense_since(0)
    assert grads.tolist() == [[4.0, 6.0], [2.0, 2.0]] and kept.tolist() == [2, 2]
    assert buf.dense_since(2)[0].shape == (0, 2)
    with pytest.raises(ProtocolError, match="global step"):
        buf.dense_since(3)
    with pytest.raises(ProtocolError, match="earlier ones had 2"):
        buf.add(_c(2, 0, dense=[1.0]))


def test_aggregate_rows_sums_in_piece_order():
    keys, grads = aggregate_rows(
        [
            (np.array([3, 1], np.uint64), np.array([[1, 1], [2, 2]], np.float32)),
            (np.array([1], np.uint64), np.array([[5, 5]], np.float32)),
        ]
    )
    assert keys.tolist() == [1, 3] and grads.tolist() == [[7, 7], [1, 1]] and not grads.flags.writeable


# ------------------------------------------------------------------ the shard ops
def _call(server, header, arrays):
    header = dict(header, rid=_call.rid, cid=1)
    _call.rid += 1
    return shard_request(server, header, arrays)


_call.rid = 1


def _push(server, token, slot, keys, value, dense=None, m=2, iota=0):
    k = np.array(keys, np.uint64)
    arrays = [k, np.full((k.shape[0], 2), value, np.float32)] + ([np.array(dense, np.float32)] if dense else [])
    return _call(
        server,
        {
            "op": "gba_push",
            "token": token,
            "slot": slot,
            "rank": 0,
            "m": m,
            "iota": iota,
            "dense": dense is not None,
            "parts": [{"table": 0}],
        },
        arrays,
    )


def _pull(server, token, keys, since=-1, m=2, iota=0, base=None):
    extra = {} if base is None else {"base": base}
    return _call(
        server,
        {"op": "gba_pull", "token": token, "m": m, "iota": iota, "since": since, "parts": [{"table": 0}], **extra},
        [np.array(keys, np.uint64)],
    )


def test_shard_applies_once_per_global_step_and_gates_reads():
    server = ShardServer(0, 1, tables=[SGD])
    before = _pull(server, 0, [7])[1][0].copy()
    header, _ = _pull(server, 1, [7])
    assert header["ok"] and header["ready"] is False and header["global_step"] == 0  # token 1 waits for step 1
    assert _push(server, 0, 0, [7], 0.5, dense=[1.0])[0]["global_step"] == 0
    assert np.array_equal(_pull(server, 0, [7])[1][0], before)  # one contribution: nothing applied yet
    h, _ = _push(server, 0, 1, [7], 0.25, dense=[2.0])
    assert h["ok"] and h["staleness"] == 0 and not h["dropped"]
    header, (rows, dense, kept) = _pull(server, 1, [7], since=0)
    assert header["ready"] and header["global_step"] == 1
    assert np.allclose(rows[0, :2], before[0, :2] - 0.75)  # SGD lr 1 on the summed gradient
    assert dense.tolist() == [[3.0]] and kept.tolist() == [1 + 1]
    stats = server.stats()["gba"]
    assert stats["global_step"] == 1 and stats["contributions"] == 2 and stats["history"] == [[0, 2, 0]]


def test_shard_rejects_other_settings_and_bad_gradients():
    server = ShardServer(0, 1, tables=[SGD])
    assert _push(server, 0, 0, [1], 1.0)[0]["ok"]
    h, _ = _push(server, 0, 1, [1], 1.0, m=3)
    assert not h["ok"] and "M=2" in h["message"]
    h, _ = _push(server, 0, 1, [1], float("nan"))
    assert not h["ok"] and "NaN" in h["message"]
    assert server.gba.pending == 1
    h, _ = _push(server, 0, 1, [], 0.0)  # an empty contribution still counts
    assert h["ok"] and server.gba.global_step == 1


def test_a_restored_shard_starts_gba_again_at_the_resumed_jobs_base(tmp_path):
    """NOTE [ps failover across hosts]: a shard that survived the lost one is restored from
    the checkpoint with the rest; its buffer (global step, pending contributions) belongs to
    the rolled-back run, so the resumed job's requests (base = the checkpoint's next global
    step) make a new one instead of being refused."""
    token = "a" * 16
    server = ShardServer(0, 1, tables=[SGD], checkpoint_root=str(tmp_path), admin_token=token)
    assert _push(server, 0, 0, [7], 0.5)[0]["ok"] and _push(server, 0, 1, [7], 0.5)[0]["ok"]
    saved = _pull(server, 1, [7])[1][0].copy()
    assert _call(server, {"op": "checkpoint", "dir": str(tmp_path / "c"), "token": token}, [])[0]["ok"]
    for tau, slot in ((1, 0), (1, 1), (2, 0)):  # the run goes on: one more step, one pending contribution
        assert _push(server, tau, slot, [7], 1.0)[0]["ok"]
    assert server.gba.global_step == 2 and server.gba.pending == 1
    h, _ = _call(server, {"op": "restore", "dir": str(tmp_path / "c"), "token": token}, [])
    assert h["ok"], h.get("message")
    header, arrays = _pull(server, 1, [7], base=1)
    assert header["ok"], header.get("message")
    assert header["ready"] and header["global_step"] == 1 and np.array_equal(arrays[0], saved)
    assert server.gba.pending == 0 and server.gba.start_step == 1

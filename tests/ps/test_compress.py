"""NOTE [wire compression]: round-trip error bounds per format, zero rows, refusals,
frame layouts, and compressed pull / push through a real shard's request handler."""

from __future__ import annotations

import numpy as np
import pytest

from herald.errors import ConfigError, DataError, ProtocolError
from herald.ps import compress as C


def _rows(seed=0, n=257, dim=16):
    rng = np.random.default_rng(seed)
    # magnitudes over many decades, mixed signs: the scale must adapt per row
    x = rng.standard_normal((n, dim)) * 10.0 ** rng.uniform(-6, 6, (n, 1))
    return x.astype(np.float32)


def test_fp16_scaled_relative_error_per_element():
    x = _rows()
    payload, scales = C.encode(x, "fp16")
    assert payload.dtype == np.float16 and scales.dtype == np.float32 and scales.shape == (x.shape[0],)
    y = C.decode(payload, scales, "fp16")
    amax = np.abs(x).max(axis=1, keepdims=True)
    normal = np.abs(x) >= amax * 2.0**-27
    rel = np.abs(y - x)[normal] / np.abs(x)[normal]
    assert rel.max() <= 2.0**-10
    assert (np.abs(y - x)[~normal] <= (amax * 2.0**-38 * np.ones_like(x))[~normal]).all()
    # the scale is a power of two: the row maximum lands in [2**13, 2**14)
    scaled_max = np.abs(payload.astype(np.float32)).max(axis=1)
    assert (scaled_max >= 2**13).all() and (scaled_max <= 2**14).all()
    assert (np.frexp(scales)[0] == 0.5).all()


def test_fp16_extreme_magnitudes_stay_finite():
    x = np.array([[3.0e38, -1.0], [1e-40, 2e-41], [65504.0 * 4, 1.0]], np.float32)
    y = C.decode(*C.encode(x, "fp16"), "fp16")
    assert np.isfinite(y).all()
    assert abs(y[0, 0] - x[0, 0]) <= 2.0**-11 * x[0, 0]
    assert abs(y[2, 0] - x[2, 0]) <= 2.0**-11 * x[2, 0]


def test_bf16_relative_error_and_rounding():
    x = _rows(1)
    payload, scales = C.encode(x, "bf16")
    assert payload.dtype == np.uint16 and scales.shape == (0,)
    y = C.decode(payload, scales, "bf16")
    assert (np.abs(y - x) <= 2.0**-8 * np.abs(x)).all()
    # round to nearest even, and values exact in bf16 come back bit-identical
    exact = np.array([[1.0, -2.5, 0.15625, 0.0]], np.float32)
    assert np.array_equal(C.decode(*C.encode(exact, "bf16"), "bf16"), exact)
    big = np.array([[np.finfo(np.float32).max]], np.float32)
    assert np.isfinite(C.decode(*C.encode(big, "bf16"), "bf16")).all()


def test_int8_absolute_error_bound():
    x = _rows(2)
    payload, scales = C.encode(x, "int8")
    assert payload.dtype == np.int8 and np.abs(payload.astype(int)).max() <= 127
    y = C.decode(payload, scales, "int8")
    amax = np.abs(x).max(axis=1, keepdims=True)
    assert (np.abs(y - x) <= amax / 127).all()
    assert (np.abs(y - x) <= amax / 254 * (1 + 1e-6)).all()  # rint: half a step


@pytest.mark.parametrize("wire", ["fp16", "bf16", "int8"])
def test_zero_rows_and_empty(wire):
    x = np.zeros((3, 8), np.float32)
    x[1, 2] = -0.5
    y = C.decode(*C.encode(x, wire), wire)
    assert np.array_equal(y[[0, 2]], x[[0, 2]]) and y[1, 2] == -0.5
    empty = np.zeros((0, 8), np.float32)
    assert C.decode(*C.encode(empty, wire), wire).shape == (0, 8)


@pytest.mark.parametrize("wire", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_refused(wire, bad):
    x = np.ones((4, 3), np.float32)
    x[2, 1] = bad
    with pytest.raises(DataError, match="row 2"):
        C.encode(x, wire)


def test_unknown_format_and_fp32_encode():
    with pytest.raises(ConfigError, match="fp32, fp16, bf16, int8"):
        C.encode(np.ones((1, 1), np.float32), "fp8")
    with pytest.raises(ConfigError, match="as they are"):
        C.encode(np.ones((1, 1), np.float32), "fp32")
    with pytest.raises(ProtocolError, match="'wire'"):
        C.wire_of({"wire": "fp64"})
    assert C.wire_of({}) == "fp32"


def test_decode_rejects_mismatched_frames():
    payload, scales = C.encode(np.ones((2, 4), np.float32), "fp16")
    with pytest.raises(ProtocolError, match="int8 payload"):
        C.decode(payload, scales, "int8")
    with pytest.raises(ProtocolError, match="scales"):
        C.decode(payload, scales[:1], "fp16")


def test_row_bytes():
    assert C.row_bytes("fp32", 16) == 64
    assert C.row_bytes("fp16", 16) == 36 and C.row_bytes("bf16", 16) == 32 and C.row_bytes("int8", 16) == 20


def test_push_rows_frames_round_trip_keeps_state_exact():
    rng = np.random.default_rng(3)
    keys = np.arange(5, dtype=np.uint64)
    rows = rng.standard_normal((5, 10)).astype(np.float32)  # dim 8 + 2 state values
    frames = C.encode_part("push_rows", [keys, rows], 8, "int8")
    assert [f.dtype.str for f in frames] == ["<u8", "|i1", "<f4", "<f4"]
    k, back = C.decode_request("push_rows", {"wire": "int8"}, frames)
    assert np.array_equal(k, keys) and np.array_equal(back[:, 8:], rows[:, 8:])
    assert np.abs(back[:, :8] - rows[:, :8]).max() <= np.abs(rows[:, :8]).max() / 127
    assert C.decode_request("push_rows", {}, [keys, rows])[1] is rows  # fp32: untouched


def test_pull_reply_frames_round_trip():
    rows = _rows(4, n=6, dim=5)
    frames = C.encode_rows(rows, 4, "fp16")
    (back,) = C.decode_rows(frames, "fp16")
    assert back.shape == rows.shape and np.array_equal(back[:, 4:], rows[:, 4:])
    with pytest.raises(ProtocolError, match="3 frames"):
        C.decode_rows(frames[:2], "fp16")


# ------------------------------------------------- through a shard's handler
def _shard():
    from herald.contracts.tables import OptimizerConfig, TableConfig
    from herald.ps.server import ShardServer

    return ShardServer(0, 1, tables=[TableConfig("t", 8, OptimizerConfig(name="adagrad", lr=0.1))])


def _call(server, header, arrays):
    import zmq

    from herald.ps.wire import PS

    _call.rid = getattr(_call, "rid", 0) + 1
    msg = PS.pack(dict(header, rid=_call.rid, cid=7), arrays)
    reply = server.handle([zmq.Frame(bytes(memoryview(m))) for m in msg])
    h = PS.unpack_header(reply[0])
    assert h["ok"], h
    return h, PS.unpack_arrays(h, [zmq.Frame(bytes(memoryview(m))) for m in reply[1:]])


@pytest.mark.parametrize("wire", ["fp16", "bf16", "int8"])
def test_shard_accumulates_fp32_and_answers_compressed(wire):
    """A compressed push equals an fp32 push of the decoded gradient (the PS applies
    the optimizer in float32); a compressed pull decodes to the stored rows within the
    format's bound and carries the optimizer state exactly."""
    rng = np.random.default_rng(5)
    keys = np.arange(0, 40, 3, dtype=np.uint64)
    grads = rng.standard_normal((keys.shape[0], 8)).astype(np.float32)
    contributors = np.ones(keys.shape[0], np.uint16)
    lossy, exact = _shard(), _shard()
    part = {"step": 0, "rank": 0, "parts": [{"table": 0}]}
    frames = C.encode_part("push_grad", [keys, grads, contributors], 8, wire)
    _call(lossy, dict(part, op="push_grad", wire=wire), frames)
    decoded = C.decode(frames[1], frames[2], wire)
    _call(exact, dict(part, op="push_grad"), [keys, decoded, contributors])
    _, (want,) = _call(exact, {"op": "pull", "parts": [{"table": 0}]}, [keys])
    _, (stored,) = _call(lossy, {"op": "pull", "parts": [{"table": 0}]}, [keys])
    assert np.array_equal(stored, want)  # float32 on the PS: same update bit for bit
    h, got = _call(lossy, {"op": "pull", "wire": wire, "parts": [{"table": 0}]}, [keys])
    assert h["wire"] == wire and [a.dtype.str for a in got][1:] == ["<f4", "<f4"]
    (rows,) = C.decode_rows(got, wire)
    assert np.array_equal(rows[:, 8:], want[:, 8:])  # optimizer state: exact
    bound = {"fp16": 2.0**-11, "bf16": 2.0**-8}.get(wire)
    err = np.abs(rows[:, :8] - want[:, :8])
    if bound is not None:
        assert (err <= bound * np.abs(want[:, :8])).all()
    else:
        assert (err <= np.abs(want[:, :8]).max(axis=1, keepdims=True) / 127).all()
    # a compressed write-back stores the decoded embedding and the exact state
    new = rng.standard_normal((keys.shape[0], 16)).astype(np.float32)
    _call(
        lossy,
        {"op": "push_rows", "wire": wire, "parts": [{"table": 0}]},
        C.encode_part("push_rows", [keys, new], 8, wire),
    )
    _, (back,) = _call(lossy, {"op": "pull", "parts": [{"table": 0}]}, [keys])
    assert np.array_equal(back[:, 8:], new[:, 8:])
    assert np.array_equal(back[:, :8], C.decode(*C.encode(new[:, :8], wire), wire))


def test_shard_refuses_a_bad_compressed_request():
    import zmq

    from herald.ps.wire import PS

    server = _shard()
    keys = np.arange(3, dtype=np.uint64)
    payload, scales = C.encode(np.ones((3, 8), np.float32), "fp16")
    msg = PS.pack(
        {"op": "push_grad", "rid": 1, "cid": 1, "step": 0, "rank": 0, "wire": "int8", "parts": [{"table": 0}]},
        [keys, payload, scales, np.ones(3, np.uint16)],
    )
    h = PS.unpack_header(server.handle([zmq.Frame(bytes(memoryview(m))) for m in msg])[0])
    assert not h["ok"] and "int8 payload" in h["message"]

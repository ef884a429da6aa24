"""NOTE [wire format]: the one codec, round trips and every rejection, for both protocols."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from herald import wire
from herald.auth import generate_keys, server_socket
from herald.errors import ConfigError, ProtocolError
from herald.ps.wire import PS
from herald.wire import DISPATCH, KNOWN_DTYPES, Protocol
from tests import rawpeer

PROTOCOLS = [DISPATCH, PS]


def _frames(msg):
    return [zmq.Frame(bytes(memoryview(m))) for m in msg]


def _header(protocol, arrays, **extra):
    return msgpack.packb({"v": protocol.version, "op": "x", "arrays": arrays, **extra})


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.name)
def test_round_trip_of_every_allowed_dtype(protocol):
    rng = np.random.default_rng(0)
    arrays = []
    for dt in sorted(protocol.dtypes):
        raw = rng.integers(0, 256, size=6 * KNOWN_DTYPES[dt].itemsize, dtype=np.uint8)
        a = raw.view(KNOWN_DTYPES[dt])
        arrays += [a, a.reshape(2, 3), np.zeros(0, dt), np.zeros((0, 5), dt)]
    header, back = protocol.unpack(_frames(protocol.pack({"op": "x", "n": 7}, arrays)))
    assert header["op"] == "x" and header["n"] == 7 and header["v"] == protocol.version
    assert len(back) == len(arrays)
    for a, b in zip(arrays, back):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert a.tobytes() == b.tobytes()  # bit-exact (NaN payloads included)


def test_module_functions_speak_dispatch():
    frames = wire.pack({"op": "x"}, [np.arange(3, dtype=np.uint64)])
    assert msgpack.unpackb(frames[0]) == {"op": "x", "v": DISPATCH.version, "arrays": [["<u8", [3]]]}
    header, (a,) = wire.unpack(frames)
    assert a.tolist() == [0, 1, 2]


def test_received_arrays_are_views_of_the_frames():
    frames = _frames(PS.pack({"op": "x"}, [np.arange(4, dtype=np.float32).reshape(2, 2)]))
    _, (a,) = PS.unpack(frames)
    assert np.shares_memory(a, np.frombuffer(frames[1].buffer, np.uint8))


def test_readonly_unpack_gives_views_that_cannot_be_written():
    frames = _frames(PS.pack({"op": "x"}, [np.arange(4, dtype=np.uint64)]))
    header = PS.unpack_header(frames[0])
    (ro,) = PS.unpack_arrays(header, frames[1:], readonly=True)
    (rw,) = PS.unpack_arrays(header, frames[1:])
    assert not ro.flags.writeable and rw.flags.writeable  # zmq frames are writable buffers
    assert np.shares_memory(ro, rw) and ro.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="read-only"):
        ro[0] = 9


def test_pack_keeps_big_arrays_zero_copy_and_makes_them_contiguous():
    a = np.arange(10, dtype=np.float32)
    assert DISPATCH.pack({"op": "x"}, [a])[1] is a
    strided = DISPATCH.pack({"op": "x"}, [a[::2]])[1]
    assert strided.flags.c_contiguous and strided.tolist() == a[::2].tolist()


def test_configure_sets_the_copy_threshold():
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        assert sock.copy_threshold != 1 << 20  # pyzmq's default
        DISPATCH.configure(sock)
        assert sock.copy_threshold == DISPATCH.copy_threshold_bytes == 1 << 20
        sock.copy_threshold = 0
        PS.configure(sock)
        assert sock.copy_threshold == PS.copy_threshold_bytes == 1 << 20
    finally:
        sock.close(linger=0)


def test_configure_bounds_each_frame_by_the_largest_legitimate_one():
    """NOTE [message size limits]: the bound is per frame, the header's size at least."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        DISPATCH.configure(sock)
        assert sock.getsockopt(zmq.MAXMSGSIZE) == -1  # no bound unless asked
        DISPATCH.configure(sock, max_array_bytes=0)
        assert sock.getsockopt(zmq.MAXMSGSIZE) == DISPATCH.max_header_bytes + wire.FRAME_OVERHEAD_BYTES
        PS.configure(sock, max_array_bytes=3 << 20)
        assert sock.getsockopt(zmq.MAXMSGSIZE) == (3 << 20) + wire.FRAME_OVERHEAD_BYTES
    finally:
        sock.close(linger=0)
    for bad in (-1, 1.5, None):
        with pytest.raises(ConfigError, match="max_array_bytes"):
            PS.max_frame_bytes(bad)


def _router(tmp_path, max_array_bytes):
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    DISPATCH.configure(sock, max_array_bytes=max_array_bytes)
    sock.bind(f"ipc://{tmp_path}/r-{max_array_bytes}.ipc")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def test_a_frame_over_the_bound_is_not_delivered_and_the_socket_serves_on(tmp_path):
    bound = 2 << 20
    router, address = _router(tmp_path, bound)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(address)
    try:
        peer.send_multipart([b"h" * 100, bytes(bound)])  # the largest legitimate frame
        assert router.poll(10_000)
        assert [len(f) for f in router.recv_multipart()[1:]] == [100, bound]
        peer.send_multipart([b"h", bytes(bound + wire.FRAME_OVERHEAD_BYTES + 1)])  # one byte over
        assert not router.poll(1000)
        peer.send(b"after")  # the same peer, reconnected by libzmq, and a new one are served
        other = zmq.Context.instance().socket(zmq.DEALER)
        other.setsockopt(zmq.LINGER, 0)
        other.connect(address)
        other.send(b"new peer")
        got = sorted(router.recv_multipart()[1] for _ in range(2) if router.poll(10_000))
        other.close()
        assert got == [b"after", b"new peer"]
    finally:
        peer.close()
        router.close()


def test_a_huge_length_claim_is_cut_off_before_it_is_buffered(tmp_path):
    """The receiver hangs up right after the claim, without reading what follows; a
    socket without a bound reads it all (the control)."""
    bounded, address = _router(tmp_path, 1 << 20)
    unbounded = zmq.Context.instance().socket(zmq.ROUTER)
    unbounded.setsockopt(zmq.LINGER, 0)
    unbounded.bind(f"ipc://{tmp_path}/unbounded.ipc")
    try:
        assert rawpeer.claim_frame(address, 3 << 30, send_bytes=64 << 20) < 16 << 20
        assert (
            rawpeer.claim_frame(unbounded.getsockopt_string(zmq.LAST_ENDPOINT), 96 << 20, send_bytes=32 << 20)
            == 32 << 20
        )
    finally:
        bounded.close()
        unbounded.close()


def test_with_keys_an_unauthenticated_peer_is_cut_off_at_the_bound_too(tmp_path):
    """The bound holds during the CURVE handshake: a HELLO claimed at 500 MB is not read."""
    generate_keys(tmp_path / "keys")
    ctx = zmq.Context()
    socks = []
    try:
        for bound in (1 << 20, None):
            sock = server_socket(ctx, zmq.ROUTER, tmp_path / "keys")
            socks.append(sock)
            sock.setsockopt(zmq.LINGER, 0)
            DISPATCH.configure(sock, max_array_bytes=bound)
            sock.bind(f"ipc://{tmp_path}/curve-{bound}.ipc")
        bounded, unbounded = (s.getsockopt_string(zmq.LAST_ENDPOINT) for s in socks)
        assert rawpeer.claim_frame(bounded, 500 << 20, mechanism="CURVE") < 16 << 20
        assert rawpeer.claim_frame(unbounded, 96 << 20, mechanism="CURVE", send_bytes=32 << 20) == 32 << 20
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "make, match",
    [  # make(version) -> the frames
        (lambda v: [], "empty message"),
        (lambda v: [b"\xc1"], "not valid msgpack"),
        (lambda v: [b"\x92\x01"], "not valid msgpack"),  # truncated array
        (lambda v: [msgpack.packb([1, 2])], "must be a msgpack map"),
        (lambda v: [msgpack.packb({1: 2})], "not valid msgpack"),  # non-str key
        (lambda v: [msgpack.packb({"v": v, "op": "x", "arrays": [], "b": b"x"})], "not valid msgpack"),
        (
            lambda v: [msgpack.packb({"v": v, "op": "x", "arrays": [], "e": msgpack.ExtType(1, b"x")})],
            "not valid msgpack",
        ),
        (lambda v: [msgpack.packb({"op": "x", "arrays": []})], "expected version"),
        (lambda v: [msgpack.packb({"v": v + 1, "op": "x", "arrays": []})], "expected version"),
        (lambda v: [msgpack.packb({"v": float(v), "op": "x", "arrays": []})], "expected version"),
        (lambda v: [msgpack.packb({"v": True, "op": "x", "arrays": []})], "expected version"),  # True == 1
    ],
)
def test_rejects_malformed_headers(protocol, make, match):
    with pytest.raises(ProtocolError, match=match) as info:
        protocol.unpack(make(protocol.version))
    assert str(info.value).startswith(f"{protocol.name}: ")


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.name)
def test_rejects_a_wrong_version_naming_the_expected_one(protocol):
    other = Protocol(protocol.name, protocol.version + 1, protocol.dtypes)
    with pytest.raises(ProtocolError, match=f"version {protocol.version + 1}, expected version {protocol.version}"):
        protocol.unpack(other.pack({"op": "x"}))


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.name)
def test_rejects_bad_headers_fields(protocol):
    cases = [
        ({"op": 3}, "str 'op'"),
        ({"arrays": "no"}, "must be a list"),
        ({"arrays": [["<u8", [1]]] * (protocol.max_frames + 1)}, "must be a list of at most"),
        ({"arrays": [["|O", [1]]]}, "not allowed"),
        ({"arrays": [["<u8", [-1]]]}, "descriptor"),
        ({"arrays": [["<u8", [1 << 40]]]}, "descriptor"),
        ({"arrays": [["<u8", [True]]]}, "descriptor"),
        ({"arrays": [["<u8", [1.0]]]}, "descriptor"),
        ({"arrays": [["<u8", [1] * (protocol.max_dims + 1)]]}, "descriptor"),
        ({"arrays": [[["<u8"], [1]]]}, "descriptor"),
        ({"arrays": [["<u8"]]}, "descriptor"),
    ]
    for fields, match in cases:
        with pytest.raises(ProtocolError, match=match):
            protocol.unpack_header(msgpack.packb({"v": protocol.version, "op": "x", "arrays": [], **fields}))


def test_dtype_allowed_for_one_protocol_only_is_rejected_by_the_other():
    frames = DISPATCH.pack({"op": "x"}, [np.zeros(2, np.int64)])
    with pytest.raises(ProtocolError, match="ps: array 0: dtype '<i8' not allowed"):
        PS.unpack([_header(PS, [["<i8", [2]]]), frames[1]])
    with pytest.raises(ProtocolError, match="cannot send"):
        PS.pack({"op": "x"}, [np.zeros(2, np.int64)])
    with pytest.raises(ProtocolError, match="cannot send"):
        DISPATCH.pack({"op": "x"}, [np.zeros(2, ">u8")])  # big endian never goes on the wire


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.name)
def test_rejects_size_mismatch_and_frame_count(protocol):
    header = _header(protocol, [["<u8", [2, 2]]])
    with pytest.raises(ProtocolError, match="header says 32 bytes .* but the frame has 31"):
        protocol.unpack([header, b"\0" * 31])
    with pytest.raises(ProtocolError, match="header says 32 bytes .* but the frame has 40"):
        protocol.unpack([header, b"\0" * 40])
    with pytest.raises(ProtocolError, match="describes 1 arrays but 0 array frames"):
        protocol.unpack([header])
    with pytest.raises(ProtocolError, match="describes 1 arrays but 2 array frames"):
        protocol.unpack([header, b"\0" * 32, b""])


def test_huge_dims_do_not_overflow_the_size_check():
    # 2**39 * 2**39 * 8 bytes wraps to 0 in int64 arithmetic; Python ints are exact
    header = _header(PS, [["<u8", [1 << 39, 1 << 39]]])
    with pytest.raises(ProtocolError, match="but the frame has 0"):
        PS.unpack([header, b""])


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.name)
def test_rejects_too_many_dims_on_both_ends(protocol):
    shape = (1,) * (protocol.max_dims + 1)
    with pytest.raises(ProtocolError, match="cannot send"):
        protocol.pack({"op": "x"}, [np.zeros(shape, np.uint64)])
    with pytest.raises(ProtocolError, match=f"at most {protocol.max_dims} dims"):
        protocol.unpack([_header(protocol, [["<u8", list(shape)]]), b"\0" * 8])


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.name)
def test_rejects_oversized_header_on_both_ends(protocol):
    big = "x" * protocol.max_header_bytes
    with pytest.raises(ProtocolError, match=f"exceeds {protocol.max_header_bytes}"):
        protocol.pack({"op": "x", "pad": big})
    with pytest.raises(ProtocolError, match=f"exceeds {protocol.max_header_bytes}"):
        protocol.unpack([_header(protocol, [], pad=big)])


def test_too_many_arrays_are_refused_on_send():
    small = Protocol("tiny", 0, {"|u1"}, max_frames=2)
    with pytest.raises(ProtocolError, match="3 arrays exceed 2"):
        small.pack({"op": "x"}, [np.zeros(1, np.uint8)] * 3)


def test_protocol_settings_are_validated():
    with pytest.raises(ConfigError, match="cannot go on the wire"):
        Protocol("p", 1, {"<u8", "|O"})
    with pytest.raises(ConfigError, match="cannot go on the wire"):
        Protocol("p", 1, set())
    for bad in ({"version": -1}, {"max_dims": 0}, {"max_frames": 2.0}, {"copy_threshold_bytes": -1}):
        with pytest.raises(ConfigError, match="ints"):
            Protocol("p", **{"version": 1, "dtypes": {"<u8"}, **bad})

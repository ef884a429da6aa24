"""Malformed and foreign messages for a dispatcher's port, grouped by the kind NOTE
[peer validation] (herald/dispatch/peers.py) counts them under. Shared by
tests/dispatch/test_hostile_peers.py and tests/integration/test_fuzz_dispatcher.py.

A message is a list of frames (bytes), as a DEALER sends it (the ROUTER adds the
sender's identity). :func:`zmtp10` turns messages into the raw bytes a plain TCP
socket may send: libzmq reads a peer without a ZMTP/3 greeting as ZMTP/1.0 and
delivers its frames like any other message.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np

from herald import wire
from tests import rawpeer

V = wire.DISPATCH.version


def header(op, arrays: list | None = None, **fields) -> bytes:
    """A msgpack header frame with protocol version and array descriptors."""
    return msgpack.packb({"v": V, "op": op, "arrays": arrays or [], **fields}, use_bin_type=True)


def undecodable() -> list[list[bytes]]:
    """Messages no validator can read as NOTE [wire format]."""
    return [
        [b"\x00\x01\x02\x03\x04\x05\x06\x07\x08"],  # 9 bytes, not msgpack
        [b""],  # empty header frame
        [b"\xc1" * 16],  # a reserved msgpack byte
        [b"\x91" * 200_000 + b"\xc0"],  # nesting deeper than msgpack's stack
        [msgpack.packb([1, 2, 3])],  # msgpack, not a map
        [msgpack.packb({"v": V + 7, "op": "hello", "arrays": []})],  # another protocol version
        [msgpack.packb({"v": V, "op": 5, "arrays": []})],  # op not a str
        [msgpack.packb({"v": V, "op": "ack", "arrays": "none"})],  # arrays not a list
        [msgpack.packb({"v": V, "op": "ack", "arrays": [], "x": b"\x00"}, use_bin_type=True)],  # a bin value
        [header("ack", [["<f4", [1 << 39]]]), b"\x00" * 8],  # a huge array claimed, 8 bytes sent
        [header("ack", [["<f4", [1 << 40]]]), b""],  # a dimension out of range
        [header("ack", [["<f4", [4]]])],  # a descriptor without its frame
        [header("ack"), b"\x00" * 16],  # a frame without a descriptor
        [header("ack", [["|O", [2]]]), b"\x00" * 16],  # an object dtype
        [header("ack", [["<f4", [1] * 9]]), b"\x00" * 4],  # too many dimensions
        [b"\x80" + b"\x00" * (1 << 20)],  # a header over 1 MiB
    ]


def unknown_ops(rank: int = 0) -> list[list[bytes]]:
    """Well-formed messages whose op no worker sends."""
    return [
        [header("frobnicate", rank=rank)],
        [header("microbatch", rank=rank, step=0)],
        [header("", rank=rank)],
        [header("x" * 5000, rank=rank)],
    ]


def _f4(*shape: int) -> bytes:
    return np.zeros(shape, np.float32).tobytes()


def bad_fields(rank: int, world_size: int, rows: int) -> list[list[bytes]]:
    """Messages of known ops with a field of the wrong type or range, or the wrong
    arrays (``rank`` is a valid rank, ``rows`` the micro-batch size)."""
    ack = {"rank": rank, "step": 0, "loss": 0.5}
    pair = [["<f4", [rows]], ["<f4", [rows]]]
    return [
        [header("hello", rank=str(rank), world_size=world_size)],
        [header("hello", rank=True, world_size=world_size)],  # a bool is not a rank
        [header("hello", rank=world_size, world_size=world_size)],
        [header("hello", rank=-1, world_size=world_size)],
        [header("hello", rank=rank, world_size=world_size + 1)],
        [header("hello", rank=rank)],
        [header("hello", world_size=world_size)],
        [header("ack", **{**ack, "step": "0"})],
        [header("ack", **{**ack, "step": -1})],
        [header("ack", **{**ack, "step": 1 << 63})],
        [header("ack", rank=rank, loss=0.5)],
        [header("ack", **{**ack, "loss": "0.5"})],
        [header("ack", **{**ack, "bytes_pulled": -5})],
        [header("ack", **{**ack, "bytes_pushed": (1 << 64) - 1})],
        [header("ack", **{**ack, "phases_ms": [1, 2]})],
        [header("ack", **{**ack, "rank": float(rank)})],
        [header("ack", [["<f4", [rows]]], **ack), _f4(rows)],  # one array
        [header("ack", pair * 2, **ack), *[_f4(rows)] * 4],  # four arrays
        [header("ack", [["<f8", [rows]], ["<f8", [rows]]], **ack), *[np.zeros(rows).tobytes()] * 2],
        [header("ack", [["<f4", [rows + 1]], ["<f4", [rows]]], **ack), _f4(rows + 1), _f4(rows)],
        [header("ack", [["<f4", [rows, 1]], ["<f4", [rows, 1]]], **ack), _f4(rows, 1), _f4(rows, 1)],
        [header("flushed", [["<f4", [1]]], rank=rank), _f4(1)],
        [header("saved", rank=str(rank))],
        [header("error", rank=rank, message=5)],
        [header("error", message="no rank")],
    ]


def claims(rank: int, rows: int, step: int = 0) -> list[list[bytes]]:
    """Well-formed ack, flushed, saved and error messages claiming ``rank``: from a
    stranger they are ``unknown_peer``, from another rank's worker ``wrong_identity``."""
    pair = [["<f4", [rows]], ["<f4", [rows]]]
    return [
        [header("ack", pair, rank=rank, step=step, loss=0.25, bytes_pulled=1), _f4(rows), _f4(rows)],
        [header("ack", rank=rank, step=step, loss=0.25)],
        [header("flushed", rank=rank)],
        [header("saved", rank=rank)],
        [header("error", rank=rank, message="forged: stop the job")],
    ]


def hellos(world_size: int) -> list[list[bytes]]:
    """A valid hello for every rank: ``duplicate_hello`` once every rank is bound."""
    return [[header("hello", rank=r, world_size=world_size)] for r in range(world_size)]


def zmtp10(messages: list[list[bytes]]) -> bytes:
    """The raw TCP bytes of ``messages`` in ZMTP/1.0 framing, after an empty identity frame."""
    out = bytearray(b"\x01\x00")
    for frames in messages:
        for i, body in enumerate(frames):
            flags = 1 if i < len(frames) - 1 else 0
            size = len(body) + 1
            out += bytes([size]) if size < 255 else b"\xff" + struct.pack(">Q", size)
            out += bytes([flags]) + body
    return bytes(out)


NOISE = [b"GET / HTTP/1.1\r\nHost: dispatcher\r\n\r\n", bytes(range(256)) * 8, b"\xff" * 64, b"123456789"]


def send_raw_tcp(address: str, payload: bytes, timeout_s: float = 5.0) -> None:
    """Connect a plain socket to ``address`` (``tcp://host:port``, or ``ipc://path``: a Unix
    socket, as ``herald train``'s dispatcher binds), send ``payload``, close."""
    with rawpeer.connect(address, timeout_s) as s:
        try:
            s.sendall(payload)
        except OSError:  # libzmq may hang up on noise first: that is a valid outcome
            pass

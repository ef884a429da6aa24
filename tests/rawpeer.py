"""A peer that speaks just enough ZeroMQ over a plain socket to claim a frame of any size.

NOTE [message size limits] (herald/wire.py) says a socket with ``ZMQ_MAXMSGSIZE`` cuts a
peer off as soon as a frame's length prefix claims more than the bound, before anything of
the frame is buffered. :func:`claim_frame` checks exactly that from the sender's side: it
claims one frame of ``claim_bytes`` and streams zeros after it until the receiver hangs up;
a receiver that buffers the frame reads on and never hangs up.

Framing (ZMTP, rfc.zeromq.org specs 13 and 23): a ZMTP/1.0 peer (NULL security) starts
with its identity frame, ``[length][flags][body]`` with a 1-byte length (body + flags) or
``0xff`` and an 8-byte one. A ZMTP/3.0 peer sends a 64-byte greeting naming its security
mechanism, then frames ``[flags][length]`` (flags ``0x02``: 8-byte length, ``0x04``: a
command); with ``CURVE`` its first frame is the HELLO command of the handshake, so a claim
there is made before any authentication.
"""

from __future__ import annotations

import socket
import struct

CHUNK = 1 << 20


def connect(address: str, timeout_s: float = 10.0) -> socket.socket:
    """A plain socket connected to ``address`` (``tcp://host:port`` or ``ipc://path``)."""
    if address.startswith("ipc://"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout_s)
        s.connect(address[len("ipc://") :])
        return s
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def claim_prefix(claim_bytes: int, mechanism: str = "NULL") -> bytes:
    """The bytes that open a connection and claim one frame of ``claim_bytes`` (NULL:
    ZMTP/1.0, an empty identity then a message frame; CURVE: the ZMTP/3.0 greeting, then
    a command frame where the HELLO goes)."""
    if mechanism == "NULL":
        return b"\x01\x00" + b"\xff" + struct.pack(">Q", claim_bytes + 1) + b"\x00"
    greeting = (
        b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + mechanism.encode().ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    )
    return greeting + b"\x06" + struct.pack(">Q", claim_bytes)


def claim_frame(address: str, claim_bytes: int, *, mechanism: str = "NULL", send_bytes: int = 64 << 20) -> int:
    """Claim a frame of ``claim_bytes`` at ``address`` and stream zeros after the claim,
    at most ``send_bytes`` of them; returns how many were sent before the receiver hung
    up (``send_bytes``: it never did, it read them all).

    Raises:
        TimeoutError: the receiver neither read nor hung up for 10 s.
    """
    with connect(address) as s:
        sent = 0
        try:
            s.sendall(claim_prefix(claim_bytes, mechanism))
            zeros = bytes(CHUNK)
            while sent < send_bytes:
                sent += s.send(zeros[: min(CHUNK, send_bytes - sent)])
        except (BrokenPipeError, ConnectionResetError):
            return sent
        return sent

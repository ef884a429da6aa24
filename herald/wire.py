"""Multipart message codec: one msgpack header frame, then raw array frames.

NOTE [wire format] (every herald socket speaks it): a message
is ``[header, a_0, ..., a_k]``.

``header`` is a msgpack map (str keys; no bin or ext values) with at least

- ``v`` (int): the :class:`Protocol` version; a receiver rejects any other,
- ``op`` (str): the message kind, interpreted by the protocol's user,
- ``arrays``: a list of ``[dtype, shape]`` pairs, one per following frame, in frame
  order. ``dtype`` is a numpy dtype string (``"<f4"``, ``"<u8"``, ``"|b1"``, ...) from
  the protocol's allowed set; ``shape`` a list of at most ``max_dims`` ints, each in
  ``[0, 2**40)``.

Each array frame holds exactly ``prod(shape) * itemsize`` bytes, C order, little
endian. Example: ``pack({"op": "pull"}, [np.arange(3, dtype=np.uint64)])`` sends the
header ``{"op": "pull", "v": 1, "arrays": [["<u8", [3]]]}`` and one 24-byte frame.

Frames are sent with ``send_multipart(frames, copy=False)``; a socket configured by
:meth:`Protocol.configure` still copies frames under ``copy_threshold_bytes`` (a
memcpy of a small frame is cheaper than pyzmq's zero-copy bookkeeping). Received
arrays are ``np.frombuffer`` views of the frames (zero copy, possibly unaligned).

The receiver checks, in order, before touching any array: header size
(``max_header_bytes``), msgpack with no bin/ext values and str keys, a map, version,
``op`` a str, ``arrays`` a list of at most ``max_frames`` well-formed descriptors with
allowed dtypes; then the frame count and every frame's byte size against its
descriptor. Each failure is a :class:`~herald.errors.ProtocolError` naming the
protocol and the problem. Nothing is ever unpickled.

Two protocols use it: :data:`DISPATCH` (dispatcher <-> workers, the module-level
:func:`pack` / :func:`unpack`) and ``herald.ps.wire.PS`` (NOTE [ps wire protocol] in
docs/ps.md).

NOTE [message size limits] (docs/operations.md, "Message size limits")
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every check above runs once a message has arrived whole, so without a bound libzmq
would buffer whatever a peer sends (a 3 GB length claim included) before herald sees
it. Every socket that receives from peers of a job is therefore given ZeroMQ's
``ZMQ_MAXMSGSIZE`` by :meth:`Protocol.configure` (``max_array_bytes``), before it binds
or connects:

- libzmq applies it to each **frame**, not to a whole message: a frame whose length
  prefix claims more is refused as soon as the prefix is read, before anything of it is
  buffered, and the connection is dropped. So the bound is the largest frame a
  legitimate message of that socket carries: ``max(max_header_bytes, max_array_bytes)``
  plus :data:`FRAME_OVERHEAD_BYTES` (CurveZMQ wraps each frame in a MESSAGE command,
  33 bytes more, and the bound also holds for the handshake's commands: with keys, an
  unauthenticated peer is cut off at the bound too).
- Each bound is computed in one place, next to the limits it derives from: a PS shard's
  from its :class:`~herald.ps.config.ShardLimits` (:func:`herald.ps.config.largest_frame_bytes`),
  a dispatcher's from its job's micro-batch and tables
  (:func:`herald.dispatch.peers.largest_frame_bytes`), a worker's is the largest frame a
  dispatcher may send it (:data:`herald.contracts.microbatch.MAX_WORKER_FRAME_BYTES`,
  which the dispatcher checks before sending: a larger one fails the job naming it).
- The drop is silent on both ends: the sender's send succeeds (libzmq reconnects), and
  the receiver's monitor reports a plain disconnect, the same event as a peer that left.
  So it is not counted in the dispatcher's ``rejected`` nor in a shard's ``stats``; a
  legitimate peer over the bound (a misconfiguration) waits for its answer and times
  out naming the receiver.
- What it does not bound: how many frames one message has. A peer may send frames
  under the bound, each marked "more", without end, and libzmq keeps them until the
  last one (it has no option against that). Only keeping strangers off the socket
  helps there: an ``ipc://`` socket in a private folder (``herald train``) or CURVE
  keys (NOTE [transport security] in herald/auth.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zmq

from herald.errors import ConfigError, ProtocolError

#: Every dtype the format can carry: fixed size, little endian or single byte.
KNOWN_DTYPES = {
    name: np.dtype(name)
    for name in ("<f2", "<f4", "<f8", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "|b1")
}
#: Exclusive bound of one dimension: keeps ``prod(shape) * itemsize`` meaningful.
MAX_DIM = 1 << 40
#: Bytes a frame may exceed its payload by on the wire, as ``ZMQ_MAXMSGSIZE`` counts
#: it: CurveZMQ's MESSAGE command adds 33 (measured, libzmq 4.3.5); the rest is margin
#: (NOTE [message size limits]).
FRAME_OVERHEAD_BYTES = 64


@dataclass(frozen=True)
class Protocol:
    """One protocol over NOTE [wire format]: its name, version, dtypes and limits.

    Args:
        name: shown in every error, e.g. ``"ps"``.
        version: int >= 0 written as ``v`` in every header; the receiver accepts only it.
        dtypes: allowed numpy dtype strings, a subset of :data:`KNOWN_DTYPES`.
        max_header_bytes: largest header frame accepted (and produced).
        max_frames: most array frames in one message.
        max_dims: most dimensions of one array.
        copy_threshold_bytes: frames below this size are copied by
            ``send_multipart(copy=False)`` on sockets passed to :meth:`configure`;
            ``None`` leaves pyzmq's default (64 KiB).

    Raises:
        ConfigError: an unknown dtype or a non-positive limit.
    """

    name: str
    version: int
    dtypes: frozenset
    max_header_bytes: int = 1 << 20
    max_frames: int = 4096
    max_dims: int = 4
    copy_threshold_bytes: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtypes", frozenset(self.dtypes))
        # allowed dtype -> its wire string (pack looks a.dtype up instead of building a.dtype.str)
        object.__setattr__(self, "_names", {KNOWN_DTYPES[n]: n for n in self.dtypes if n in KNOWN_DTYPES})
        unknown = sorted(self.dtypes.difference(KNOWN_DTYPES))
        if unknown or not self.dtypes:
            raise ConfigError(
                f"protocol {self.name!r}: dtypes {unknown or '(none)'} cannot go on the wire; "
                f"pick from {sorted(KNOWN_DTYPES)}"
            )
        positive = (self.max_header_bytes, self.max_frames, self.max_dims)
        threshold = 0 if self.copy_threshold_bytes is None else self.copy_threshold_bytes
        if any(type(x) is not int or x <= 0 for x in positive) or any(
            type(x) is not int or x < 0 for x in (self.version, threshold)
        ):
            raise ConfigError(
                f"protocol {self.name!r}: max_header_bytes, max_frames and max_dims must be "
                f"ints > 0, version and copy_threshold_bytes ints >= 0; got {self}"
            )

    # ------------------------------------------------------------------ send
    def pack(self, header: dict[str, Any], arrays: Iterable[np.ndarray] = ()) -> list:
        """Frames of one message: ``header`` plus ``v`` and ``arrays``, then the arrays.

        Args:
            header: msgpack-able map with a str ``op`` (not modified).
            arrays: each of an allowed dtype and at most ``max_dims`` dims; copied
                only if not C-contiguous.

        Returns:
            ``[bytes, ndarray, ...]`` for ``socket.send_multipart(frames, copy=False)``;
            do not modify the arrays until sent.

        Raises:
            ProtocolError: a dtype not allowed, too many dims or arrays, an oversized header.
        """
        descs, frames = [], [b""]
        names, max_dims = self._names, self.max_dims
        for a in arrays:
            a = np.ascontiguousarray(a)
            dt = names.get(a.dtype)  # not a.dtype.str: that builds a new string (~0.3 us)
            if dt is None or a.ndim > max_dims:
                raise ProtocolError(
                    f"{self.name}: cannot send a {a.dtype.str} array of shape {a.shape}; allowed "
                    f"dtypes {sorted(self.dtypes)}, at most {self.max_dims} dims (convert it first)"
                )
            descs.append([dt, list(a.shape)])
            frames.append(a)
        if len(descs) > self.max_frames:
            raise ProtocolError(
                f"{self.name}: {len(descs)} arrays exceed {self.max_frames} per message; split the message"
            )
        head = dict(header)
        head["v"] = self.version
        head["arrays"] = descs
        frames[0] = msgpack.packb(head, use_bin_type=True)
        if len(frames[0]) > self.max_header_bytes:
            raise ProtocolError(
                f"{self.name}: header of {len(frames[0])} bytes exceeds {self.max_header_bytes}; "
                "move bulk data into arrays"
            )
        return frames

    def configure(self, sock, max_array_bytes: int | None = None) -> None:
        """Apply the protocol's socket settings to a zmq socket, before it binds or connects.

        Args:
            sock: the socket; its ``copy_threshold`` becomes ``copy_threshold_bytes``.
            max_array_bytes: the largest array frame a legitimate message received on
                ``sock`` carries, in bytes (NOTE [message size limits]): the socket's
                ``ZMQ_MAXMSGSIZE`` becomes :meth:`max_frame_bytes` of it, and a peer
                that sends a larger frame is cut off before it is buffered. None: no
                bound (a socket that only hears a peer it dialled and trusts).

        Raises:
            ConfigError: ``max_array_bytes`` is not an int >= 0.
        """
        if self.copy_threshold_bytes is not None:
            sock.copy_threshold = self.copy_threshold_bytes
        if max_array_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes(max_array_bytes))

    def max_frame_bytes(self, max_array_bytes: int) -> int:
        """The ``ZMQ_MAXMSGSIZE`` of a socket whose largest legitimate array frame is
        ``max_array_bytes``: the larger of it and ``max_header_bytes``, plus
        :data:`FRAME_OVERHEAD_BYTES` (NOTE [message size limits]).

        Raises:
            ConfigError: ``max_array_bytes`` is not an int >= 0.
        """
        if type(max_array_bytes) is not int or max_array_bytes < 0:
            raise ConfigError(f"{self.name}: max_array_bytes must be an int >= 0, got {max_array_bytes!r}")
        return max(self.max_header_bytes, max_array_bytes) + FRAME_OVERHEAD_BYTES

    # ------------------------------------------------------------------ receive
    def unpack(self, frames: Sequence[Any]) -> tuple[dict[str, Any], list[np.ndarray]]:
        """Decode and validate one message (frames: ``zmq.Frame``, bytes or buffers).

        Returns:
            ``(header, arrays)``; arrays are views on the received buffers.

        Raises:
            ProtocolError: see :meth:`unpack_header` and :meth:`unpack_arrays`.
        """
        if not frames:
            raise ProtocolError(f"{self.name}: empty message (no header frame)")
        header = self.unpack_header(frames[0])
        return header, self.unpack_arrays(header, frames[1:])

    def unpack_header(self, frame: Any) -> dict[str, Any]:
        """Parse and check a header frame, its array descriptors included.

        Raises:
            ProtocolError: too large, not msgpack, not a map, another version, no str
                ``op``, or a bad ``arrays`` list (count, dtype, dims).
        """
        raw = memoryview(getattr(frame, "buffer", frame))
        if raw.nbytes > self.max_header_bytes:
            raise ProtocolError(f"{self.name}: header of {raw.nbytes} bytes exceeds {self.max_header_bytes}")
        try:
            header = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise ProtocolError(f"{self.name}: header is not valid msgpack ({type(exc).__name__})") from None
        if type(header) is not dict:
            raise ProtocolError(f"{self.name}: header must be a msgpack map, got {type(header).__name__}")
        v = header.get("v")
        if type(v) is not int or v != self.version:
            raise ProtocolError(
                f"{self.name}: message of protocol version {v!r:.20}, expected version "
                f"{self.version}; run the same herald release on both ends"
            )
        if type(header.get("op")) is not str:
            raise ProtocolError(f"{self.name}: header must carry a str 'op'")
        descs = header.get("arrays")
        if type(descs) is not list or len(descs) > self.max_frames:
            raise ProtocolError(
                f"{self.name}: header 'arrays' must be a list of at most {self.max_frames} "
                f"[dtype, shape] pairs, got {type(descs).__name__}"
            )
        dtypes, max_dims = self.dtypes, self.max_dims
        for i, d in enumerate(descs):
            if not (
                type(d) is list and len(d) == 2 and type(d[0]) is str and type(d[1]) is list and len(d[1]) <= max_dims
            ):
                self._bad_descriptor(i, d)
            for n in d[1]:  # a loop, not all(...): every message's header passes here
                if type(n) is not int or not 0 <= n < MAX_DIM:
                    self._bad_descriptor(i, d)
            if d[0] not in dtypes:
                raise ProtocolError(
                    f"{self.name}: array {i}: dtype {d[0]!r:.20} not allowed; allowed: {sorted(dtypes)}"
                )
        return header

    def _bad_descriptor(self, i: int, d: Any) -> None:
        raise ProtocolError(
            f"{self.name}: array {i}: descriptor must be [dtype, [dims...]] with at most "
            f"{self.max_dims} dims, each in [0, 2**40); got {d!r:.80}"
        )

    def unpack_arrays(self, header: dict[str, Any], frames: Sequence[Any], readonly: bool = False) -> list[np.ndarray]:
        """Zero-copy arrays of the array frames, checked against ``header["arrays"]``.

        Args:
            header: from :meth:`unpack_header` (its descriptors are trusted here).
            frames: the frames after the header.
            readonly: views that cannot be written (zmq frames are writable buffers);
                False: as writable as the frame.

        Raises:
            ProtocolError: frame count or a frame's byte size disagrees with the header.
        """
        descs = header["arrays"]
        if len(descs) != len(frames):
            raise ProtocolError(
                f"{self.name}: header describes {len(descs)} arrays but {len(frames)} array frames arrived"
            )
        out = []
        for i, ((dt, shape), frame) in enumerate(zip(descs, frames)):
            buf = getattr(frame, "buffer", None)  # a zmq.Frame's memoryview, else the frame's
            if buf is None:
                buf = memoryview(frame)
            if readonly:
                buf = buf.toreadonly()
            try:  # a view, as np.frombuffer(...).reshape(shape); the descriptor's dims are checked
                a = np.ndarray(shape, KNOWN_DTYPES[dt], buf)
            except (TypeError, ValueError):  # the frame is too small, or the shape overflows
                a = None
            if a is None or a.nbytes != buf.nbytes:
                expected = math.prod(shape) * KNOWN_DTYPES[dt].itemsize  # exact: Python ints
                raise ProtocolError(
                    f"{self.name}: array {i}: header says {expected} bytes ({dt} {shape}) "
                    f"but the frame has {buf.nbytes}"
                )
            out.append(a)
        return out


#: Frames under 1 MiB (a micro-batch's blob, an ack) are copied by ``send(copy=False)``, as
#: the PS protocol's: a memcpy is cheaper than pyzmq's zero-copy bookkeeping (its
#: garbage-collector thread took 2.5% of a 2-worker job's CPU samples, py-spy).
DISPATCH = Protocol("dispatch", 1, KNOWN_DTYPES.keys(), max_dims=4, copy_threshold_bytes=1 << 20)
#: :meth:`Protocol.pack` / :meth:`Protocol.unpack` of :data:`DISPATCH`.
pack = DISPATCH.pack
unpack = DISPATCH.unpack

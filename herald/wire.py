"""Multipart message codec: one msgpack header frame, then raw array frames.

NOTE [wire format] (DESIGN "Wire format"): a message is ``[header, a_0, ..., a_k]``.
``header`` is a msgpack map with at least ``op`` (str) and ``arrays``: a list of
``[dtype, shape]`` pairs, one per following frame, where ``dtype`` is a numpy
dtype string from :data:`ALLOWED_DTYPES` and ``shape`` a list of non-negative ints.
Each array frame holds exactly ``prod(shape) * itemsize`` bytes, C order, little
endian, and is sent with ``copy=False``. The receiver checks the header against
the frames before touching any array; nothing is ever unpickled.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import msgpack
import numpy as np

from herald.errors import ProtocolError

ALLOWED_DTYPES = frozenset({"<f4", "<f2", "<f8", "<u8", "<i8", "<i4", "<u4", "<u2", "<i2", "|u1", "|b1", "|i1"})
MAX_HEADER_BYTES = 1 << 20
MAX_DIMS = 4
_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}


def pack(header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> list:
    """Frames for ``header`` and ``arrays`` (the header gains an ``arrays`` entry).

    Returns:
        ``[bytes, ndarray, ...]``, ready for ``socket.send_multipart(frames, copy=False)``.
    """
    arrays = [np.ascontiguousarray(a) for a in arrays]
    head = dict(header)
    head["arrays"] = [[a.dtype.str, list(a.shape)] for a in arrays]
    return [msgpack.packb(head, use_bin_type=True), *arrays]


def unpack(frames: Sequence[Any]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Decode and validate a message from :func:`pack` (frames may be ``zmq.Frame``).

    Returns:
        ``(header, arrays)``; arrays are read-only views on the received buffers.

    Raises:
        ProtocolError: a malformed header, a dtype outside :data:`ALLOWED_DTYPES`,
            a bad shape, or a frame whose size does not match its header entry.
    """
    if not frames:
        raise ProtocolError("empty message")
    raw = _buffer(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ProtocolError("header must be a map with a string 'op'")
    specs = header.get("arrays", [])
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise ProtocolError(f"header describes {len(specs) if isinstance(specs, list) else '?'} arrays "
                            f"but {len(frames) - 1} array frames arrived")
    arrays = []
    for i, (spec, frame) in enumerate(zip(specs, frames[1:])):
        arrays.append(_array(i, spec, _buffer(frame)))
    return header, arrays


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else memoryview(buf)


def _array(i: int, spec: Any, buf: memoryview) -> np.ndarray:
    if (not isinstance(spec, list) or len(spec) != 2 or not isinstance(spec[0], str)
            or not isinstance(spec[1], list) or len(spec[1]) > MAX_DIMS
            or not all(isinstance(d, int) and 0 <= d < 2**40 for d in spec[1])):
        raise ProtocolError(f"array {i}: spec must be [dtype, [dims...]] with at most {MAX_DIMS} dims, got {spec!r:.80}")
    dtype, shape = spec
    dt = _DTYPES.get(dtype)
    if dt is None:
        raise ProtocolError(f"array {i}: dtype {dtype!r} not allowed; allowed: {sorted(ALLOWED_DTYPES)}")
    expected = math.prod(shape) * dt.itemsize  # exact: Python ints, dims < 2**40 checked above
    if expected != len(buf):
        raise ProtocolError(f"array {i}: header says {expected} bytes ({dtype} {shape}) but the frame has {len(buf)}")
    return np.frombuffer(buf, dtype=dt).reshape(shape)

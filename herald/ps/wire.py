"""Encoding and validation of PS messages: NOTE [ps wire protocol] in docs/ps.md.

A message is ``[header, frame_0, frame_1, ...]``: the header is a msgpack map; each
array frame is raw little-endian bytes whose dtype and shape the header declares
(``"frames": [[dtype, shape], ...]``). Frames are sent with ``copy=False`` and read
with ``np.frombuffer`` (zero copy). Nothing is ever unpickled; msgpack is decoded with
size limits and only plain types are accepted.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgpack
import numpy as np

from herald.errors import ProtocolError

VERSION = 1
MAX_HEADER_BYTES = 1 << 20
MAX_FRAMES = 4096
#: Frames below this size are copied by ``send(copy=False)`` anyway: a memcpy of up to
#: 1 MiB is cheaper than pyzmq's zero-copy bookkeeping (its garbage-collector thread).
COPY_THRESHOLD_BYTES = 1 << 20
#: dtype names allowed on the wire (little-endian, no objects).
DTYPES = {"u8": np.dtype("<u8"), "f4": np.dtype("<f4"), "u2": np.dtype("<u2")}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

#: Requests; the replies carry the same op. Mutating ops are deduplicated by
#: (client id, request id) on the shard, so every op is safe to retry.
OPS = ("declare", "pull", "push_grad", "push_rows", "stats", "checkpoint", "restore", "shutdown", "ping")
MUTATING = frozenset({"declare", "push_grad", "push_rows", "checkpoint", "restore"})
#: Array frames per part: name -> (dtype, trailing shape kind).
PART_FRAMES = {
    "pull": (("keys", "u8"),),
    "push_grad": (("keys", "u8"), ("grads", "f4"), ("contributors", "u2")),
    "push_rows": (("keys", "u8"), ("rows", "f4")),
}


def encode(header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> list:
    """``[header bytes, array buffers...]`` ready for ``send_multipart(copy=False)``.

    ``header["frames"]`` is filled from ``arrays`` (each C-contiguous, a wire dtype).
    """
    frames_meta = []
    buffers = []
    for a in arrays:
        a = np.ascontiguousarray(a)
        name = _DTYPE_NAMES.get(a.dtype)
        if name is None:
            raise ProtocolError(f"dtype {a.dtype} cannot go on the wire; use one of {sorted(DTYPES)}")
        frames_meta.append([name, list(a.shape)])
        buffers.append(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
    header = dict(header)
    header["v"] = VERSION
    header["frames"] = frames_meta
    return [msgpack.packb(header, use_bin_type=True)] + buffers


def decode_header(buf) -> dict[str, Any]:
    """Parse and type-check a header frame.

    Raises:
        ProtocolError: not msgpack, not a map, wrong version, or a bad ``frames`` list.
    """
    if len(buf) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(buf)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(bytes(buf), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a msgpack map")
    if header.get("v") != VERSION:
        raise ProtocolError(f"header version {header.get('v')!r} unsupported; expected {VERSION}")
    frames = header.get("frames")
    if not isinstance(frames, list) or len(frames) > MAX_FRAMES:
        raise ProtocolError("header 'frames' must be a list of [dtype, shape]")
    for f in frames:
        if not (isinstance(f, list) and len(f) == 2 and f[0] in DTYPES and isinstance(f[1], list)
                and len(f[1]) <= 2 and all(type(d) is int and 0 <= d < (1 << 40) for d in f[1])):
            raise ProtocolError(f"bad frame descriptor {f!r}: expected [dtype in {sorted(DTYPES)}, shape]")
    return header


def decode_arrays(header: dict[str, Any], frames: Sequence) -> list[np.ndarray]:
    """Zero-copy arrays of the array frames; their sizes must match the header exactly.

    Raises:
        ProtocolError: frame count or byte size disagrees with the header.
    """
    meta = header["frames"]
    if len(meta) != len(frames):
        raise ProtocolError(f"header declares {len(meta)} array frames, message has {len(frames)}")
    out = []
    for (name, shape), frame in zip(meta, frames):
        dtype = DTYPES[name]
        buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if buf.nbytes != expected:
            raise ProtocolError(f"frame of {buf.nbytes} bytes, header says {name}{shape} = {expected} bytes")
        arr = np.frombuffer(buf, dtype=dtype) if expected else np.zeros(0, dtype)
        out.append(arr.reshape(shape))
    return out


def get_int(header: dict[str, Any], key: str, lo: int, hi: int) -> int:
    """``header[key]`` as an int in ``[lo, hi]`` or :class:`ProtocolError`."""
    v = header.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(f"header field {key!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def get_str(header: dict[str, Any], key: str, max_len: int = 4096) -> str:
    v = header.get(key)
    if not isinstance(v, str) or len(v) > max_len:
        raise ProtocolError(f"header field {key!r} must be a string, got {type(v).__name__}")
    return v

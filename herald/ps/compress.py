"""Lossy wire compression of embedding values and gradients: fp16 (scaled), bf16, int8.

NOTE [wire compression] (docs/ps.md, "Wire compression"). Only the wire changes: the
PS stores, aggregates and applies optimizers in float32, and so does the worker cache.
A compressed block is one row (one embedding or one gradient) of ``dim`` values:

- ``fp16``: Persia §4.2.3 (lossy compression with a per-block scaling factor). Each row
  is divided by ``scale = 2**(e - 14)`` where ``max|row| = m * 2**e`` (``m`` in
  ``[0.5, 1)``): a power of two, so the scaling itself is exact and the row's largest
  magnitude lands in ``[2**13, 2**14)``, well inside fp16's range (max 65504). Every
  element with ``|x| >= max|row| * 2**-27`` (an fp16 normal) comes back with relative
  error <= 2**-11; smaller ones with absolute error <= ``max|row| * 2**-38``.
  Frames: payload ``<f2 [n, dim]``, scales ``<f4 [n]``.
- ``bf16``: plain bfloat16 (HT §4.2): the top 16 bits of the float32, rounded to
  nearest even; relative error <= 2**-8. Frames: payload ``<u2 [n, dim]`` (bit
  pattern; numpy has no bf16), scales ``<f4 [0]`` (unused).
- ``int8``: row-wise symmetric quantisation (HT §4.2): ``scale = max|row| / 127``,
  ``q = rint(x / scale)`` in ``[-127, 127]``; absolute error <= ``max|row| / 254``.
  Frames: payload ``|i1 [n, dim]``, scales ``<f4 [n]``.

A zero row has scale 0 and decodes to zeros. Non-finite input is refused before
encoding (:class:`~herald.errors.DataError`): a NaN would hide in the scale.

Which payloads are compressed (``--wire-dtype``; request header field ``wire``):
gradients of ``push_grad``, and the *embedding* part (first ``dim`` values) of the rows
of ``pull`` replies and ``push_rows`` write-backs. The optimizer state of a row
(Adagrad sums, Adam moments) always travels as float32 frames: quantising an Adagrad
accumulator changes every later step size, and the state is what makes a worker's
local update equal to the PS's. Per part, the frames are::

    push_grad   keys <u8 [n], payload [n, dim], scales <f4, contributors <u2 [n]
    push_rows   keys <u8 [n], payload [n, dim], scales <f4, state <f4 [n, state_dim]
    pull reply  payload [n, dim], scales <f4, state <f4 [n, state_dim]

With ``fp32`` (the default) no ``wire`` field is sent and the messages are exactly the
uncompressed ones (NOTE [ps wire protocol]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from herald.contracts.vocab import WIRE_DTYPES
from herald.errors import ConfigError, DataError, ProtocolError

#: numpy dtype of the payload frame of each compressed format.
PAYLOAD_DTYPES: dict[str, np.dtype] = {"fp16": np.dtype("<f2"), "bf16": np.dtype("<u2"), "int8": np.dtype("|i1")}
#: Largest scaled magnitude of an fp16 row is below 2**FP16_TOP (NOTE [wire compression]).
FP16_TOP = 14
_F32_MIN_EXP = -149  # smallest float32 (subnormal) is 2**-149


def check_wire_dtype(wire: str) -> str:
    """``wire`` if it is one of :data:`WIRE_DTYPES`, else :class:`ConfigError` naming them."""
    if wire not in WIRE_DTYPES:
        raise ConfigError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)} (--wire-dtype), got {wire!r}")
    return wire


def row_bytes(wire: str, dim: int) -> int:
    """Bytes of one embedding or gradient row of ``dim`` values on the wire (payload and
    its scale; keys and optimizer state not included)."""
    if check_wire_dtype(wire) == "fp32":
        return 4 * dim
    return PAYLOAD_DTYPES[wire].itemsize * dim + (0 if wire == "bf16" else 4)


# --------------------------------------------------------------------- codecs
def encode(x: np.ndarray, wire: str) -> tuple[np.ndarray, np.ndarray]:
    """Compress rows: ``x`` float32 [n, dim] -> ``(payload [n, dim], scales float32 [n]
    or [0] for bf16)`` (NOTE [wire compression]).

    Raises:
        ConfigError: ``wire`` is not a compressed format.
        DataError: ``x`` is not 2-d or holds NaN or infinity (names the row).
    """
    if check_wire_dtype(wire) == "fp32":
        raise ConfigError("encode() is for fp16, bf16 and int8; fp32 rows go on the wire as they are")
    x = np.asarray(x, np.float32)
    if x.ndim != 2:
        raise DataError(f"encode: rows must be 2-d [n, dim], got shape {x.shape}")
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        raise DataError(
            f"encode: row {int(np.argmin(finite))} holds NaN or infinity; nothing is sent. "
            "Fix the values (a diverged loss?) before pushing them"
        )
    if wire == "bf16":
        return _bf16_encode(x), np.empty(0, np.float32)
    amax = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    if wire == "fp16":
        _, e = np.frexp(amax)
        # amax = m * 2**e, m in [0.5, 1): amax / 2**(e - 14) = m * 2**14 is in [2**13, 2**14)
        scales = np.where(amax > 0, np.ldexp(np.float32(1), np.maximum(e - FP16_TOP, _F32_MIN_EXP)), 0).astype(
            np.float32
        )
        payload = _divide(x, scales).astype(np.float16)
        return payload, scales
    scales = (amax / np.float32(127)).astype(np.float32)
    q = np.rint(_divide(x, scales))
    return np.clip(q, -127, 127).astype(np.int8), scales


def decode(payload: np.ndarray, scales: np.ndarray, wire: str) -> np.ndarray:
    """Inverse of :func:`encode`: float32 [n, dim] (a new array).

    Raises:
        ProtocolError: dtype or shapes that do not match ``wire`` (the frames came from
            a peer: the message names what was expected).
    """
    check_wire_dtype(wire)
    want = PAYLOAD_DTYPES.get(wire)
    if want is None or payload.dtype != want or payload.ndim != 2:
        raise ProtocolError(f"{wire} payload must be a 2-d {want} array, got {payload.dtype.str} {payload.shape}")
    n_scales = 0 if wire == "bf16" else payload.shape[0]
    if scales.dtype != np.float32 or scales.shape != (n_scales,):
        raise ProtocolError(f"{wire} scales must be float32 [{n_scales}], got {scales.dtype.str} {scales.shape}")
    if wire == "bf16":
        return (payload.astype(np.uint32) << 16).view(np.float32)
    return payload.astype(np.float32) * scales[:, None]


def _divide(x: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``x / scales[:, None]`` in float64 (exact for power-of-two scales), 0 where a scale is 0."""
    s = scales.astype(np.float64)[:, None]
    return np.divide(x, s, out=np.zeros(x.shape, np.float64), where=s != 0)


def _bf16_encode(x: np.ndarray) -> np.ndarray:
    """Top 16 bits of float32 ``x``, rounded to nearest even; a finite value that would
    round to infinity is truncated instead (stays the largest finite bf16)."""
    bits = np.ascontiguousarray(x).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    overflow = (rounded & np.uint32(0x7F80)) == np.uint32(0x7F80)
    return np.where(overflow, bits >> np.uint32(16), rounded).astype(np.uint16)


# ----------------------------------------------------------- message frames
def wire_of(header: dict[str, Any]) -> str:
    """The ``wire`` field of a request header (absent: ``fp32``), or :class:`ProtocolError`."""
    wire = header.get("wire", "fp32")
    if wire not in WIRE_DTYPES:
        raise ProtocolError(f"header field 'wire' must be one of {list(WIRE_DTYPES)}, got {wire!r:.40}")
    return wire


def tagged(header: dict[str, Any], wire: str) -> dict[str, Any]:
    """``header`` naming its frames' ``wire`` dtype (a copy), or as it is for fp32."""
    return header if wire == "fp32" else dict(header, wire=wire)


def encode_part(op: str, arrays: Sequence[np.ndarray], dim: int, wire: str) -> list[np.ndarray]:
    """The frames of one part of ``push_grad`` (``keys, grads, contributors``) or
    ``push_rows`` (``keys, rows``) in ``wire`` (NOTE [wire compression]; unchanged for fp32).

    Raises:
        DataError: non-finite values to compress.
    """
    if wire == "fp32":
        return list(arrays)
    if op == "push_grad":
        keys, grads, contributors = arrays
        return [keys, *encode(grads, wire), contributors]
    keys, rows = arrays
    return [keys, *encode(rows[:, :dim], wire), np.ascontiguousarray(rows[:, dim:])]


def decode_request(op: str, header: dict[str, Any], arrays: list) -> list:
    """Server side: the frames of a compressed ``push_grad`` / ``push_rows`` request of
    per-table parts turned back into the float32 layout of NOTE [ps wire protocol]
    (unchanged for fp32).

    Raises:
        ProtocolError: a bad ``wire`` field, frame count, dtype or shape.
    """
    wire = wire_of(header)
    if wire == "fp32":
        return arrays
    if len(arrays) % 4:
        raise ProtocolError(f"{op} with wire {wire}: each part needs 4 frames, got {len(arrays)} frames")
    return [a for k in range(0, len(arrays), 4) for a in decode_part(op, arrays[k : k + 4], wire)]


def decode_part(op: str, frames: Sequence[np.ndarray], wire: str) -> list:
    """Server side: one part's ``push_grad`` (``keys, payload, scales, contributors``) or
    ``push_rows`` (``keys, payload, scales, state``) frames in ``wire`` turned back into the
    float32 layout (``keys, grads, contributors`` / ``keys, rows``); fp32 frames as they are.

    Raises:
        ProtocolError: a frame count, dtype or shape that does not match ``wire``.
    """
    if wire == "fp32":
        return list(frames)
    if len(frames) != 4:
        raise ProtocolError(f"{op} with wire {wire}: each part needs 4 frames, got {len(frames)}")
    keys, payload, scales, last = frames
    values = decode(payload, scales, wire)
    if op == "push_grad":
        return [keys, values, last]
    if last.dtype != np.float32 or last.ndim != 2 or last.shape[0] != values.shape[0]:
        raise ProtocolError(
            f"push_rows with wire {wire}: optimizer state must be float32 [{values.shape[0]}, "
            f"state_dim], got {last.dtype.str} {last.shape}"
        )
    return [keys, np.concatenate([values, last], axis=1) if last.shape[1] else values]


def encode_rows(rows: np.ndarray, dim: int, wire: str) -> list[np.ndarray]:
    """Server side: the frames of one ``pull`` reply part (``[rows]`` for fp32)."""
    if wire == "fp32":
        return [rows]
    return [*encode(rows[:, :dim], wire), np.ascontiguousarray(rows[:, dim:])]


def decode_rows(frames: Sequence[np.ndarray], wire: str) -> list[np.ndarray]:
    """Client side: the rows (float32 [n, row_width]) of each part of a ``pull`` reply.

    Raises:
        ProtocolError: frames that do not match ``wire``.
    """
    if wire == "fp32":
        return list(frames)
    if len(frames) % 3:
        raise ProtocolError(f"pull reply with wire {wire}: each part needs 3 frames, got {len(frames)}")
    out = []
    for k in range(0, len(frames), 3):
        payload, scales, state = frames[k : k + 3]
        values = decode(payload, scales, wire)
        if state.dtype != np.float32 or state.ndim != 2 or state.shape[0] != values.shape[0]:
            raise ProtocolError(
                f"pull reply with wire {wire}: state must be float32 [{values.shape[0]}, "
                f"state_dim], got {state.dtype.str} {state.shape}"
            )
        out.append(np.concatenate([values, state], axis=1) if state.shape[1] else values)
    return out

"""The PS protocol: its :class:`~herald.wire.Protocol` and op schemas.

NOTE [ps wire protocol] in docs/ps.md lists the ops and header fields; the framing
(header + raw array frames, validation, zero copy) is NOTE [wire format] in
herald/wire.py, encoded and decoded by :data:`PS`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from herald.errors import ProtocolError
from herald.ps import kernels as K
from herald.wire import Protocol

#: Version 3: NOTE [wire format] layout (``arrays`` with numpy dtype strings); flat parts
#: (NOTE [ps wire protocol]: one part carries keys of many tables, a tables frame first).
#: Frames under 1 MiB are copied by ``send(copy=False)`` anyway: a memcpy of up to
#: 1 MiB is cheaper than pyzmq's zero-copy bookkeeping (its garbage-collector thread).
#: ``<f2`` and ``|i1`` carry compressed payloads (NOTE [wire compression], herald/ps/compress.py);
#: ``|u1``, ``<u2``, ``<u4`` and ``<u8`` clock frames (:data:`CLOCK_DTYPES`).
PS = Protocol(
    "ps",
    3,
    frozenset({"<u8", "<f4", "<u2", "<f2", "|i1", "|u1", "<u4"}),
    max_header_bytes=1 << 20,
    max_frames=4096,
    max_dims=2,
    copy_threshold_bytes=1 << 20,
)

#: Requests; the replies carry the same op. Mutating ops are deduplicated by
#: (client id, request id) on the shard, so every op is safe to retry.
OPS = (
    "declare",
    "pull",
    "push_grad",
    "push_rows",
    "stats",
    "checkpoint",
    "restore",
    "shutdown",
    "ping",
    "gba_push",
    "gba_pull",
    "step",
)
MUTATING = frozenset({"declare", "push_grad", "push_rows", "checkpoint", "restore", "gba_push", "step"})
#: Ops that carry the job's admin token (header ``token``), checked by the shard before
#: anything else: NOTE [ps admin ops] (herald/ps/admin.py).
ADMIN = frozenset({"checkpoint", "restore", "shutdown"})
#: The first frame of a flat part (``{"flat": true}``): the table index of every key.
TABLES_DTYPE = "<u2"
#: Array frames per part: op -> ((name, wire dtype), ...); a flat part has the tables frame
#: (:data:`TABLES_DTYPE` [n]) before them.
PART_FRAMES = {
    "pull": (("keys", "<u8"),),
    "push_grad": (("keys", "<u8"), ("grads", "<f4"), ("contributors", "<u2")),
    "push_rows": (("keys", "<u8"), ("rows", "<f4")),
    # NOTE [gba tokens] (herald/ps/gba.py): a micro-batch's gradients with its token, and the
    # token-gated read (its reply: rows per part, then the dense log when asked)
    "gba_push": (("keys", "<u8"), ("grads", "<f4")),
    "gba_pull": (("keys", "<u8"),),
}
#: With a request header ``wire`` other than fp32 (NOTE [wire compression]): the frames
#: per part, ``payload`` in ``<f2`` (fp16), ``<u2`` (bf16) or ``|i1`` (int8); decoded by
#: herald/ps/compress.py into the :data:`PART_FRAMES` layout before anything else.
COMPRESSED_PART_FRAMES = {
    "pull_reply": ("payload", ("scales", "<f4"), ("state", "<f4")),
    "push_grad": (("keys", "<u8"), "payload", ("scales", "<f4"), ("contributors", "<u2")),
    "push_rows": (("keys", "<u8"), "payload", ("scales", "<f4"), ("state", "<f4")),
}

# NOTE [clock frames]
# ~~~~~~~~~~~~~~~~~~~
# HET's clocks ride on pulls and pushes (HET §4.1; NOTE [embedding clocks] in
# herald/ps/table.py, NOTE [bounded reads] in herald/worker/consistency_bounded.py):
#
# - Conditional pull: a ``pull`` whose header holds ``staleness`` s (int >= 0). Each part
#   is ``keys <u8 [n]``, ``clocks [m]`` (m <= n): the first m keys' cached copies' c_c;
#   the other n - m keys have no copy that may be read (no copy, or CheckValid's first
#   condition c_c <= c_s + s failed on the worker) and are always fetched. Key i < m is
#   valid when ``c_g <= c_c + s`` (:func:`valid_copies`, CheckValid's second condition,
#   evaluated by the shard). Reply per part: ``clocks [n]`` (c_g of every key), then the
#   normal pull reply frames (rows, or NOTE [wire compression]'s payload, scales, state) of
#   the keys that are *not* valid, in key order; the client recomputes which from the
#   returned c_g. Only clocks travel for a valid hit.
# - Clock advances on writes: a ``push_rows`` whose header holds ``advance: true`` ends
#   each part (after its rows, or its compressed frames) with ``advance [n]``: the local
#   updates (c_c - c_s) of each written row, added to its c_g as the row is stored
#   (Het.Cache.Evict). With ``read_clocks: true`` too, the reply carries one ``clocks [n]``
#   frame per part: c_g after the advance (the plan-pushed copies' new c_s).
#
# Clock frames are unsigned counts in the narrowest of :data:`CLOCK_DTYPES` that holds the
# frame's largest value (:func:`pack_clocks`; mostly one or two bytes a key instead of
# eight); a receiver widens them to uint64 (:func:`unpack_clocks`). A plain pull or
# push_rows (no ``staleness``, no ``advance``) is unchanged, bit for bit.

#: Wire dtypes of a clock frame (NOTE [clock frames]), narrowest first.
CLOCK_DTYPES = ("|u1", "<u2", "<u4", "<u8")
_CLOCK_TOPS = tuple(int(np.iinfo(np.dtype(d)).max) for d in CLOCK_DTYPES)


def pack_clocks(clocks: np.ndarray) -> np.ndarray:
    """uint64 [n] clocks as the narrowest :data:`CLOCK_DTYPES` array that holds them (NOTE [clock frames])."""
    clocks = np.asarray(clocks, np.uint64)
    top = int(clocks.max()) if clocks.shape[0] else 0
    dt = next(d for d, hi in zip(CLOCK_DTYPES, _CLOCK_TOPS) if top <= hi)
    return clocks.astype(np.dtype(dt))


def unpack_clocks(frame: np.ndarray, what: str, n: int, prefix: bool = False) -> np.ndarray:
    """A received clock frame as uint64 [len] (a new, aligned array): 1-d, one of
    :data:`CLOCK_DTYPES`, of length ``n`` (at most ``n`` with ``prefix``).

    Raises:
        ProtocolError: another dtype or shape (``what`` names the frame).
    """
    size = frame.shape[0] if frame.ndim == 1 else -1
    if frame.dtype.str not in CLOCK_DTYPES or not (0 <= size <= n if prefix else size == n):
        raise ProtocolError(
            f"{what}: a clock frame must be 1-d {'/'.join(CLOCK_DTYPES)} of length "
            f"{'at most ' if prefix else ''}{n}, got {frame.dtype.str} {frame.shape}"
        )
    return frame.astype(np.uint64)


def put_rows(out: np.ndarray, pos: np.ndarray | None, rows: np.ndarray, what: str) -> None:
    """``out[pos] = rows``: one reply's rows (float32 [len(pos), width]) back in key order in
    ``out`` (float32 [n, width]; ``pos`` int64 positions, None: all n), by a kernel
    (:func:`~herald.ps.kernels.put_rows_jit`: numpy's copies small rows one by one).

    Raises:
        ProtocolError: ``rows`` of another dtype or shape (``what`` names the reply).
    """
    n = out.shape[0] if pos is None else pos.shape[0]
    if rows.dtype != np.float32 or rows.shape != (n, out.shape[1]):
        raise ProtocolError(f"{what}: rows must be float32 [{n}, {out.shape[1]}], got {rows.dtype.str} {rows.shape}")
    K.put_rows_jit(out, pos, rows)


def valid_copies(c_c: np.ndarray, c_g: np.ndarray, staleness: int) -> np.ndarray:
    """bool [m]: CheckValid's second condition ``c_g <= c_c + s`` (uint64 [m] each; no overflow)."""
    return (c_g <= c_c) | (c_g - c_c <= np.uint64(staleness))


def get_int(header: dict[str, Any], key: str, lo: int, hi: int) -> int:
    """``header[key]`` as an int in ``[lo, hi]`` or :class:`ProtocolError`."""
    v = header.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(f"header field {key!r} must be an int in [{lo}, {hi}], got {v!r:.40}")
    return v


def get_flag(header: dict[str, Any], key: str) -> bool:
    """``header[key]`` as a bool (absent: False) or :class:`ProtocolError`."""
    v = header.get(key, False)
    if type(v) is not bool:
        raise ProtocolError(f"header field {key!r} must be true or false, got {v!r:.40}")
    return v


def get_str(header: dict[str, Any], key: str, max_len: int = 4096) -> str:
    """``header[key]`` as a str of at most ``max_len`` characters or :class:`ProtocolError`."""
    v = header.get(key)
    if not isinstance(v, str) or len(v) > max_len:
        raise ProtocolError(
            f"header field {key!r} must be a string of at most {max_len} characters, got {type(v).__name__}"
        )
    return v

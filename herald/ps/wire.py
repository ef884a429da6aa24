"""The PS protocol: its :class:`~herald.wire.Protocol` and op schemas.

NOTE [ps wire protocol] in docs/ps.md lists the ops and header fields; the framing
(header + raw array frames, validation, zero copy) is NOTE [wire format] in
herald/wire.py, encoded and decoded by :data:`PS`.
"""

from __future__ import annotations

from typing import Any

from herald.errors import ProtocolError
from herald.wire import Protocol

#: Version 2: NOTE [wire format] layout (``arrays`` with numpy dtype strings).
#: Frames under 1 MiB are copied by ``send(copy=False)`` anyway: a memcpy of up to
#: 1 MiB is cheaper than pyzmq's zero-copy bookkeeping (its garbage-collector thread).
#: ``<f2`` and ``|i1`` carry compressed payloads (NOTE [wire compression], herald/ps/compress.py).
PS = Protocol("ps", 2, frozenset({"<u8", "<f4", "<u2", "<f2", "|i1"}), max_header_bytes=1 << 20, max_frames=4096,
              max_dims=2, copy_threshold_bytes=1 << 20)

#: Requests; the replies carry the same op. Mutating ops are deduplicated by
#: (client id, request id) on the shard, so every op is safe to retry.
OPS = ("declare", "pull", "push_grad", "push_rows", "clocks", "stats", "checkpoint", "restore", "shutdown", "ping",
       "gba_push", "gba_pull")
MUTATING = frozenset({"declare", "push_grad", "push_rows", "clocks", "checkpoint", "restore", "gba_push"})
#: Ops that carry the job's admin token (header ``token``), checked by the shard before
#: anything else: NOTE [ps admin ops] (herald/ps/admin.py).
ADMIN = frozenset({"checkpoint", "restore", "shutdown"})
#: Array frames per part: op -> ((name, wire dtype), ...).
PART_FRAMES = {
    "pull": (("keys", "<u8"),),
    "push_grad": (("keys", "<u8"), ("grads", "<f4"), ("contributors", "<u2")),
    "push_rows": (("keys", "<u8"), ("rows", "<f4")),
    # NOTE [embedding clocks] (herald/ps/table.py): c_g += advance; the reply's frames are
    # the clocks after it, uint64 [n] per part (advance 0: a plain read).
    "clocks": (("keys", "<u8"), ("advance", "<u8")),
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


def get_int(header: dict[str, Any], key: str, lo: int, hi: int) -> int:
    """``header[key]`` as an int in ``[lo, hi]`` or :class:`ProtocolError`."""
    v = header.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(f"header field {key!r} must be an int in [{lo}, {hi}], got {v!r:.40}")
    return v


def get_str(header: dict[str, Any], key: str, max_len: int = 4096) -> str:
    """``header[key]`` as a str of at most ``max_len`` characters or :class:`ProtocolError`."""
    v = header.get(key)
    if not isinstance(v, str) or len(v) > max_len:
        raise ProtocolError(f"header field {key!r} must be a string of at most {max_len} characters, "
                            f"got {type(v).__name__}")
    return v

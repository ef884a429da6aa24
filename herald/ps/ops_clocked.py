"""HET's clocks riding on a shard's pulls and pushes: NOTE [clock frames] (herald/ps/wire.py).

The shard side of the clocked ops: a ``pull`` with ``staleness`` (a conditional pull) and
a ``push_rows`` with ``advance`` frames. They are variants of the rows ops, which hand them
over (:class:`~herald.ps.ops_rows.RowOps`); the client side is
:class:`~herald.ps.front_clocked.ClockFront`. The clocks themselves are NOTE [embedding
clocks] (herald/ps/table.py); the worker protocol using them is NOTE [bounded reads]
(herald/worker/consistency_bounded.py).
"""

from __future__ import annotations

from typing import Any

from herald.errors import ProtocolError
from herald.ps import compress, wire
from herald.ps.context import ShardContext


class ClockedOps:
    """The conditional pull and the clocked write-back of one shard.

    Args:
        ctx: the shard's :class:`~herald.ps.context.ShardContext`.
    """

    def __init__(self, ctx: ShardContext):
        self.ctx = ctx

    def pull(self, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
        """A conditional pull: per part c_g of every key, then the rows of the keys whose
        cached copy is not valid under the header's ``staleness``.

        Raises:
            ProtocolError: bad parts or clock frames, a key of another shard, a bound.
        """
        ctx = self.ctx
        staleness = wire.get_int(header, "staleness", 0, 1 << 62)
        wire_dtype = compress.wire_of(header)  # NOTE [wire compression]
        parts = ctx.parts.parse(header, arrays, "pull", clock="clocks")
        out = []
        for p in parts:
            c_g, rows, pending = ctx.store.pull_clocked(p.tables, p.keys, p.dim, p.width, p.rest[0], staleness)
            ctx.counters["pull_keys"] += rows.shape[0]
            ctx.counters["pull_valid_keys"] += p.keys.shape[0] - rows.shape[0]
            ctx.counters["pull_pending_keys"] += pending
            out += [wire.pack_clocks(c_g), *compress.encode_rows(rows, p.dim, wire_dtype)]
        reply = {"parts": [p.echo for p in parts]}
        return (dict(reply, wire=wire_dtype) if wire_dtype != "fp32" else reply), out

    def push_rows(self, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
        """A ``push_rows`` whose parts end with an advance frame (c_g += advance as each row
        is stored); with ``read_clocks`` the reply carries c_g after, one clock frame per part.

        Raises:
            ProtocolError: ``read_clocks`` without ``advance``, bad parts, a repeated key.
        """
        ctx = self.ctx
        if not wire.get_flag(header, "advance"):
            raise ProtocolError("push_rows: read_clocks needs advance frames (NOTE [clock frames])")
        read = wire.get_flag(header, "read_clocks")
        parts = ctx.parts.parse(header, arrays, "push_rows", clock="advance", wire_dtype=compress.wire_of(header))
        stamp = ctx.store.next_stamp()
        out = []
        for p in parts:
            c_g = ctx.store.push_rows(p.tables, p.keys, p.rest[0], p.rest[1], stamp)
            ctx.counters["push_rows_keys"] += p.keys.shape[0]
            if read:
                out.append(wire.pack_clocks(c_g))
        return ({"parts": [p.echo for p in parts]} if read else {}), out

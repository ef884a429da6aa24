"""HET's clocks riding on pulls and pushes: NOTE [clock frames] (herald/ps/wire.py).

The shard side (:func:`op_pull`, :func:`op_push_rows`: a ``pull`` with ``staleness``, a
``push_rows`` with ``advance``) and the client side (:class:`ClockOps`, mixed into
:class:`~herald.ps.client.PSClient`). The clocks themselves are NOTE [embedding clocks]
(herald/ps/table.py); the worker protocol using them is NOTE [bounded reads]
(herald/worker/consistency_bounded.py).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from herald.errors import ConfigError, ProtocolError
from herald.ps import compress, wire


# --------------------------------------------------------------------- shard side
def op_pull(server, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
    """A conditional pull on ``server`` (a ShardServer): per part c_g of every key, then the
    rows of the keys whose cached copy is not valid under the header's ``staleness``."""
    staleness = wire.get_int(header, "staleness", 0, 1 << 62)
    parts = server._parts(header, arrays, "pull", clock="clocks")
    wire_dtype = compress.wire_of(header)   # NOTE [wire compression]
    out = []
    for table, keys, (c_c,) in parts:
        c_g, rows, pending = table.pull_clocked(keys, c_c, staleness)
        server.counters["pull_keys"] += rows.shape[0]
        server.counters["pull_valid_keys"] += keys.shape[0] - rows.shape[0]
        server.counters["pull_pending_keys"] += pending
        out += [wire.pack_clocks(c_g), *compress.encode_rows(rows, table.cfg.dim, wire_dtype)]
    reply = {"parts": [{"table": t.index} for t, _, _ in parts]}
    return (dict(reply, wire=wire_dtype) if wire_dtype != "fp32" else reply), out


def op_push_rows(server, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
    """A ``push_rows`` whose parts end with an advance frame (c_g += advance as each row is
    stored); with ``read_clocks`` the reply carries c_g after, one clock frame per part."""
    if not wire.get_flag(header, "advance"):
        raise ProtocolError("push_rows: read_clocks needs advance frames (NOTE [clock frames])")
    read = wire.get_flag(header, "read_clocks")
    arrays, advances = _split_last(header, arrays)
    arrays = compress.decode_request("push_rows", header, arrays)   # NOTE [wire compression]
    arrays = [a for k, adv in enumerate(advances) for a in (*arrays[2 * k:2 * k + 2], adv)]
    parts = server._parts(header, arrays, "push_rows", clock="advance")
    out = []
    for table, keys, (rows, advance) in parts:
        c_g = table.push_rows(keys, rows, advance)
        server.counters["push_rows_keys"] += keys.shape[0]
        if read:
            out.append(wire.pack_clocks(c_g))
    return ({"parts": [{"table": t.index} for t, _, _ in parts]} if read else {}), out


def _split_last(header: dict[str, Any], arrays: list) -> tuple[list, list]:
    """``(every frame but each part's last, each part's last frame)`` of a request whose parts
    all have the same number of frames (at least 2), or :class:`ProtocolError`."""
    parts = header.get("parts")
    if not isinstance(parts, list) or not parts:
        raise ProtocolError("push_rows: header 'parts' must be a non-empty list of maps")
    per = len(arrays) // len(parts)
    if per < 2 or per * len(parts) != len(arrays):
        raise ProtocolError(f"push_rows: {len(parts)} parts ending with an advance frame cannot hold "
                            f"{len(arrays)} frames")
    return [a for i, a in enumerate(arrays) if i % per != per - 1], arrays[per - 1::per]


# --------------------------------------------------------------------- client side
class ClockOps:
    """The clock-carrying operations of :class:`~herald.ps.client.PSClient` (NOTE [clock
    frames]); it provides ``_by_shard``, ``_send``, ``_wire``, ``_handle``, ``tables`` and
    ``wire_dtype``. Both return ``(Handle, clock bytes sent)``."""

    def pull_clocked_async(self, batch: Mapping, staleness: int):
        """Start a conditional pull of ``{table: (keys uint64 [n], c_c uint64 [m <= n])}``:
        ``c_c`` holds the cached copies' clocks of the first m keys, which the shards send
        only if ``c_g > c_c + staleness``; the other keys are always sent.

        ``wait()`` gives ``({table: (c_g uint64 [n], fetched bool [n], rows float32 [n,
        row_width])}, clock bytes received)``; ``rows`` is set only where ``fetched``.

        Raises:
            ConfigError: bad arrays or ``staleness``.
        """
        if type(staleness) is not int or staleness < 0:
            raise ConfigError(f"staleness must be an int >= 0, got {staleness!r}")
        full, prefix = {}, {}
        for t, (k, c) in batch.items():
            k, c = np.asarray(k), np.asarray(c, np.uint64)
            if c.ndim != 1 or c.shape[0] > k.shape[0]:
                raise ConfigError(f"table {t!r}: cached clocks must be uint64 [m <= {k.shape[0]}], got {c.shape}")
            full[t] = (k, np.concatenate([c, np.zeros(k.shape[0] - c.shape[0], np.uint64)]))
            prefix[t] = c.shape[0]
        groups, sizes = self._by_shard(full, 2)
        sent, out_bytes = [], 0
        for s, items in groups:
            frames, ms = [], []
            for t, _, idx, (keys, c_c) in items:   # positions ascending: the checked keys come first
                m = prefix[t] if idx is None else int(np.count_nonzero(idx < prefix[t]))
                frames += [keys, wire.pack_clocks(c_c[:m])]
                out_bytes += frames[-1].nbytes
                ms.append(m)
            header = self._wire({"parts": [{"table": ti} for _, ti, _, _ in items], "staleness": staleness})
            sent.append((self._send(s, "pull", header, frames), items, ms))

        def finish(replies):
            out = {t: (np.zeros(n, np.uint64), np.zeros(n, bool),
                       np.empty((n, self.tables[self.table_index(t)].row_width), np.float32))
                   for t, n in sizes.items()}
            got = 0
            for (header, arrays), (_, items, ms) in zip(replies, sent):
                wire_dtype = compress.wire_of(header)
                per = 2 if wire_dtype == "fp32" else 4
                if len(arrays) != per * len(items):
                    raise ProtocolError(f"a conditional pull reply of {len(items)} parts has {len(arrays)} frames")
                for k, ((t, _, idx, (keys, c_c)), m) in enumerate(zip(items, ms)):
                    n = keys.shape[0]
                    c_g = wire.unpack_clocks(arrays[per * k], "pull reply clocks", n)
                    got += arrays[per * k].nbytes
                    (rows,) = compress.decode_rows(arrays[per * k + 1:per * (k + 1)], wire_dtype)
                    fetched = np.ones(n, bool)
                    fetched[:m] = ~wire.valid_copies(c_c[:m], c_g[:m], staleness)
                    if rows.shape[0] != int(fetched.sum()):
                        raise ProtocolError(f"a conditional pull reply holds {rows.shape[0]} rows for "
                                            f"{int(fetched.sum())} keys not valid")
                    at = np.arange(n) if idx is None else idx
                    out[t][0][at] = c_g
                    out[t][1][at] = fetched
                    out[t][2][at[fetched]] = rows
            return out, got

        return self._handle([rid for rid, _, _ in sent], finish), out_bytes

    def push_rows_clocked_async(self, batch: Mapping, read_clocks: bool = False):
        """Start writing back ``{table: (keys uint64 [n] unique, rows float32 [n, row_width],
        advance uint64 [n])}``: the rows and their local updates (c_g += advance).

        ``wait()`` gives ``({table: c_g after, uint64 [n]} or None without ``read_clocks``,
        clock bytes received)``.
        """
        batch = {t: (np.asarray(k), np.asarray(r, np.float32), np.asarray(a, np.uint64))
                 for t, (k, r, a) in batch.items()}
        groups, sizes = self._by_shard(batch, 3)
        sent, out_bytes = [], 0
        for s, items in groups:
            frames = []
            for _, ti, _, (keys, rows, advance) in items:
                frames += compress.encode_part("push_rows", (keys, rows), self.tables[ti].dim, self.wire_dtype)
                frames.append(wire.pack_clocks(advance))
                out_bytes += frames[-1].nbytes
            header = {"parts": [{"table": ti} for _, ti, _, _ in items], "advance": True}
            sent.append((self._send(s, "push_rows", self._wire(dict(header, read_clocks=True) if read_clocks
                                                                 else header), frames), items))

        def finish(replies):
            if not read_clocks:
                return None, 0
            out, got = {t: np.zeros(n, np.uint64) for t, n in sizes.items()}, 0
            for (_, arrays), (_, items) in zip(replies, sent):
                if len(arrays) != len(items):
                    raise ProtocolError(f"a push_rows reply of {len(items)} parts has {len(arrays)} clock frames")
                for (t, _, idx, (keys, _, _)), frame in zip(items, arrays):
                    out[t][slice(None) if idx is None else idx] = wire.unpack_clocks(frame, "push_rows reply "
                                                                                     "clocks", keys.shape[0])
                    got += frame.nbytes
            return out, got

        return self._handle([rid for rid, _ in sent], finish), out_bytes

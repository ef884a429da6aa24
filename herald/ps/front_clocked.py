"""The client side of HET's clocks riding on pulls and pushes: NOTE [clock frames]
(herald/ps/wire.py).

A conditional pull (``pull`` with ``staleness``) and a write-back with clock advances
(``push_rows`` with ``advance`` frames); the shard side is
:class:`~herald.ps.ops_clocked.ClockedOps`. The worker protocol using them is NOTE [bounded
reads] (herald/worker/consistency_bounded.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from herald.errors import ConfigError, ProtocolError
from herald.ps import compress, wire
from herald.ps.link import ShardLink
from herald.ps.router import KeyRouter


class ClockFront:
    """The clock-carrying operations of :class:`~herald.ps.client.PSClient` (NOTE [clock
    frames]) over ``link``, keys routed by ``router``, rows in ``wire_dtype``. Each returns
    ``(Handle, clock bytes sent)``."""

    def __init__(self, link: ShardLink, router: KeyRouter, wire_dtype: str):
        self.link, self.router, self.wire_dtype = link, router, wire_dtype

    def pull_clocked_op(
        self, tables, keys, checked, c_c, staleness: int, shape
    ) -> tuple[list[int], Callable[[list], tuple], int]:
        _, width = shape or self.router.shape(tables) or (0, 0)
        n = keys.shape[0]
        header = compress.tagged({"parts": [{"flat": True}], "staleness": staleness}, self.wire_dtype)
        rids, plan, sent = [], [], 0
        for sh, pos in self.router.route(tables, keys):
            pos = np.arange(n) if pos is None else pos
            mine = checked[pos]
            sub = np.concatenate([pos[mine], pos[~mine]])  # the checked keys first, each group by table
            m = int(np.count_nonzero(mine))
            clocks = wire.pack_clocks(c_c[sub[:m]])
            sent += clocks.nbytes
            rids.append(self.link.send(sh, "pull", header, [tables[sub], keys[sub], clocks]))
            plan.append((sub, m))

        def finish(replies):
            c_g, fetched, rows, got = np.zeros(n, np.uint64), np.zeros(n, bool), np.empty((n, width), np.float32), 0
            for (head, arrays), (sub, m) in zip(replies, plan):
                wire_dtype = compress.wire_of(head)
                per = 2 if wire_dtype == "fp32" else 4
                if len(arrays) != per:
                    raise ProtocolError(f"a conditional pull reply of one part has {len(arrays)} frames")
                k = sub.shape[0]
                cg = wire.unpack_clocks(arrays[0], "pull reply clocks", k)
                got += arrays[0].nbytes
                (r,) = compress.decode_rows(arrays[1:], wire_dtype)
                ok = np.ones(k, bool)
                ok[:m] = ~wire.valid_copies(c_c[sub[:m]], cg[:m], staleness)
                if r.shape[0] != int(ok.sum()):
                    raise ProtocolError(
                        f"a conditional pull reply holds {r.shape[0]} rows for {int(ok.sum())} keys not valid"
                    )
                c_g[sub], fetched[sub] = cg, ok
                rows[sub[ok]] = r
            return c_g, fetched, rows, got

        return rids, finish, sent

    def pull_clocked_flat_async(self, tables, keys, checked, c_c, staleness: int):
        """Start a conditional pull of ``(tables[i], keys[i])`` (tables of one shape): the
        keys ``checked`` (bool [n]) have a cached copy of clock ``c_c[i]`` (uint64 [n]), which
        the shards send only if ``c_g > c_c + staleness``; the others are always sent.

        ``wait()`` gives ``(c_g uint64 [n], fetched bool [n], rows float32 [n, row_width],
        clock bytes received)``; ``rows`` is set only where ``fetched``.

        Raises:
            ConfigError: bad arrays or ``staleness``.
        """
        if type(staleness) is not int or staleness < 0:
            raise ConfigError(f"staleness must be an int >= 0, got {staleness!r}")
        tables, keys = self.router.flat_keys(tables, keys)
        checked, c_c = np.asarray(checked, bool), np.asarray(c_c, np.uint64)
        if checked.shape != keys.shape or c_c.shape != keys.shape:
            raise ConfigError(
                f"checked and c_c must have the keys' shape {keys.shape}, got {checked.shape}, {c_c.shape}"
            )
        if not self.router.mixed:
            rids, finish, sent = self.pull_clocked_op(tables, keys, checked, c_c, staleness, None)
            return self.link.handle(rids, finish), sent
        groups = self.router.shape_groups(tables)  # NOTE [mixed widths]: padded rows
        ops, sent = [], 0
        for shape, pos in groups:
            t, k, ch, cc = self.router.take((tables, keys, checked, c_c), pos)
            rids, finish, out = self.pull_clocked_op(t, k, ch, cc, staleness, shape)
            ops.append((rids, finish))
            sent += out
        n, width = keys.shape[0], self.router.padded_shape[1]

        def merge(results):
            c_g, fetched, got = np.zeros(n, np.uint64), np.zeros(n, bool), 0
            for (_, pos), (cg, ok, _, g) in zip(groups, results):
                at = slice(None) if pos is None else pos
                c_g[at], fetched[at], got = cg, ok, got + g
            rows = self.router.padded(n, width, groups, [r for _, _, r, _ in results])
            return c_g, fetched, rows, got

        return self.link.combine(ops, merge), sent

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
        full = {}
        for t, (k, c) in batch.items():
            k, c = np.asarray(k), np.asarray(c, np.uint64)
            if c.ndim != 1 or c.shape[0] > k.shape[0]:
                raise ConfigError(f"table {t!r}: cached clocks must be uint64 [m <= {k.shape[0]}], got {c.shape}")
            pad = k.shape[0] - c.shape[0]
            full[t] = (
                k,
                np.concatenate([c, np.zeros(pad, np.uint64)]),
                np.concatenate([np.ones(c.shape[0], bool), np.zeros(pad, bool)]),
            )
        flat = self.router.flatten(full, 3)
        ops, sent = self._issue(
            flat,
            lambda tables, keys, c_c, checked, shape: self.pull_clocked_op(
                tables, keys, checked, c_c, staleness, shape
            ),
        )
        return self.link.combine(ops, lambda results: _per_table(flat, results)), sent

    def push_rows_clocked_op(
        self, tables, keys, rows, advance, read_clocks: bool, shape
    ) -> tuple[list[int], Callable[[list], tuple], int]:
        rows = np.ascontiguousarray(rows, np.float32)
        advance = np.ascontiguousarray(advance, np.uint64)
        dim, width = shape or self.router.shape(tables) or (0, rows.shape[1] if rows.ndim == 2 else -1)
        n = keys.shape[0]
        if rows.shape != (n, width) or advance.shape != (n,):
            raise ConfigError(
                f"rows must be float32 [{n}, {width}] and advance uint64 [{n}], got {rows.shape} and {advance.shape}"
            )
        header = {"parts": [{"flat": True}], "advance": True}
        header = compress.tagged(dict(header, read_clocks=True) if read_clocks else header, self.wire_dtype)
        routes = self.router.route(tables, keys)
        rids, sent = [], 0
        for sh, pos in routes:
            sub = (slice(None),) if pos is None else (pos,)
            clocks = wire.pack_clocks(advance[sub])
            sent += clocks.nbytes
            frames = compress.encode_part("push_rows", (keys[sub], rows[sub]), dim, self.wire_dtype)
            rids.append(self.link.send(sh, "push_rows", header, [tables[sub], *frames, clocks]))

        def finish(replies):
            if not read_clocks:
                return None, 0
            out, got = np.zeros(n, np.uint64), 0
            for (_, arrays), (_, pos) in zip(replies, routes):
                k = n if pos is None else pos.shape[0]
                if len(arrays) != 1:
                    raise ProtocolError(f"a push_rows reply of one part has {len(arrays)} clock frames")
                out[slice(None) if pos is None else pos] = wire.unpack_clocks(arrays[0], "push_rows reply clocks", k)
                got += arrays[0].nbytes
            return out, got

        return rids, finish, sent

    def push_rows_clocked_flat_async(self, tables, keys, rows, advance, read_clocks: bool = False):
        """Start writing back ``rows`` (float32 [n, row_width]) of unique ``(tables[i],
        keys[i])`` and their local updates ``advance`` (uint64 [n]: c_g += advance).

        ``wait()`` gives ``(c_g after uint64 [n] or None without ``read_clocks``, clock bytes
        received)``.
        """
        tables, keys = self.router.flat_keys(tables, keys)
        if not self.router.mixed:
            rids, finish, sent = self.push_rows_clocked_op(tables, keys, rows, advance, read_clocks, None)
            return self.link.handle(rids, finish), sent
        n = keys.shape[0]  # NOTE [mixed widths]: padded rows, one part per shape
        rows = self.router.check_padded(rows, n, self.router.padded_shape[1], "rows")
        advance = np.ascontiguousarray(advance, np.uint64)
        groups = self.router.shape_groups(tables)
        ops, sent = [], 0
        for shape, pos in groups:
            t, k, a = self.router.take((tables, keys, advance), pos)
            rids, finish, out = self.push_rows_clocked_op(
                t, k, self.router.columns(rows, pos, shape[1]), a, read_clocks, shape
            )
            ops.append((rids, finish))
            sent += out

        def merge(results):
            if not read_clocks:
                return None, 0
            c_g, got = np.zeros(n, np.uint64), 0
            for (_, pos), (cg, g) in zip(groups, results):
                c_g[slice(None) if pos is None else pos] = cg
                got += g
            return c_g, got

        return self.link.combine(ops, merge), sent

    def push_rows_clocked_async(self, batch: Mapping, read_clocks: bool = False):
        """Start writing back ``{table: (keys uint64 [n] unique, rows float32 [n, row_width],
        advance uint64 [n])}``: the rows and their local updates (c_g += advance).

        ``wait()`` gives ``({table: c_g after, uint64 [n]} or None without ``read_clocks``,
        clock bytes received)``.
        """
        flat = self.router.flatten(batch, 3)
        ops, sent = self._issue(
            flat,
            lambda tables, keys, rows, advance, shape: self.push_rows_clocked_op(
                tables, keys, rows, advance, read_clocks, shape
            ),
        )
        return self.link.combine(ops, lambda results: _per_table(flat, results) if read_clocks else (None, 0)), sent

    @staticmethod
    def _issue(flat: list[tuple], op) -> tuple[list, int]:
        """``op(tables, keys, *arrays, shape)`` for each group of :meth:`_flatten`; returns
        ``([(rids, finish), ...], bytes sent)``."""
        ops, sent = [], 0
        for _, tables, keys, arrays, shape in flat:
            rids, finish, out = op(tables, keys, *arrays, shape)
            ops.append((rids, finish))
            sent += out
        return ops, sent


def _per_table(flat: list[tuple], results: list[tuple]) -> tuple[dict, int]:
    """Each group's reply ``(*arrays, bytes received)`` cut back into ``{table: arrays}``
    (one array alone, several as a tuple), and the bytes received in all."""
    out, got = {}, 0
    for (entries, *_), (*arrays, received) in zip(flat, results):
        got += received
        for t, a, b in entries:
            parts = tuple(x[a:b] for x in arrays)
            out[t] = parts[0] if len(parts) == 1 else parts
    return out, got

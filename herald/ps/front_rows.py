"""The client's row ops: pull, push_grad, push_rows (NOTE [ps wire protocol]).

ps-lite style: every operation has a non-blocking ``*_async`` form returning a
:class:`~herald.ps.link.Handle`; its requests to several shards go out at once
(:class:`~herald.ps.router.KeyRouter`: one flat request per shard, split by
``max_keys_per_request``) and ``wait()`` collects them. The ``*_flat_async`` operations
take ``(tables, keys)`` arrays as a worker's KeySets hold them; the per-table ones
(``{table: keys}``) are flattened into them (one flat operation per table shape).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from herald.errors import ConfigError
from herald.ps import compress
from herald.ps.link import Handle, ShardLink
from herald.ps.router import KeyRouter, Route


class RowFront:
    """Pulls and pushes of rows and gradients over ``link``, keys routed by ``router``,
    gradients and rows in ``wire_dtype`` (NOTE [wire compression])."""

    def __init__(self, link: ShardLink, router: KeyRouter, wire_dtype: str):
        self.link, self.router, self.wire_dtype = link, router, wire_dtype

    def send_flat(self, op: str, header: dict, routes: list[Route], tables, keys, frames_of) -> list[int]:
        """One request per route: a flat part ``[tables, keys, *frames_of(positions)]``; their ids."""
        header = compress.tagged(dict(header, parts=[{"flat": True}]), self.wire_dtype)
        take = self.router.take
        return [self.link.send(sh, op, header, [*take((tables, keys), pos), *frames_of(pos)]) for sh, pos in routes]

    # ------------------------------------------------------------------ pull
    def pull_op(self, tables: np.ndarray, keys: np.ndarray, shape=None) -> tuple[list[int], Callable]:
        """The requests of a flat pull and its ``finish(replies)``: rows in key order."""
        _, width = shape or self.router.shape(tables) or (0, 0)
        routes = self.router.route(tables, keys)
        rids = self.send_flat("pull", {}, routes, tables, keys, lambda pos: ())

        def finish(replies):
            parts = [
                (pos, compress.decode_rows(arrays, compress.wire_of(header))[0], "pull reply")
                for (header, arrays), (_, pos) in zip(replies, routes)
            ]
            return self.router.in_key_order(keys.shape[0], width, parts)

        return rids, finish

    def pull_flat_async(self, tables, keys) -> Handle:
        """Start pulling ``(tables[i], keys[i])`` (table indices, uint64 keys; tables of one
        dim and row width); ``wait()`` gives float32 [n, row_width] in key order (read-only
        when one request carried every key: zero copy). Duplicates are allowed. Tables of
        several widths: rows padded to the widest (NOTE [mixed widths] in herald/ps/router.py).

        Raises:
            ConfigError: bad arrays, tables of several shapes.
        """
        tables, keys = self.router.flat_keys(tables, keys)
        if not self.router.mixed:
            return self.link.handle(*self.pull_op(tables, keys))
        groups = self.router.shape_groups(tables)  # NOTE [mixed widths]: padded rows
        ops = []
        for shape, pos in groups:
            t, k = self.router.take((tables, keys), pos)
            ops.append(self.pull_op(t, k, shape))
        width = self.router.padded_shape[1]
        return self.link.combine(ops, lambda parts: self.router.padded(keys.shape[0], width, groups, parts))

    def pull_async(self, batch: Mapping) -> Handle:
        """Start pulling ``{table: keys uint64 [n]}``; ``wait()`` gives ``{table: rows}``.

        Rows are float32 [n, row_width] (embedding then optimizer state) in key order;
        duplicate keys are allowed (each gets its row). The array may be read-only
        when one shard served every key (zero copy).
        """
        flat = self.router.flatten(batch, 1)
        ops = [self.pull_op(tables, keys, shape) for _, tables, keys, _, shape in flat]

        def finish(results):
            out = {}
            for (entries, _, _, _, _), rows in zip(flat, results):
                for t, a, b in entries:
                    out[t] = rows if len(entries) == 1 else rows[a:b]
            return out

        return self.link.combine(ops, finish)

    # ------------------------------------------------------------------ frames
    def grad_frames(self, tables, keys, grads, contributors, shape=None) -> Callable:
        """``frames_of(positions)``: a push_grad part's frames after the keys (NOTE [wire
        compression]) of checked ``grads`` (float32 [n, dim]) and ``contributors`` (uint16 [n]).

        Raises:
            ConfigError: another shape.
        """
        shape = shape or self.router.shape(tables)
        grads = np.ascontiguousarray(grads, np.float32)
        contributors = np.ascontiguousarray(contributors, np.uint16)
        dim = shape[0] if shape else (grads.shape[1] if grads.ndim == 2 else -1)
        if grads.shape != (keys.shape[0], dim) or contributors.shape != keys.shape:
            raise ConfigError(
                f"grads must be float32 [{keys.shape[0]}, {dim}] and contributors uint16 "
                f"[{keys.shape[0]}], got {grads.shape} and {contributors.shape}"
            )
        take = self.router.take
        return lambda pos: compress.encode_part(
            "push_grad", [keys[:0], *take((grads, contributors), pos)], dim, self.wire_dtype
        )[1:]

    def rows_frames(self, tables, keys, rows, shape=None) -> Callable:
        """``frames_of(positions)``: a push_rows part's frames after the keys (NOTE [wire
        compression]) of checked ``rows`` (float32 [n, row_width]).

        Raises:
            ConfigError: another shape.
        """
        rows = np.ascontiguousarray(rows, np.float32)
        dim, width = shape or self.router.shape(tables) or (0, rows.shape[1] if rows.ndim == 2 else -1)
        if rows.shape != (keys.shape[0], width):
            raise ConfigError(f"rows must be float32 [{keys.shape[0]}, {width}], got {rows.shape}")
        take = self.router.take
        return lambda pos: compress.encode_part("push_rows", [keys[:0], *take((rows,), pos)], dim, self.wire_dtype)[1:]

    # ------------------------------------------------------------------ push_grad
    def push_grad_op(self, tables, keys, grads, contributors, step: int, rank: int, shape=None):
        """The requests of a flat gradient push and its ``finish(replies)``: rows updated."""
        frames_of = self.grad_frames(tables, keys, grads, contributors, shape)
        routes = self.router.route(tables, keys)
        rids = self.send_flat("push_grad", {"step": int(step), "rank": int(rank)}, routes, tables, keys, frames_of)
        return rids, lambda replies: sum(h.get("applied", 0) for h, _ in replies)

    def push_grad_flat_async(self, tables, keys, grads, contributors, step: int, rank: int) -> Handle:
        """Start pushing the gradients ``grads`` (float32 [n, dim]) of unique ``(tables[i],
        keys[i])`` with their ``contributors`` (uint16 [n]) for ``step`` from ``rank`` (NOTE
        [ps aggregation]); ``wait()`` returns the rows the shards updated. Tables of several
        widths: ``grads`` padded to the widest dim (NOTE [mixed widths] in herald/ps/router.py)."""
        tables, keys = self.router.flat_keys(tables, keys)
        if not self.router.mixed:
            return self.link.handle(*self.push_grad_op(tables, keys, grads, contributors, step, rank))
        grads = self.router.check_padded(grads, keys.shape[0], self.router.padded_shape[0], "gradients")
        contributors = np.ascontiguousarray(contributors, np.uint16)
        if contributors.shape != keys.shape:
            raise ConfigError(f"contributors must be uint16 [{keys.shape[0]}], got {contributors.shape}")
        ops = []
        for shape, pos in self.router.shape_groups(tables):
            t, k, c = self.router.take((tables, keys, contributors), pos)
            ops.append(self.push_grad_op(t, k, self.router.columns(grads, pos, shape[0]), c, step, rank, shape))
        return self.link.combine(ops, sum)

    def push_grad_async(self, batch: Mapping, step: int, rank: int) -> Handle:
        """Start pushing ``{table: (keys uint64 [n] unique, grads float32 [n, dim],
        contributors uint16 [n])}`` for ``step`` from worker ``rank`` (NOTE [ps
        aggregation]). ``wait()`` returns the number of rows the shards updated. Do not
        modify the arrays before ``wait()`` returns."""
        ops = [
            self.push_grad_op(tables, keys, grads, contributors, step, rank, shape)
            for _, tables, keys, (grads, contributors), shape in self.router.flatten(batch, 3)
        ]
        return self.link.combine(ops, sum)

    # ------------------------------------------------------------------ push_rows
    def push_rows_op(self, tables, keys, rows, shape=None) -> tuple[list[int], Callable]:
        """The requests of a flat write-back and its ``finish(replies)`` (None)."""
        frames_of = self.rows_frames(tables, keys, rows, shape)
        return self.send_flat("push_rows", {}, self.router.route(tables, keys), tables, keys, frames_of), lambda r: None

    def push_rows_flat_async(self, tables, keys, rows) -> Handle:
        """Start writing back ``rows`` (float32 [n, row_width]: embedding and optimizer
        state) of unique ``(tables[i], keys[i])`` (NOTE [step protocol] steps 1 and 6); tables
        of several widths: padded to the widest row (NOTE [mixed widths] in herald/ps/router.py)."""
        tables, keys = self.router.flat_keys(tables, keys)
        if not self.router.mixed:
            return self.link.handle(*self.push_rows_op(tables, keys, rows))
        rows = self.router.check_padded(rows, keys.shape[0], self.router.padded_shape[1], "rows")
        ops = []
        for shape, pos in self.router.shape_groups(tables):
            t, k = self.router.take((tables, keys), pos)
            ops.append(self.push_rows_op(t, k, self.router.columns(rows, pos, shape[1]), shape))
        return self.link.combine(ops, lambda results: None)

    def push_rows_async(self, batch: Mapping) -> Handle:
        """Start writing back ``{table: (keys uint64 [n] unique, rows float32 [n, row_width])}``
        (embedding and optimizer state; NOTE [step protocol] steps 1 and 6)."""
        ops = [
            self.push_rows_op(tables, keys, rows, shape)
            for _, tables, keys, (rows,), shape in self.router.flatten(batch, 2)
        ]
        return self.link.combine(ops, lambda results: None)

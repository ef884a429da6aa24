"""The client's key router: flat ``(table, key)`` arrays to shard requests and back.

Every pull and push goes out as flat requests (NOTE [ps wire protocol], flat parts): one
per shard, its keys of every table in one part (``tables`` uint16 [n] + ``keys`` uint64
[n] + the values), grouped by table in one counting-sort pass
(:func:`~herald.ps.kernels.shard_order_jit`); an operation over more keys than a shard
takes in one request (NOTE [ps limits]: ``max_keys_per_request``) is split into several
requests per shard. Per-table batches (``{table: keys}``) are flattened into one flat
operation per table shape. The replies' rows are put back in key order by
:meth:`KeyRouter.in_key_order`.

NOTE [mixed widths]
~~~~~~~~~~~~~~~~~~~
Tables of different widths (``dim``, and the row's floats with the optimizer state) are
stored at their own width on the shards, and a flat part carries the keys of one shape.
A client whose tables differ takes *padded* arrays in its flat operations: rows float32
[n, widest row] and gradients float32 [n, widest dim], table t's values in the first
``row_width_t`` / ``dim_t`` columns (the worker cache holds rows so: herald/worker/cache.py);
it sends one flat part per shape (:meth:`KeyRouter.shape_groups`; a step message's
section carries them all: NOTE [step messages] in herald/ps/stepped.py) and gives back
padded rows, zeros beyond each table's width. A client of one shape is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from herald.contracts.tables import TableConfig
from herald.errors import ConfigError
from herald.ps.config import ShardLimits
from herald.ps.kernels import shard_order_jit
from herald.ps.rows import table_salt
from herald.ps.wire import put_rows

#: One request of a flat operation: ``(shard, positions of its keys, or None for all)``.
Route = tuple[int, "np.ndarray | None"]


class KeyRouter:
    """Routes the keys of ``tables`` (checked, at most :data:`~herald.ps.config.MAX_TABLES`)
    to ``num_shards`` shards.

    Attributes:
        max_keys_per_request: keys per request (NOTE [ps limits]); lowered to the shards'
            limit by the client's declare.
    """

    def __init__(self, tables: Sequence[TableConfig], num_shards: int):
        self.tables, self.num_shards = list(tables), int(num_shards)
        self.max_keys_per_request = ShardLimits().max_keys_per_request
        self._index = {t.name: i for i, t in enumerate(self.tables)}
        self._salts = np.array([table_salt(i) for i in range(len(self.tables))], np.uint64)
        shapes = sorted({(t.dim, t.row_width) for t in self.tables})
        #: shape class of each table: tables of one class travel in one flat part
        self._shape_of = np.array([shapes.index((t.dim, t.row_width)) for t in self.tables], np.int64)
        self._shapes = shapes

    def table_index(self, table: int | str) -> int:
        """Index of ``table`` (an index or a name). Raises ConfigError if unknown."""
        if isinstance(table, str):
            if table not in self._index:
                raise ConfigError(f"unknown table {table!r}; known: {list(self._index)}")
            return self._index[table]
        t = int(table)
        if not 0 <= t < len(self.tables):
            raise ConfigError(f"table index {t} out of range [0, {len(self.tables)})")
        return t

    def flat_keys(self, tables, keys) -> tuple[np.ndarray, np.ndarray]:
        """``(tables uint16 [n], keys uint64 [n])``, every table a declared index.

        Raises:
            ConfigError: keys not 1-d uint64, tables of another length or out of range.
        """
        keys = np.asarray(keys)
        if keys.dtype != np.uint64 or keys.ndim != 1:
            raise ConfigError(f"keys must be a 1-d uint64 array, got {keys.dtype} {keys.shape}")
        tables = np.asarray(tables)
        if tables.shape != keys.shape or tables.dtype.kind not in "iu":
            raise ConfigError(
                f"tables must be an integer array of the keys' shape {keys.shape}, got {tables.dtype} {tables.shape}"
            )
        if keys.shape[0] and (int(tables.min()) < 0 or int(tables.max()) >= len(self.tables)):
            raise ConfigError(
                f"table indices must be in [0, {len(self.tables)}), got {int(tables.min())}..{int(tables.max())}"
            )
        return np.ascontiguousarray(tables, np.uint16), np.ascontiguousarray(keys)

    def shape(self, tables: np.ndarray) -> tuple[int, int] | None:
        """``(dim, row width)`` shared by ``tables`` (ConfigError when they differ); None for
        no keys of a client whose tables have several shapes (nothing is sent then)."""
        if len(self._shapes) == 1:
            return self._shapes[0]
        if not tables.shape[0]:
            return None
        classes = self._shape_of[tables]
        if (classes != classes[0]).any():
            raise ConfigError(
                "a flat operation takes tables of one dim and row width; use the per-table "
                "operations (pull_async({table: keys}), ...) for tables of several shapes"
            )
        return self._shapes[int(classes[0])]

    @property
    def mixed(self) -> bool:
        """The tables have several shapes (NOTE [mixed widths])."""
        return len(self._shapes) > 1

    @property
    def padded_shape(self) -> tuple[int, int]:
        """``(widest dim, widest row)`` over the tables: the columns of a flat operation's
        padded arrays (NOTE [mixed widths])."""
        return max(d for d, _ in self._shapes), max(w for _, w in self._shapes)

    def shape_groups(self, tables: np.ndarray) -> list[tuple[tuple[int, int], np.ndarray | None]]:
        """``[((dim, row width), positions or None for all)]``: the keys of each table shape
        among ``tables`` (uint16 [n]), shapes ascending, positions ascending (NOTE [mixed widths])."""
        if len(self._shapes) == 1:
            return [(self._shapes[0], None)]
        if not tables.shape[0]:
            return []
        classes = self._shape_of[tables]
        present = np.unique(classes)
        if present.shape[0] == 1:
            return [(self._shapes[int(present[0])], None)]
        return [(self._shapes[int(c)], np.flatnonzero(classes == c)) for c in present]

    def check_padded(self, array: np.ndarray, n: int, width: int, what: str) -> np.ndarray:
        """``array`` as float32 [n, width] (a mixed client's padded rows or gradients:
        NOTE [mixed widths]). Raises ConfigError otherwise."""
        array = np.asarray(array, np.float32)
        if array.shape != (n, width):
            raise ConfigError(
                f"{what} of tables of several widths must be float32 [{n}, {width}] (padded to the widest "
                f"table, NOTE [mixed widths]), got {array.shape}"
            )
        return array

    @staticmethod
    def columns(array: np.ndarray, pos: np.ndarray | None, cols: int) -> np.ndarray:
        """float32 [len(pos), cols]: the first ``cols`` columns of the rows ``pos`` of
        ``array`` (all rows for None), C-contiguous."""
        part = array if pos is None else np.take(array, pos, axis=0)
        return np.ascontiguousarray(part[:, :cols])

    @staticmethod
    def padded(n: int, width: int, groups: list, parts: list[np.ndarray]) -> np.ndarray:
        """float32 [n, width]: each group's rows (``parts``, in ``groups``' order) at its
        positions, zeros beyond its shape's width (NOTE [mixed widths])."""
        out = np.zeros((n, width), np.float32)
        for ((_, w), pos), rows in zip(groups, parts):
            if pos is None:
                out[:, :w] = rows
            else:
                out[pos, :w] = rows
        return out

    def route(self, tables: np.ndarray, keys: np.ndarray) -> list[Route]:
        """``[(shard, positions or None for all)]``: the requests of a flat operation, each of
        the keys one shard owns, table after table (each table's positions ascending: a shard
        switches tables once per table), at most :attr:`max_keys_per_request` keys each."""
        n = keys.shape[0]
        if n == 0:
            return []
        groups: list[Route] = []
        order = np.empty(n, np.int64)
        starts = np.empty(self.num_shards + 1, np.int64)
        same = shard_order_jit(self._salts, tables, keys, self.num_shards, len(self.tables), order, starts)
        for sh in range(self.num_shards):
            a, b = int(starts[sh]), int(starts[sh + 1])
            if b - a == n and same:
                groups = [(sh, None)]
                break
            if b > a:
                groups.append((sh, order[a:b]))
        limit = self.max_keys_per_request
        out = []
        for sh, pos in groups:
            m = n if pos is None else pos.shape[0]
            if m <= limit:
                out.append((sh, pos))
                continue
            for a in range(0, m, limit):
                out.append((sh, np.arange(a, min(a + limit, m)) if pos is None else pos[a : a + limit]))
        return out

    @staticmethod
    def take(arrays: Sequence[np.ndarray], pos: np.ndarray | None) -> list[np.ndarray]:
        """The rows ``pos`` of each of ``arrays`` (all of them for None)."""
        # np.take, not a[pos]: a 2-d a[pos] copies rows one by one (82 against 15 us, 2,500 x 17)
        return list(arrays) if pos is None else [np.take(a, pos, axis=0) for a in arrays]

    @staticmethod
    def in_key_order(n: int, width: int, parts: list[tuple[np.ndarray | None, np.ndarray, str]]) -> np.ndarray:
        """float32 [n, width] of the rows each part ``(positions, rows, what)`` carries, put
        at its keys' positions (:func:`~herald.ps.wire.put_rows`); one part of every key as
        it is (its reply's frame: zero copy, read-only).

        Raises:
            ProtocolError: a part's rows not float32 of its keys by ``width`` (``what`` names
                the reply).
        """
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]
        out = np.empty((n, width), np.float32)
        for pos, rows, what in parts:
            put_rows(out, pos, rows, what)
        return out

    def flatten(self, batch: Mapping, arity: int) -> list[tuple]:
        """A per-table batch ``{table: arrays}`` as flat operations, one per shape class:
        ``[(entries [(table key, start, end)], tables uint16, keys, [other arrays], (dim,
        row width))]``.

        Raises:
            ConfigError: an unknown table, another number of arrays, keys not 1-d uint64.
        """
        groups: dict[int, list] = {}
        for t, arrays in batch.items():
            ti = self.table_index(t)
            arrays = arrays if isinstance(arrays, tuple) else (arrays,)
            if len(arrays) != arity:
                raise ConfigError(f"table {t!r}: expected {arity} arrays, got {len(arrays)}")
            keys = np.asarray(arrays[0])
            if keys.dtype != np.uint64 or keys.ndim != 1:
                raise ConfigError(f"keys must be a 1-d uint64 array, got {keys.dtype} {keys.shape}")
            groups.setdefault(int(self._shape_of[ti]), []).append((t, ti, keys, arrays[1:]))
        out = []
        for cls, items in groups.items():
            entries, start = [], 0
            for t, _, keys, _ in items:
                entries.append((t, start, start + keys.shape[0]))
                start += keys.shape[0]
            if len(items) == 1:
                t, ti, keys, rest = items[0]
                tables = np.full(keys.shape[0], ti, np.uint16)
                out.append((entries, tables, keys, [np.asarray(a) for a in rest], self._shapes[cls]))
                continue
            tables = np.concatenate([np.full(k.shape[0], ti, np.uint16) for _, ti, k, _ in items])
            keys = np.concatenate([k for _, _, k, _ in items])
            rest = [np.concatenate([np.asarray(r[j]) for _, _, _, r in items]) for j in range(arity - 1)]
            out.append((entries, tables, keys, rest, self._shapes[cls]))
        return out

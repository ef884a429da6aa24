"""The table directory of a shard, its settings arrays and its debug check.

:class:`TableDirectory` holds NOTE [table directory] (herald/ps/kernels/directory.py) on the
Python side: one row per table of ``d`` with the addresses and sizes of the table's arrays
and its settings, the tables' initialiser seeds, salts, initialiser parameters and
hyper-parameters, and the shard's byte limit over all its tables (NOTE [ps limits]'
``max_shard_bytes``). A table publishes itself into it whenever its arrays are replaced
(:meth:`herald.ps.table_arrays.TableArrays.install`, the one place that replaces them);
with ``HERALD_PS_DEBUG=1`` in the environment (the tests set it: tests/conftest.py) every
publish is followed by :func:`check_directory`, which raises :class:`DirectoryError` when
an address no longer names the table's current array (a use-after-free the kernels would
not notice).
"""

from __future__ import annotations

import os

import numpy as np

from herald.errors import HeraldError, ProtocolError
from herald.ps.config import MAX_TABLES
from herald.ps.kernels import directory as KD
from herald.ps.rows import table_salt

#: The environment variable that turns on :func:`check_directory` after every publish.
DEBUG_ENV = "HERALD_PS_DEBUG"
#: Bytes a table allocates per row besides the row itself (NOTE [ps limits]' max_shard_bytes):
#: its key, open-aggregation mark, stamp, last use and clock (8 + 4 + 4 + 8 + 8) and at most
#: 64 of key map (at most 8 int64 buckets per allocated row: herald/ps/table.py).
ROW_OVERHEAD_BYTES = 96
#: directory column -> (the table's array, its dtype, the column of its length)
_ARRAYS = {
    KD.D_ROWS: ("rows", np.float32, KD.D_CAP),
    KD.D_KEYS: ("row_keys", np.uint64, KD.D_CAP),
    KD.D_BUCKETS: ("buckets", np.int64, KD.D_NBUCKETS),
    KD.D_MARKS: ("row_marks", np.int32, KD.D_CAP),
    KD.D_STAMPS: ("stamps", np.uint32, KD.D_CAP),
    KD.D_USED: ("last_used", np.uint64, KD.D_CAP),
    KD.D_CLOCKS: ("clocks", np.uint64, KD.D_CAP),
}


class DirectoryError(HeraldError):
    """A directory entry does not name its table's current arrays (NOTE [table directory]):
    a bug in herald (an array replaced without a publish); the message names the table and
    the array."""


def debug_checks() -> bool:
    """Whether :data:`DEBUG_ENV` asks for :func:`check_directory` after every publish."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class TableDirectory:
    """The tables of one shard as the kernels see them (single-threaded use).

    Args:
        shard, num_shards: the shard served; keys of another shard are refused by the kernels.
        max_bytes: NOTE [ps limits]' ``max_shard_bytes`` over all tables (:meth:`nbytes`);
            None: no limit.

    Attributes:
        tables: the tables by position (each with ``arrays``, ``cfg``, ``width``, ``hp``,
            ``init_args``, ``max_rows``, ``max_resident``).
        d: int64 [T, D_COLS], NOTE [table directory].
        counts: int64 [T], keys per table of the last kernel call (written by the kernels).
        space: the kernels' table space ``(d, seeds, fparams, salts, hp, counts, num_shards,
            shard)``, rebuilt when a table is added.
        bounded: whether a table is LRU-bounded (NOTE [bounded ps]): its rows may move.
        debug: whether every publish is checked (:func:`check_directory`).
    """

    def __init__(self, shard: int = 0, num_shards: int = 1, max_bytes: int | None = None):
        self.shard, self.num_shards = int(shard), int(num_shards)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.tables: list = []
        self.d = np.zeros((0, KD.D_COLS), np.int64)
        self.seeds = np.zeros(0, np.uint64)
        self.salts = np.zeros(0, np.uint64)
        self.fparams = np.zeros((0, 2), np.float64)
        self.hp = np.zeros((0, 5), np.float32)
        self.counts = np.zeros(0, np.int64)
        self.bounded = False
        self.debug = debug_checks()
        self.space = self._space()

    def _space(self) -> tuple:
        return (self.d, self.seeds, self.fparams, self.salts, self.hp, self.counts, self.num_shards, self.shard)

    def add(self, table) -> int:
        """Append ``table`` (its settings; its arrays come with its first :meth:`publish`);
        returns its position.

        Raises:
            ProtocolError: the shard holds :data:`~herald.ps.config.MAX_TABLES` already.
        """
        t = len(self.tables)
        if t >= MAX_TABLES:
            raise ProtocolError(f"a shard holds at most {MAX_TABLES} tables")
        self.tables.append(table)
        self.d = np.concatenate([self.d, np.zeros((1, KD.D_COLS), np.int64)])
        self.seeds = np.append(self.seeds, np.uint64(table.init_args[0]))
        self.salts = np.append(self.salts, table_salt(t))
        self.fparams = np.concatenate([self.fparams, [[table.init_args[3], table.init_args[5]]]])
        self.hp = np.concatenate([self.hp, table.hp[None, :]])
        self.counts = np.zeros(t + 1, np.int64)
        row = self.d[t]
        row[KD.D_WIDTH], row[KD.D_DIM] = table.width, table.cfg.dim
        row[KD.D_INIT], row[KD.D_STATE] = table.init_args[2], table.init_args[4]
        row[KD.D_OPT], row[KD.D_BOUNDED] = table.cfg.optimizer.kind, table.max_resident is not None
        self.bounded = self.bounded or table.max_resident is not None
        self.space = self._space()
        return t

    def publish(self, t: int) -> None:
        """Write table ``t``'s array addresses, sizes and room into its row: called by the
        table whenever its arrays are replaced (NOTE [table directory]); checked with
        :attr:`debug`.

        Raises:
            DirectoryError: with :attr:`debug`, an entry of any table is stale.
        """
        table, row = self.tables[t], self.d[t]
        arrays = table.arrays
        for column, (name, _, _) in _ARRAYS.items():
            row[column] = getattr(arrays, name).ctypes.data
        row[KD.D_CAP], row[KD.D_NBUCKETS] = arrays.rows.shape[0], arrays.buckets.shape[0]
        row[KD.D_ROOM] = room_of(table)
        if self.debug:
            check_directory(self)

    @property
    def n_tables(self) -> int:
        return len(self.tables)

    @property
    def dims(self) -> np.ndarray:
        return self.d[:, KD.D_DIM]

    @property
    def widths(self) -> np.ndarray:
        return self.d[:, KD.D_WIDTH]

    def nbytes(self) -> int:
        """Bytes the tables allocated (NOTE [ps limits]' ``max_shard_bytes``): each one's
        allocated rows times (4 x row width + :data:`ROW_OVERHEAD_BYTES`)."""
        return int((self.d[:, KD.D_CAP] * (4 * self.d[:, KD.D_WIDTH] + ROW_OVERHEAD_BYTES)).sum())

    def room_rows(self, t: int) -> int | None:
        """Most rows table position ``t`` may allocate with the others' as they are (None:
        no ``max_bytes``); at least its allocated rows while the limit holds."""
        if self.max_bytes is None:
            return None
        row_bytes = 4 * int(self.d[t, KD.D_WIDTH]) + ROW_OVERHEAD_BYTES
        others = self.nbytes() - int(self.d[t, KD.D_CAP]) * row_bytes
        return max(0, self.max_bytes - others) // row_bytes

    def check_bytes(self, total: int, what: str) -> None:
        """Raise :class:`ProtocolError` if ``total`` bytes over all tables (after ``what``)
        pass ``max_bytes``."""
        if self.max_bytes is not None and total > self.max_bytes:
            raise ProtocolError(
                f"{what} would take the tables of this shard to {total} bytes, past its "
                f"max_shard_bytes={self.max_bytes}; add PS shards or raise --max-shard-bytes"
            )

    def positions(self, t: int, n: int) -> np.ndarray:
        """uint16 [n] of table position ``t`` (the tables array of a one-table part), read-only."""
        out = np.full(n, t, np.uint16)
        out.setflags(write=False)
        return out


def room_of(table) -> int:
    """Rows ``table`` may hold before its Python path must run (``D_ROOM``): its allocated
    rows, half its buckets (the key map's load), its byte limit's rows and its LRU bound."""
    room = min(table.arrays.rows.shape[0], table.arrays.buckets.shape[0] // 2)
    for bound in (table.max_rows, table.max_resident):
        if bound is not None:
            room = min(room, bound)
    return room


def check_directory(directory: TableDirectory) -> None:
    """Verify that every directory row names its table's current arrays (NOTE [table
    directory]): each address is the array's data, each array of its dtype, C-contiguous
    and as long as its size column says, the width, row count and room as the table's; and
    that :attr:`TableDirectory.space` holds the directory's arrays.

    Raises:
        DirectoryError: the first stale or wrong entry, naming its table and array.
    """
    d = directory.d
    space = directory.space
    if d.shape[0] != len(directory.tables) or space[0] is not d or space[5] is not directory.counts:
        raise DirectoryError(
            f"the table space holds {space[0].shape[0]} directory rows for {len(directory.tables)} "
            "tables, or arrays the directory no longer holds: rebuild it when a table is added"
        )
    for t, table in enumerate(directory.tables):
        where = f"table {t} ({table.cfg.name!r})"
        for column, (name, dtype, size) in _ARRAYS.items():
            a = getattr(table.arrays, name)
            if int(d[t, column]) != a.ctypes.data:
                raise DirectoryError(
                    f"{where}: the directory holds address {int(d[t, column]):#x} for its {name}, "
                    f"which are at {a.ctypes.data:#x}: an array replaced without a publish (NOTE [table directory])"
                )
            if a.dtype != dtype or not a.flags.c_contiguous or a.shape[0] != int(d[t, size]):
                raise DirectoryError(
                    f"{where}: its {name} are {a.dtype} {a.shape} (contiguous: {a.flags.c_contiguous}); the "
                    f"directory expects C-contiguous {np.dtype(dtype)} of {int(d[t, size])} entries"
                )
        rows = table.arrays.rows
        if rows.ndim != 2 or rows.shape[1] != int(d[t, KD.D_WIDTH]) or not 0 <= d[t, KD.D_NROWS] <= rows.shape[0]:
            raise DirectoryError(
                f"{where}: rows {rows.shape} against the directory's width {int(d[t, KD.D_WIDTH])} "
                f"and row count {int(d[t, KD.D_NROWS])}"
            )
        if int(d[t, KD.D_ROOM]) != room_of(table):
            raise DirectoryError(f"{where}: the directory's room {int(d[t, KD.D_ROOM])} is not {room_of(table)}")

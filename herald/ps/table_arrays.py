"""The arrays of one table, replaced in one place that publishes them.

A table's rows and per-row arrays live at the addresses its shard's directory holds
(NOTE [table directory] in herald/ps/kernels/directory.py). :class:`TableArrays` is the
only holder of them: its attributes are read-only, and every reallocation (growth, a new
key map, a restore) goes through :meth:`TableArrays.install`, which calls the table's
publish right after, so no array can be replaced without its directory row being
rewritten.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from herald import keymap
from herald.ps.directory import DirectoryError
from herald.ps.kernels import copy_rows_jit

#: The table of every key in a table's map (one map per table: NOTE [key map]).
ONE_TABLE = 0
#: Per-row arrays besides ``rows`` (grown, compacted and reset together), with their dtypes.
PER_ROW = {
    "row_keys": np.uint64,  # the key of each row
    "row_marks": np.int32,  # open aggregations per row (NOTE [ps aggregation])
    "stamps": np.uint32,  # duplicate detection per request
    "last_used": np.uint64,  # request clock of each row's last touch (NOTE [bounded ps])
    "clocks": np.uint64,  # c_g of each row: NOTE [embedding clocks] in herald/ps/table.py
}


class TableArrays:
    """``rows`` float32 [capacity, width] (embedding then optimizer state), the per-row
    arrays of :data:`PER_ROW` (each [capacity]) and ``buckets`` int64 (the key map, load
    <= 1/2) of one table.

    Args:
        width: floats per row. capacity: rows allocated.
        publish: called (no arguments) after every :meth:`install`: the table's directory
            row is rewritten (NOTE [table directory]).
    """

    def __init__(self, width: int, capacity: int, publish: Callable[[], None]):
        self._publish = publish
        self._a: dict[str, np.ndarray] = {"rows": np.zeros((capacity, width), np.float32)}
        for name, dtype in PER_ROW.items():
            self._a[name] = np.zeros(capacity, dtype)
        self._a["buckets"] = keymap.new_buckets(2 * capacity, self._a["row_keys"], ONE_TABLE, 0, np.int64)

    rows = property(lambda self: self._a["rows"], doc="float32 [capacity, width]")
    row_keys = property(lambda self: self._a["row_keys"], doc="uint64 [capacity]: each row's key")
    row_marks = property(lambda self: self._a["row_marks"], doc="int32 [capacity]: open aggregations per row")
    stamps = property(lambda self: self._a["stamps"], doc="uint32 [capacity]: duplicate detection per request")
    last_used = property(lambda self: self._a["last_used"], doc="uint64 [capacity]: each row's last touch")
    clocks = property(lambda self: self._a["clocks"], doc="uint64 [capacity]: c_g of each row")
    buckets = property(lambda self: self._a["buckets"], doc="int64: the key map (row slots, -1 empty)")

    @property
    def capacity(self) -> int:
        return int(self._a["rows"].shape[0])

    def install(self, **arrays: np.ndarray) -> None:
        """Replace the named arrays (the only way to) and publish them (NOTE [table directory]).

        Raises:
            DirectoryError: a name that is not one of the table's arrays (a bug in herald).
        """
        unknown = set(arrays) - set(self._a)
        if unknown:
            raise DirectoryError(f"not arrays of a table: {sorted(unknown)}; known: {sorted(self._a)}")
        self._a.update(arrays)
        self._publish()

    def grow(self, capacity: int, n_rows: int) -> None:
        """Reallocate every per-row array for ``capacity`` rows, keeping the first ``n_rows``
        rows and all of each per-row array (zeros after)."""
        rows = np.empty((capacity, self.rows.shape[1]), np.float32)
        copy_rows_jit(rows, self.rows, n_rows)
        new = {"rows": rows}
        for name in PER_ROW:
            old = self._a[name]
            new[name] = np.zeros(capacity, old.dtype)
            new[name][: old.shape[0]] = old
        self.install(**new)

    def rebuild_map(self, max_keys: int, n_rows: int) -> None:
        """A new key map for ``max_keys`` keys at load <= 1/2, holding the first ``n_rows`` rows."""
        self.install(buckets=keymap.new_buckets(max_keys, self.row_keys, ONE_TABLE, n_rows, np.int64))

    def compact(self, keep: np.ndarray, n_rows: int) -> int:
        """Keep the rows ``keep`` (bool [n_rows]) of the first ``n_rows``, in order, in place
        (zeros after); returns the rows kept. The key map is the caller's to rebuild."""
        kept = int(keep.sum())
        rows = self.rows
        rows[:kept] = rows[:n_rows][keep]
        for name in PER_ROW:
            arr = self._a[name]
            arr[:kept] = arr[:n_rows][keep]
            arr[kept:n_rows] = 0
        return kept

    def reset(self, keys: np.ndarray, rows: np.ndarray, capacity: int, clocks: np.ndarray | None = None) -> None:
        """Replace every array: ``keys`` (uint64 [n]) and ``rows`` (float32 [n, width]) in
        ``capacity`` rows, the ``clocks`` (uint64 [n]) given, every other per-row value 0, a
        key map of ``2 * capacity`` keys."""
        n = keys.shape[0]
        new = {"rows": np.zeros((capacity, self.rows.shape[1]), np.float32)}
        new["rows"][:n] = rows
        for name, dtype in PER_ROW.items():
            new[name] = np.zeros(capacity, dtype)
        new["row_keys"][:n] = keys
        if clocks is not None:
            new["clocks"][:n] = clocks
        new["buckets"] = keymap.new_buckets(2 * capacity, new["row_keys"], ONE_TABLE, n, np.int64)
        self.install(**new)

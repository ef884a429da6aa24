"""One embedding table of a shard: key -> slot map and the contiguous row array.

Persia §4.2.2: rows live in one array (embedding and optimizer state together), so a
checkpoint is a memory copy of ``rows[:n_rows]`` and ``row_keys[:n_rows]``; the shared
key map (NOTE [key map] in :mod:`herald.keymap`) indexes it. The reads and writes of a
shard run over all its tables at once (:class:`~herald.ps.store.TableSet`, NOTE [table
directory] in herald/ps/kernels/directory.py); this class holds one table's arrays
(:class:`~herald.ps.table_arrays.TableArrays`, which publishes them into the set's
directory whenever they are replaced), makes room for new keys (:class:`TableRoom`:
growth, limits and eviction), and serves its own keys through its set (a set of its own
when it stands alone).
"""

from __future__ import annotations

import numpy as np

from herald import keymap
from herald.contracts.tables import TableConfig
from herald.errors import ProtocolError
from herald.ps.aggregate import PendingStep
from herald.ps.directory import ROW_OVERHEAD_BYTES
from herald.ps.evicted import EvictedKeys
from herald.ps.kernels.directory import D_NROWS
from herald.ps.rows import hyper_params, init_args
from herald.ps.store import TableSet, frozen
from herald.ps.table_arrays import ONE_TABLE, TableArrays

#: Rows a table allocates when it is declared (its arrays double as it grows).
FIRST_ROWS = 1024


def rows_within(max_bytes: int | None, width: int) -> int | None:
    """Rows of ``width`` floats in ``max_bytes`` (NOTE [ps limits]' ``max_table_bytes``;
    at least 1; None: no limit)."""
    return None if max_bytes is None else max(1, int(max_bytes) // (4 * int(width)))


def first_capacity(capacity_rows: int, max_rows: int | None) -> int:
    """Rows a new table allocates: ``capacity_rows`` (at least 16), at most ``max_rows``
    (:func:`rows_within` its ``max_table_bytes``; None: no bound)."""
    cap = max(16, int(capacity_rows))
    return cap if max_rows is None else max(16, min(cap, max_rows))


def table_bytes(rows: int, width: int) -> int:
    """What a table of ``rows`` allocated rows of ``width`` floats counts against NOTE [ps
    limits]' ``max_shard_bytes`` (Python ints)."""
    return int(rows) * (4 * int(width) + ROW_OVERHEAD_BYTES)


class EmbeddingTable:
    """Storage and updates of one table on one shard (single-threaded use).

    Args:
        tcfg: the table.
        table_index: its index in the declared table list (seeds the initialiser).
        seed: the job's seed.
        capacity_rows: initial row capacity (grows by doubling).
        max_bytes: largest row array (NOTE [ps limits]: ``max_table_bytes``); None: no limit.
            New keys that would grow the table past it are refused (:class:`ProtocolError`)
            before anything is stored.
        max_resident_rows: LRU bound on the rows held (NOTE [bounded ps]); None: no bound.
        tableset: the :class:`TableSet` of the shard this table belongs to (the table is
            appended to it; its ``max_bytes``, NOTE [ps limits]' ``max_shard_bytes``,
            bounds this table's growth too); None: a set of its own.

    Attributes:
        pos: the table's position in its set (the shard's table index).
        arrays: its :class:`~herald.ps.table_arrays.TableArrays` (rows, per-row arrays, key map).
        pending: the set's open aggregations per step (NOTE [ps aggregation]; a shard's
            tables share them).
    """

    def __init__(
        self,
        tcfg: TableConfig,
        table_index: int,
        seed: int,
        capacity_rows: int = FIRST_ROWS,
        max_bytes: int | None = None,
        max_resident_rows: int | None = None,
        tableset: TableSet | None = None,
    ):
        self.cfg = tcfg
        self.index = table_index
        self.width = tcfg.row_width
        # Python ints: a row count times a row size never overflows
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.max_rows = rows_within(max_bytes, self.width)
        self.max_resident = None if max_resident_rows is None else int(max_resident_rows)
        if self.max_resident is not None and self.max_resident < 1:
            raise ValueError(f"max_resident_rows must be >= 1, got {max_resident_rows}")
        self.evicted = 0  # rows dropped by the LRU bound (NOTE [bounded ps])
        self.evicted_keys = EvictedKeys()  # their keys (NOTE [evictions read again])
        self.init_args = init_args(tcfg, table_index, seed)
        self.hp = hyper_params(tcfg)
        self._set = tableset if tableset is not None else TableSet()
        self._dir = self._set.directory
        self.arrays = TableArrays(self.width, first_capacity(capacity_rows, self.max_rows), self._publish)
        self.pos = self._dir.add(self)
        self._publish()
        self.room = TableRoom(self, self._set)

    def _publish(self) -> None:
        """The arrays were replaced: rewrite this table's directory row (NOTE [table directory])."""
        self._dir.publish(self.pos)

    @property
    def n_rows(self) -> int:
        """Rows held (kept in the set's directory, where the kernels update it)."""
        return int(self._dir.d[self.pos, D_NROWS])

    @n_rows.setter
    def n_rows(self, n: int) -> None:
        self._dir.d[self.pos, D_NROWS] = n

    # the table's arrays (read-only; replaced only by TableArrays.install: NOTE [table directory])
    rows = property(lambda self: self.arrays.rows, doc="float32 [capacity, width] (read the first n_rows)")
    row_keys = property(lambda self: self.arrays.row_keys, doc="uint64 [capacity]: each row's key")
    clocks = property(lambda self: self.arrays.clocks, doc="uint64 [capacity]: c_g (NOTE [embedding clocks])")
    buckets = property(lambda self: self.arrays.buckets, doc="int64: the key map (load <= 1/2)")

    @property
    def pending(self) -> dict[int, PendingStep]:
        return self._set.aggregations.pending

    def _check(
        self, keys: np.ndarray, arr: np.ndarray | None = None, width: int = 0, contributors: np.ndarray | None = None
    ) -> None:
        """Shapes and dtypes the kernels rely on (they do no bounds checks)."""
        ok = isinstance(keys, np.ndarray) and keys.dtype == np.uint64 and keys.ndim == 1
        n = keys.shape[0] if ok else -1
        if arr is not None:
            ok = ok and arr.dtype == np.float32 and arr.shape == (n, width) and arr.flags.c_contiguous
        if contributors is not None:
            ok = (
                ok
                and isinstance(contributors, np.ndarray)
                and contributors.dtype == np.uint16
                and contributors.shape == (n,)
            )
        if not ok:
            raise ProtocolError(
                f"table {self.cfg.name!r}: expected keys uint64 [n]"
                + (f", float32 [n, {width}] C-contiguous" if arr is not None else "")
                + (", contributors uint16 [n]" if contributors is not None else "")
            )

    def _mine(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tables, keys) of a request of this table's ``keys`` to its set."""
        return self._dir.positions(self.pos, keys.shape[0]), frozen(keys)

    def reserve(self, n: int) -> None:
        """Room for ``n`` more rows (:meth:`TableRoom.reserve`)."""
        self.room.reserve(n)

    def prepare(self, keys: np.ndarray) -> None:
        """Room for the unseen ones of ``keys`` (:meth:`TableRoom.prepare`)."""
        self.room.prepare(keys)

    def slots(self, keys: np.ndarray) -> np.ndarray:
        """Row slots of ``keys`` (uint64 [n]), inserting initialised rows for unseen keys."""
        self._check(keys)
        return self._set.slots(*self._mine(keys))

    def pull(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows of ``keys`` (float32 [n, width], duplicates allowed) and how many of them
        have an open aggregation (NOTE [ps aggregation])."""
        self._check(keys)
        return self._set.pull(*self._mine(keys), self.cfg.dim, self.width)

    def pull_clocked(self, keys: np.ndarray, c_c: np.ndarray, staleness: int) -> tuple[np.ndarray, np.ndarray, int]:
        """A conditional pull (NOTE [clock frames] in herald/ps/wire.py): ``c_c`` (uint64 [m],
        m <= n) are the cached copies' clocks of the first m ``keys`` (uint64 [n]); key i < m
        is valid when ``c_g <= c_c + staleness``. Returns c_g of every key (uint64 [n]), the
        rows of the keys not valid, in key order (float32 [n - valid, width]), and how many of
        those have an open aggregation.

        Raises:
            ProtocolError: keys not uint64 [n] or ``c_c`` not uint64 [m <= n].
        """
        self._check(keys)
        if not (
            isinstance(c_c, np.ndarray) and c_c.dtype == np.uint64 and c_c.ndim == 1 and c_c.shape[0] <= keys.shape[0]
        ):
            raise ProtocolError(f"table {self.cfg.name!r}: cached clocks must be uint64 [m <= {keys.shape[0]}]")
        return self._set.pull_clocked(*self._mine(keys), self.cfg.dim, self.width, frozen(c_c), staleness)

    def push_rows(self, keys: np.ndarray, rows: np.ndarray, advance: np.ndarray | None = None) -> np.ndarray | None:
        """Overwrite rows (embedding + state) of unique ``keys`` with ``rows`` [n, width]; with
        ``advance`` (uint64 [n]) also c_g += advance (NOTE [embedding clocks]) and return c_g
        after (uint64 [n]), else None.

        Raises:
            ProtocolError: bad shapes or dtypes, or a key given twice (nothing is stored then).
        """
        self._check(keys, rows, self.width)
        if advance is not None and not (
            isinstance(advance, np.ndarray) and advance.dtype == np.uint64 and advance.shape == keys.shape
        ):
            raise ProtocolError(f"table {self.cfg.name!r}: clock advances must be uint64 [{keys.shape[0]}]")
        return self._set.push_rows(
            *self._mine(keys), frozen(rows), None if advance is None else frozen(advance), self._set.next_stamp()
        )

    def push_grad(self, keys, grads, contributors, step: int, rank: int) -> int:
        """One contributor's gradients for ``step`` (NOTE [ps aggregation]); returns rows updated.

        Args:
            keys: uint64 [n], unique; grads: float32 [n, dim]; contributors: uint16 [n].

        Raises:
            ProtocolError: duplicate keys, a gradient holding NaN or infinity, or the push
                breaks the aggregation rules (no row is changed then).
        """
        self._check(keys, grads, self.cfg.dim, contributors)
        return self._set.push_grad(
            *self._mine(keys), frozen(grads), frozen(contributors), step, rank, self._set.next_stamp()
        )[1]

    # NOTE [embedding clocks]
    # ~~~~~~~~~~~~~~~~~~~~~~~
    # HET's global Lamport clock c_g per embedding (HET §3.3): the number of updates
    # the PS row holds. An optimizer application of an aggregated gradient adds 1 (a row of
    # ``slots`` whose aggregation is complete after a push has no open mark left: with the
    # dispatcher's steps one aggregation per row is open at a time). A worker that writes
    # back or plan-pushes a row it alone updated sends, with the row (``push_rows`` with an
    # ``advance`` frame), how many local updates the row holds since it last synchronised
    # (c_c - c_s), and the PS adds them as it stores the row (``push_rows(advance=...)``).
    # HET's Evict sets c_g = max(c_g, c_c); in herald only the holder of the only latest copy
    # writes a row back (NOTE [step protocol]), so c_g = c_s on the PS then and the two
    # agree. A conditional pull (``pull_clocked``) reads c_g and evaluates CheckValid's
    # second condition on the shard, sending rows only of the copies not valid (NOTE [clock
    # frames] in herald/ps/wire.py). A checkpoint on the grid, after which the worker caches
    # are empty, holds no clocks: a table restored from it starts them at 0 (the copies
    # fetched then take c_g as c_s: only differences count). One off the grid, whose
    # worker caches are saved with their clocks (NOTE [warm resume] in
    # herald/dispatch/warm.py), holds them, and the restored table goes on from them.

    def expire(self, now: float, timeout_s: float) -> list[dict]:
        """Abort this table's aggregations open longer than ``timeout_s`` (NOTE [ps
        aggregation]); one report per aborted step (:meth:`~herald.ps.aggregate.StepAggregations.expire`)."""
        return self._set.aggregations.expire(now, timeout_s, only=self.pos)

    @property
    def evicted_read_again(self) -> int:
        """Inserts of keys this table evicted earlier (NOTE [evictions read again]): rows
        re-initialised by the bound and read again (0 without evictions)."""
        return self.evicted_keys.read_again(self.row_keys[: self.n_rows])

    @property
    def open_aggregations(self) -> int:
        return self._set.aggregations.open_of(self.pos)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """(row_keys uint64 [n], rows float32 [n, width]): views, copy before mutating."""
        return self.row_keys[: self.n_rows], self.rows[: self.n_rows]

    @staticmethod
    def load_capacity(n: int) -> int:
        """Rows :meth:`load` allocates for ``n`` rows."""
        return max(16, 1 << max(0, int(n - 1).bit_length()))

    def load(
        self, keys: np.ndarray, rows: np.ndarray, capacity: int | None = None, clocks: np.ndarray | None = None
    ) -> None:
        """Replace the whole table by (keys, rows), allocating ``capacity`` rows (at least
        ``len(keys)``; None: :meth:`load_capacity`); drops open aggregations. ``clocks``
        (uint64 [n]): the rows' c_g (NOTE [embedding clocks]); None: 0. NOTE [ps
        limits]' ``max_shard_bytes`` is the caller's to check, over every table restored
        (:meth:`~herald.ps.directory.TableDirectory.check_bytes` before the first :meth:`load`)."""
        n = keys.shape[0]
        if self.max_resident is not None and n > self.max_resident:
            raise ProtocolError(
                f"table {self.cfg.name!r}: {n} rows exceed this shard's "
                f"max_resident_rows={self.max_resident}; raise --ps-max-rows"
            )
        if self.max_rows is not None and n > self.max_rows:
            raise ProtocolError(
                f"table {self.cfg.name!r}: {n} rows ({n * 4 * self.width} bytes) exceed this "
                f"shard's max_table_bytes={self.max_bytes}; raise --max-table-bytes"
            )
        self.evicted_keys.clear(self.row_keys[: self.n_rows])  # NOTE [evictions read again]
        cap = self.load_capacity(n) if capacity is None else max(int(capacity), n)
        self._set.aggregations.forget(self.pos)  # its open aggregations, and the key maps of its steps
        self.n_rows = n
        self.arrays.reset(keys, rows, cap, clocks)  # without clocks they restart with a restored table


class TableRoom:
    """Room for a table's unseen keys, its Python path when a kernel found it short (NOTE
    [table directory]'s ``D_ROOM``): growth (its arrays double), NOTE [ps limits]' byte
    limits (``max_table_bytes``, the shard's ``max_shard_bytes``) and NOTE [bounded ps]'
    eviction.

    Args:
        table: the :class:`EmbeddingTable` (its arrays, row count, bounds and counts of
            evictions). store: the :class:`~herald.ps.store.TableSet` it belongs to (the
            directory's byte limit, the aggregations' slots of evicted rows).
    """

    def __init__(self, table: EmbeddingTable, store: TableSet):
        self.table = table
        self.directory, self.aggregations = store.directory, store.aggregations

    def reserve(self, n: int) -> None:
        """Room for ``n`` more rows (arrays double, up to the byte limits of NOTE [ps
        limits]; the map stays at load <= 1/2)."""
        need = self.table.n_rows + n
        cap = self.table.arrays.capacity
        if need > cap:
            while cap < need:
                cap *= 2
            for bound in (self.table.max_rows, self.directory.room_rows(self.table.pos)):
                if bound is not None:
                    cap = max(need, min(cap, bound))
            self.table.arrays.grow(cap, self.table.n_rows)
        if 2 * need > self.table.arrays.buckets.shape[0]:
            self.table.arrays.rebuild_map(2 * need, self.table.n_rows)

    def prepare(self, keys: np.ndarray) -> None:
        """Room for the unseen ones of ``keys`` (uint64 [n]): growth; NOTE [ps limits]'
        ``max_bytes`` and the shard's ``max_shard_bytes`` (:class:`ProtocolError` before
        anything is stored or evicted); NOTE [bounded ps]' eviction, never of a row of ``keys``."""
        grow = keys.shape[0]
        scratch = np.empty(grow, np.int64)
        max_rows, counted = self.table.max_rows, False
        if max_rows is not None and self.table.n_rows + grow > max_rows:
            grow, counted = self._check_growth(keys, scratch, max_rows), True
        room = self.directory.room_rows(self.table.pos)
        if room is not None and self._rows_after(grow) > room:
            if not counted:  # keys.shape[0] overstates the growth: count the distinct unseen keys
                grow = self._count_unseen(keys, scratch)
            self._check_shard_growth(grow, room)
        bound = self.table.max_resident
        if bound is not None and self.table.n_rows + grow > bound:
            grow = self._evict_for(keys, scratch, bound)
        self.reserve(grow)

    # NOTE [bounded ps]
    # ~~~~~~~~~~~~~~~~~
    # Persia's embedding PS (Persia §4.2.2) is an LRU cache bounded in memory: a row
    # not touched for long is dropped and re-initialised when its id comes back. With
    # ``max_resident_rows = N`` a table never holds more than N rows. Before a request would
    # insert rows past N, the least recently used rows are evicted: never a row of the
    # current request, never a row with an open gradient aggregation (NOTE [ps
    # aggregation]). Eviction compacts the row array (keeping order) and rebuilds the key
    # map, so it frees at least N/16 rows at a time to amortise that O(N) pass; pending
    # aggregation states have their row slots remapped. ``evicted`` counts dropped rows,
    # :attr:`evicted_read_again` the inserts of keys evicted earlier (NOTE [evictions read
    # again] in herald/ps/evicted.py).
    # A request with more distinct new keys than N, or one that cannot free enough rows
    # (all held by open aggregations), is refused with :class:`ProtocolError`.

    def _evict_for(self, keys: np.ndarray, scratch: np.ndarray, bound: int) -> int:
        """Evict least recently used rows so that ``keys``' unseen ones fit under ``bound``
        (the table's ``max_resident``); returns the number of distinct unseen keys."""
        unseen = self._count_unseen(keys, scratch)
        need = self.table.n_rows + unseen - bound
        if need <= 0:
            return unseen
        if unseen > bound:
            raise ProtocolError(
                f"table {self.table.cfg.name!r}: one request has {unseen} new keys, more than this "
                f"shard's max_resident_rows={self.table.max_resident}; send smaller requests or "
                "raise --ps-max-rows"
            )
        n = self.table.n_rows
        evictable = self.table.arrays.row_marks[:n] == 0
        evictable[scratch[scratch >= 0]] = False
        candidates = np.flatnonzero(evictable)
        if candidates.shape[0] < need:
            raise ProtocolError(
                f"table {self.table.cfg.name!r}: {need} rows must be evicted to stay within "
                f"max_resident_rows={self.table.max_resident}, but only {candidates.shape[0]} are "
                "free of this request and of open aggregations; raise --ps-max-rows"
            )
        count = min(candidates.shape[0], max(need, bound // 16))
        age = self.table.arrays.last_used[candidates]
        victims = candidates[np.argpartition(age, count - 1)[:count]] if count < candidates.shape[0] else candidates
        self._compact(victims)
        return unseen

    def _compact(self, victims: np.ndarray) -> None:
        """Drop rows ``victims`` (int64 slots), keep the others in order, rebuild the map."""
        n = self.table.n_rows
        keep = np.ones(n, bool)
        keep[victims] = False
        new_of_old = np.full(n, -1, np.int64)
        new_of_old[keep] = np.arange(int(keep.sum()))
        self.table.evicted_keys.add(self.table.row_keys[victims])  # before the keys move
        kept = self.table.arrays.compact(keep, n)
        self.aggregations.remap(self.table.pos, new_of_old)  # pending aggregations follow their rows
        self.table.n_rows = kept
        self.table.evicted += int(victims.shape[0])
        self.table.arrays.rebuild_map(self.table.arrays.buckets.shape[0] // 2, kept)

    def _count_unseen(self, keys: np.ndarray, scratch: np.ndarray) -> int:
        """Distinct ``keys`` not in the table; ``scratch`` (int64 [n]) gets each key's slot or -1."""
        keymap.find_many_jit(self.table.arrays.buckets, self.table.row_keys, ONE_TABLE, ONE_TABLE, keys, scratch)
        return int(np.unique(keys[scratch < 0]).shape[0])

    def _check_growth(self, keys: np.ndarray, scratch: np.ndarray, max_rows: int) -> int:
        """The number of distinct unseen ``keys``; :class:`ProtocolError` if they would grow the
        table past ``max_rows`` (its ``max_bytes``)."""
        unseen = self._count_unseen(keys, scratch)
        if self.table.n_rows + unseen > max_rows:
            need = (self.table.n_rows + unseen) * 4 * self.table.width
            raise ProtocolError(
                f"table {self.table.cfg.name!r}: {unseen} new keys would grow it to "
                f"{self.table.n_rows + unseen} rows ({need} bytes) on this shard, past its "
                f"max_table_bytes={self.table.max_bytes}; add PS shards or raise --max-table-bytes"
            )
        return unseen

    def _rows_after(self, unseen: int) -> int:
        """Rows the table holds once ``unseen`` new keys are in (after NOTE [bounded ps]'
        evictions: at most ``max_resident``)."""
        after = self.table.n_rows + unseen
        return after if self.table.max_resident is None else min(after, self.table.max_resident)

    def _check_shard_growth(self, unseen: int, room: int) -> None:
        """:class:`ProtocolError` if the rows after ``unseen`` new keys need more rows than
        ``room``, what NOTE [ps limits]' ``max_shard_bytes`` leaves this table."""
        after = self._rows_after(unseen)
        cap = self.table.arrays.capacity
        if after > max(room, cap):
            total = self.directory.nbytes() + table_bytes(after - cap, self.table.width)
            self.directory.check_bytes(total, f"table {self.table.cfg.name!r}: {unseen} new keys ({after} rows)")

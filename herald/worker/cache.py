"""The worker's embedding cache, driven by the scheduler's cache plan.

A dense slot array ``rows float32 [capacity_rows, row_width]`` (embedding then
optimizer state, the PS's row layout) and a (table, id) -> slot map (the shared one,
NOTE [key map] in :mod:`herald.keymap`: fixed size, at least twice the capacity,
deletion without tombstones, so inserting and evicting every step never degrades it). The cache
makes no decisions: it evicts, inserts and updates exactly what the plan says
(NOTE [step protocol] in herald/scheduler/plan.py), so its contents equal the
scheduler's snapshot by construction; :meth:`EmbeddingCache.keys` lets a debug
check compare them (HET §4.3 for the cache, Herald §4.2 for the snapshot).

Rows stay in host memory so that the sparse optimizer runs the PS's numba kernels
(bit-identical updates); the rows a micro-batch uses are gathered into a tensor on
the training device each step.
"""

from __future__ import annotations

import numpy as np

from herald import keymap
from herald.errors import ConfigError, ProtocolError
from herald.scheduler.plan import KeySet


class EmbeddingCache:
    """Fixed-capacity cache of embedding rows keyed by (table, id).

    Args:
        capacity_rows: slots (rows) in the cache, > 0; the scheduler's per-worker capacity.
        row_width: floats per row (embedding dim + optimizer state dim).

    Raises:
        ConfigError: non-positive capacity or width.
    """

    def __init__(self, capacity_rows: int, row_width: int):
        if capacity_rows <= 0 or row_width <= 0:
            raise ConfigError(f"cache needs capacity_rows > 0 and row_width > 0, got {capacity_rows}, {row_width}")
        self.capacity_rows = int(capacity_rows)
        self.row_width = int(row_width)
        self.rows = np.zeros((self.capacity_rows, self.row_width), np.float32)
        self._buckets = np.full(keymap.bucket_count(self.capacity_rows), -1, np.int32)
        self._slot_ids = np.zeros(self.capacity_rows, np.uint64)  # key of each slot in use
        self._slot_tab = np.zeros(self.capacity_rows, np.int32)
        self._free = np.arange(self.capacity_rows, dtype=np.int64)  # free slots: a stack, top at _free[_nfree - 1]
        self._nfree = self.capacity_rows
        self._size = 0

    def __len__(self) -> int:
        return self._size

    # ---------------------------------------------------------------- lookups
    def slots(self, keys: KeySet, *, must_exist: bool = True) -> np.ndarray:
        """int64 [n] slots of ``keys`` (-1 where absent unless ``must_exist``).

        Raises:
            ProtocolError: ``must_exist`` and a key is not cached: the cache and the
                scheduler's snapshot disagree (a protocol bug, never expected).
        """
        out = np.empty(len(keys), np.int64)
        keymap.find_many_jit(self._buckets, self._slot_ids, self._slot_tab, keys.table, keys.ids, out)
        if must_exist and len(keys) and out.min() < 0:
            i = int(np.argmin(out))
            raise ProtocolError(f"key (table {keys.table[i]}, id {keys.ids[i]}) is not in the worker cache although "
                                "the plan uses it: cache and scheduler snapshot disagree")
        return out

    def key_set(self) -> KeySet:
        """Every cached key, sorted by (table, id)."""
        used = self._buckets[self._buckets >= 0]
        tab, ids = self._slot_tab[used], self._slot_ids[used]
        order = np.lexsort((ids, tab))
        return KeySet(tab[order], ids[order])

    def keys(self) -> set[tuple[int, int]]:
        """Every cached (table, id), for debug checks against the snapshot."""
        return self.key_set().as_set()

    # -------------------------------------------------------------- mutations
    def evict(self, keys: KeySet, write_back: np.ndarray) -> np.ndarray:
        """Drop ``keys``; returns a copy of the rows flagged in ``write_back`` (bool [n]).

        Raises:
            ProtocolError: a key to evict is not cached.
        """
        slots = self.slots(keys)
        out = self.rows[slots[write_back]].copy()
        gone = np.empty(len(keys), np.int64)
        keymap.delete_many_jit(self._buckets, self._slot_ids, self._slot_tab, keys.table, keys.ids, gone)
        self._free[self._nfree: self._nfree + slots.shape[0]] = slots
        self._nfree += slots.shape[0]
        self._size -= len(keys)
        return out

    def put(self, keys: KeySet, rows: np.ndarray) -> None:
        """Store ``rows`` (float32 [n, row_width]) for ``keys``: overwrite cached ones
        in place, insert the rest into free slots.

        Raises:
            ProtocolError: more new keys than free slots (the plan broke capacity).
        """
        if rows.shape != (len(keys), self.row_width):
            raise ProtocolError(f"put: rows {rows.shape} do not match {len(keys)} keys x width {self.row_width}")
        slots = self.slots(keys, must_exist=False)
        new = np.flatnonzero(slots < 0)
        if new.shape[0] > self._nfree:
            raise ProtocolError(f"plan inserts {new.shape[0]} rows into a cache with {self._nfree} free slots "
                                f"(capacity {self.capacity_rows}): cache and scheduler snapshot disagree")
        if new.shape[0]:
            self._nfree -= new.shape[0]
            fresh = self._free[self._nfree: self._nfree + new.shape[0]].copy()
            slots[new] = fresh
            keymap.insert_many_jit(self._buckets, self._slot_ids, self._slot_tab, keys.table[new], keys.ids[new], fresh)
            self._size += new.shape[0]
        self.rows[slots] = rows

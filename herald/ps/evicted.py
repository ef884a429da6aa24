"""The keys a bounded PS table evicted, to count the evicted rows read again (NOTE [bounded ps]).

NOTE [evictions read again]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
An evicted row comes back re-initialised when its key is touched again (a pull, a
gradient push; a whole-row write-back restores it), so a bounded PS is not the
unbounded one. How far it strays is counted per table as ``evicted_rows_read_again``:
the times a key evicted earlier was inserted again. The table keeps every key it ever
evicted in an exact set (a key map, NOTE [key map]: 8 bytes per key plus its buckets,
at load <= 1/2), filled as rows are evicted; no insert path looks at it. The count is
taken from what the set already knows: a key evicted a second time was inserted again
in between (counted as it is evicted), and a resident key that is in the set was
inserted again since its last eviction (counted when asked: :meth:`EvictedKeys.read_again`).
Each insert of an evicted key is so counted exactly once. A restore (``load``) folds the
count of the rows it replaces in and starts an empty set: the restored rows are the
checkpoint's, not evicted ones read again.
"""

from __future__ import annotations

import numpy as np

from herald import keymap

_ONE_TABLE = 0  # a set serves one table (NOTE [key map]: one int for every key)


class EvictedKeys:
    """An exact set of uint64 keys (the evictions of one table) and the count of its keys
    evicted more than once (NOTE [evictions read again]). Single-threaded use."""

    def __init__(self):
        self._reset()
        self.folded = 0  # keys read again counted before the last :meth:`clear`

    def _reset(self) -> None:
        self.ids = np.zeros(16, np.uint64)
        self.n = np.zeros(1, np.int64)  # keys held (keymap's n_slots)
        self.buckets = keymap.new_buckets(16, self.ids, _ONE_TABLE, 0, np.int64)
        self.repeats = 0  # evictions of keys already held

    def __len__(self) -> int:
        return int(self.n[0])

    def add(self, keys: np.ndarray) -> None:
        """Remember evicted ``keys`` (uint64 [n], distinct); those already held count as
        evicted again (so inserted again in between)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        before, need = len(self), len(self) + keys.shape[0]
        if need > self.ids.shape[0]:
            cap = max(need, 2 * self.ids.shape[0])
            ids = np.zeros(cap, np.uint64)
            ids[:before] = self.ids[:before]
            self.ids = ids
            self.buckets = keymap.new_buckets(cap, self.ids, _ONE_TABLE, before, np.int64)
        out = np.empty(keys.shape[0], np.int64)
        keymap.find_or_insert_many_jit(self.buckets, self.ids, _ONE_TABLE, self.n, _ONE_TABLE, keys, out)
        self.repeats += keys.shape[0] - (len(self) - before)

    def read_again(self, resident: np.ndarray) -> int:
        """Inserts of evicted keys so far: evictions of keys evicted before, plus the keys
        of ``resident`` (uint64 [n], the table's keys now) held here, plus :attr:`folded`."""
        if not len(self):
            return self.folded
        out = np.empty(resident.shape[0], np.int64)
        found = keymap.find_many_jit(
            self.buckets, self.ids, _ONE_TABLE, _ONE_TABLE, np.ascontiguousarray(resident, np.uint64), out
        )
        return self.folded + self.repeats + int(found)

    def clear(self, resident: np.ndarray) -> None:
        """Fold :meth:`read_again` of ``resident`` (the rows about to be replaced) into
        :attr:`folded` and forget every key (a restore: NOTE [evictions read again])."""
        self.folded = self.read_again(resident)
        self._reset()

"""Shuffle buffer of the GlobalBatcher: O(batch) work per batch, no per-row Python.

NOTE [shuffle buffer]: the buffer has ``capacity = max(shuffle_buffer, batch_size)``
slots, each naming one buffered row. Rows live in a list of chunks (the batches
read from the source); a slot holds a global row number. Each step draws
``batch_size`` distinct slots uniformly with ``rng``, emits their rows (in draw
order) and refills exactly those slots with the next ``batch_size`` source rows
(tf.data's buffer semantics, vectorised). When the chunk list grows past a bound,
the live rows are compacted into one chunk (amortised O(batch) per step; the
output does not depend on when compaction happens). At the end of the source the
remaining rows are permuted with ``rng`` and emitted.

When every table has at most one id per sample (all built-in sources), the rows
live instead in dense per-slot arrays (``_DenseStore``: ids uint64 [T, slots] plus a
presence mask), so a step is a few vectorised gathers and scatters. Both stores
implement the same slot semantics, so the output is the same; a multi-hot batch
switches the buffer to the chunk store.
"""

from __future__ import annotations

import numpy as np

from herald.loader.batch import KEY_DTYPE, SampleBatch
from herald.loader.formats.layouts import Decoded


def _single_hot_or_empty(batch: SampleBatch) -> bool:
    n = len(batch)
    return all(
        v.shape[0] == n or (v.shape[0] < n and np.diff(o).max(initial=0) <= 1)
        for v, o in zip(batch.values, batch.offsets)
    )


class _DenseStore:
    """Rows of single-hot-or-empty tables in dense arrays, one position per slot."""

    def __init__(self, batch: SampleBatch):
        self.table_names = batch.table_names
        self.labels, self.dense = batch.labels.copy(), batch.dense.copy()
        self.ids, self.has = self._dense_ids(batch)

    @staticmethod
    def _dense_ids(batch: SampleBatch):
        n, t = len(batch), batch.num_tables
        ids = np.zeros((t, n), KEY_DTYPE)
        has = np.ones((t, n), np.uint8)
        for i, (v, o) in enumerate(zip(batch.values, batch.offsets)):
            if v.shape[0] == n:
                ids[i] = v
            else:
                present = np.diff(o).astype(bool)
                ids[i, present] = v
                has[i] = present
        return ids, has

    def append(self, batch: SampleBatch) -> None:
        ids, has = self._dense_ids(batch)
        self.labels = np.concatenate([self.labels, batch.labels])
        self.dense = np.concatenate([self.dense, batch.dense])
        self.ids, self.has = np.concatenate([self.ids, ids], 1), np.concatenate([self.has, has], 1)

    def rows(self, idx: np.ndarray) -> SampleBatch:
        return Decoded(
            np.zeros(0, np.int8), self.labels, self.dense, self.ids, self.has, np.zeros((0, 0)), self.table_names
        ).batch(idx)

    def put(self, idx: np.ndarray, batch: SampleBatch) -> None:
        ids, has = self._dense_ids(batch)
        self.labels[idx], self.dense[idx] = batch.labels, batch.dense
        self.ids[:, idx], self.has[:, idx] = ids, has


class ShuffleBuffer:
    """Row store + slots. Args: rng: numpy Generator; batch_size: rows per draw (>= 1)."""

    def __init__(self, rng: np.random.Generator, batch_size: int):
        self.rng = rng
        self.batch_size = batch_size
        self.chunks: list[SampleBatch] = []
        self.starts: list[int] = []
        self.total = 0
        self.slots = np.zeros(0, np.int64)
        self.store: _DenseStore | None = None  # used while every table is single-hot-or-empty
        self._dense_ok = True

    def __len__(self) -> int:
        return int(self.slots.shape[0])

    def _append(self, batch: SampleBatch) -> np.ndarray:
        self.chunks.append(batch)
        self.starts.append(self.total)
        rows = np.arange(self.total, self.total + len(batch), dtype=np.int64)
        self.total += len(batch)
        return rows

    def _use_dense(self, batch: SampleBatch) -> bool:
        """True while the dense store applies; switches to chunks on a multi-hot batch."""
        if self._dense_ok and not _single_hot_or_empty(batch):
            self._dense_ok = False
            if self.store is not None:
                live = self.store.rows(self.slots)
                self.store = None
                self.chunks, self.starts, self.total = [], [], 0
                self.slots = self._append(live)
        return self._dense_ok

    def fill(self, batch: SampleBatch) -> None:
        """Add rows to new slots (initial fill)."""
        if self._use_dense(batch):
            n = len(self.slots)
            if self.store is None:
                self.store = _DenseStore(batch)
            else:
                self.store.append(batch)
            self.slots = np.arange(n + len(batch), dtype=np.int64)
            return
        self.slots = np.concatenate([self.slots, self._append(batch)])

    def gather(self, rows: np.ndarray) -> SampleBatch:
        """The rows with global numbers ``rows`` (int64 [m]), in that order."""
        starts = np.asarray(self.starts, np.int64)
        chunk = np.searchsorted(starts, rows, side="right") - 1
        order = np.argsort(chunk, kind="stable")
        parts = []
        bounds = np.searchsorted(chunk[order], np.arange(len(self.chunks) + 1))
        for c in range(len(self.chunks)):
            sel = order[bounds[c] : bounds[c + 1]]
            if sel.size:
                parts.append(self.chunks[c].take(rows[sel] - starts[c]))
        out = SampleBatch.concat(parts)
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.shape[0])
        return out.take(inverse)

    def step(self, new: SampleBatch) -> SampleBatch:
        """Emit ``batch_size`` random buffered rows and put the ``len(new) == batch_size``
        rows of ``new`` in their slots."""
        pick = self.rng.choice(self.slots.shape[0], self.batch_size, replace=False)
        if self._use_dense(new) and self.store is not None:
            out = self.store.rows(pick)
            self.store.put(pick, new)
            return out
        out = self.gather(self.slots[pick])
        self.slots[pick] = self._append(new)
        if len(self.chunks) > 8 and self.total > 3 * self.slots.shape[0]:
            self._compact()
        return out

    def drain(self, new: SampleBatch | None) -> SampleBatch | None:
        """All remaining rows (plus ``new``) in a random order, or None when empty."""
        if new is not None and len(new):
            self.fill(new)
        if not len(self):
            return None
        if self.store is not None:
            return self.store.rows(self.rng.permutation(self.slots.shape[0]))
        return self.gather(self.slots[self.rng.permutation(self.slots.shape[0])])

    def _compact(self) -> None:
        live = self.gather(self.slots)
        self.chunks, self.starts, self.total = [], [], 0
        self.slots = self._append(live)

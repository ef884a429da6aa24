"""The worker's embedding cache, driven by the scheduler's cache plan.

A slot array ``rows float32 [capacity_rows, row_width]`` (embedding then optimizer
state, the PS's row layout) and a (table, id) -> slot map (the shared one, NOTE [key
map] in :mod:`herald.keymap`: fixed size, at least twice the capacity, deletion without
tombstones, so inserting and evicting every step never degrades it). The cache makes no
decisions: it evicts, inserts and updates exactly what the plan says (NOTE [step
protocol] in herald/scheduler/plan.py), so its contents equal the scheduler's snapshot
by construction; :meth:`SlotMap.keys` lets a debug check compare them (HET §4.3 for the
cache, Herald §4.2 for the snapshot).

NOTE [cache interface]. The :class:`~herald.worker.executor.PlanExecutor` uses a cache
only through these calls (:class:`RowCache`), so the two implementations are
interchangeable (NOTE [worker devices] in herald/worker/devices.py chooses):

- :class:`EmbeddingCache` (this module): rows in host memory (numpy); the sparse
  optimizer is the PS's numba kernel (bit-identical updates); the rows a micro-batch
  uses are copied to the training device each step.
- :class:`~herald.worker.device_cache.DeviceCache`: rows in a torch tensor on the
  training device; lookup and sparse optimizer are torch operations there; only pulled,
  evicted and pushed rows cross to and from the host.

Both share :class:`SlotMap` (which slot holds which key), so for the same plan they put
every key in the same slot.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from herald import keymap
from herald.errors import ConfigError, ProtocolError
from herald.ps.config import TableConfig
from herald.ps.rows import apply_gradients_at
from herald.scheduler.plan import KeySet


class RowCache(Protocol):
    """NOTE [cache interface]: what the plan executor calls on a worker cache.

    Slots are int64 numpy arrays (:meth:`slots`); rows cross the interface as float32
    numpy arrays ``[n, row_width]`` (to and from the PS) or as torch tensors on the
    training device (lookup, gradients).
    """

    capacity_rows: int
    row_width: int

    def __len__(self) -> int: ...

    def slots(self, keys: KeySet, *, must_exist: bool = True) -> np.ndarray: ...

    def key_set(self) -> KeySet: ...

    def evict(self, keys: KeySet, write_back: np.ndarray) -> np.ndarray: ...

    def put(self, keys: KeySet, rows: np.ndarray) -> None: ...

    def read(self, slots: np.ndarray) -> np.ndarray: ...

    def gather(self, slots: np.ndarray, dim: int, device: torch.device) -> torch.Tensor: ...

    def apply_gradients(self, slots: np.ndarray, grads: torch.Tensor, grad_rows: np.ndarray,
                        table: TableConfig) -> None: ...

    def clear(self) -> None: ...


class SlotMap:
    """Which slot of a fixed-capacity slot array holds which (table, id) key.

    Args:
        capacity_rows: slots, > 0; the scheduler's per-worker capacity.
        row_width: floats per row (embedding dim + optimizer state dim), > 0.

    Raises:
        ConfigError: non-positive capacity or width.
    """

    def __init__(self, capacity_rows: int, row_width: int):
        if capacity_rows <= 0 or row_width <= 0:
            raise ConfigError(f"cache needs capacity_rows > 0 and row_width > 0, got {capacity_rows}, {row_width}")
        self.capacity_rows = int(capacity_rows)
        self.row_width = int(row_width)
        self._reset_map()

    def _reset_map(self) -> None:
        self._buckets = np.full(keymap.bucket_count(self.capacity_rows), -1, np.int32)
        self._slot_ids = np.zeros(self.capacity_rows, np.uint64)  # key of each slot in use
        self._slot_tab = np.zeros(self.capacity_rows, np.int32)
        self._free = np.arange(self.capacity_rows, dtype=np.int64)  # free slots: a stack, top at _free[_nfree - 1]
        self._nfree = self.capacity_rows
        self._size = 0

    def __len__(self) -> int:
        return self._size

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

    def _remove(self, keys: KeySet) -> np.ndarray:
        """Drop ``keys`` from the map; returns their (now free) slots, int64 [n].

        Raises:
            ProtocolError: a key is not cached.
        """
        slots = self.slots(keys)
        gone = np.empty(len(keys), np.int64)
        keymap.delete_many_jit(self._buckets, self._slot_ids, self._slot_tab, keys.table, keys.ids, gone)
        self._free[self._nfree: self._nfree + slots.shape[0]] = slots
        self._nfree += slots.shape[0]
        self._size -= len(keys)
        return slots

    def _assign(self, keys: KeySet) -> np.ndarray:
        """int64 [n]: the slot of each key: its own if cached, else a free one (inserted).

        Raises:
            ProtocolError: more new keys than free slots (the plan broke capacity).
        """
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
        return slots

    def _check_rows(self, keys: KeySet, rows: np.ndarray) -> None:
        if rows.shape != (len(keys), self.row_width):
            raise ProtocolError(f"put: rows {rows.shape} do not match {len(keys)} keys x width {self.row_width}")


class EmbeddingCache(SlotMap):
    """The host cache: rows in a numpy array, updated by the PS's numba kernels.

    Args:
        capacity_rows: slots (rows) in the cache, > 0; the scheduler's per-worker capacity.
        row_width: floats per row (embedding dim + optimizer state dim).

    Attributes:
        rows: float32 [capacity_rows, row_width], the slot array.

    Raises:
        ConfigError: non-positive capacity or width.
    """

    def __init__(self, capacity_rows: int, row_width: int):
        super().__init__(capacity_rows, row_width)
        self.rows = np.zeros((self.capacity_rows, self.row_width), np.float32)

    def evict(self, keys: KeySet, write_back: np.ndarray) -> np.ndarray:
        """Drop ``keys``; returns a copy of the rows flagged in ``write_back`` (bool [n]).

        Raises:
            ProtocolError: a key to evict is not cached.
        """
        slots = self.slots(keys)
        out = self.rows[slots[write_back]].copy()
        self._remove(keys)
        return out

    def put(self, keys: KeySet, rows: np.ndarray) -> None:
        """Store ``rows`` (float32 [n, row_width]) for ``keys``: overwrite cached ones
        in place, insert the rest into free slots.

        Raises:
            ProtocolError: more new keys than free slots (the plan broke capacity).
        """
        self._check_rows(keys, rows)
        self.rows[self._assign(keys)] = rows

    def read(self, slots: np.ndarray) -> np.ndarray:
        """float32 [n, row_width]: a copy of the rows in ``slots`` (int64 [n])."""
        return self.rows[slots]

    def gather(self, slots: np.ndarray, dim: int, device: torch.device) -> torch.Tensor:
        """float32 [n, dim] on ``device``: the embeddings in ``slots`` (a new tensor)."""
        return torch.from_numpy(self.rows[slots, :dim]).to(device)

    def apply_gradients(self, slots: np.ndarray, grads: torch.Tensor | np.ndarray, grad_rows: np.ndarray,
                        table: TableConfig) -> None:
        """The sparse optimizer of ``table`` on the rows in ``slots`` (int64 [n], distinct)
        with the gradients ``grads[grad_rows]`` (float32 [m, dim]; int64 [n]), in place:
        the PS's numba kernel (:func:`herald.ps.rows.apply_gradients_at`)."""
        if isinstance(grads, torch.Tensor):
            grads = grads.detach().to("cpu").numpy()
        apply_gradients_at(self.rows, slots, grads, grad_rows, table)

    def clear(self) -> None:
        """Forget every key (the rows' contents are left; every slot is free)."""
        self._reset_map()

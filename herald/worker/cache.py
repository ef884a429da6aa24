"""The worker's embedding cache, driven by the scheduler's cache plan.

A slot array ``rows float32 [capacity_rows, row_width]`` (embedding then optimizer
state, the PS's row layout) and a (table, id) -> slot map (the shared one, NOTE [key
map] in :mod:`herald.keymap`: fixed size, at least twice the capacity, deletion without
tombstones, so inserting and evicting every step never degrades it). The cache makes no
decisions: it evicts, inserts and updates exactly what the plan says (NOTE [step
protocol] in herald/contracts/plan.py), so its contents equal the scheduler's snapshot
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

Beyond the interface, :meth:`EmbeddingCache.lookup_pooled` pools a micro-batch straight
from the slots and returns its rows' gradients after backward (NOTE [fused bag kernels]
in herald/worker/kernels.py; measured against the gather + ``F.embedding_bag`` path and
FBGEMM's TBE by ``herald bench kernels``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from herald import keymap
from herald.contracts.plan import KeySet
from herald.contracts.tables import TableConfig
from herald.errors import ConfigError, DataError, ProtocolError
from herald.ps.rows import hyper_params
from herald.worker.kernels import apply_rows_at_jit, bag_grads_jit, pooled_sum_jit, take_rows_jit


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

    def apply_gradients(
        self, slots: np.ndarray, grads: torch.Tensor, grad_rows: np.ndarray, table: TableConfig
    ) -> None: ...

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
        #: times keys left the map (:meth:`_remove`, :meth:`clear`): while it is unchanged, a
        #: slot found for a key is still that key's (an insert takes a free slot)
        self.removals = 0
        self._reset_map()

    def _reset_map(self) -> None:
        self.removals += 1
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
            raise ProtocolError(
                f"key (table {keys.table[i]}, id {keys.ids[i]}) is not in the worker cache although "
                "the plan uses it: cache and scheduler snapshot disagree"
            )
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

    _MAP = ("_buckets", "_slot_ids", "_slot_tab", "_free")

    def map_state(self) -> dict[str, np.ndarray]:
        """Which slot holds which key, and the free slots in order: copies, for
        :meth:`load_map_state` (NOTE [warm resume] in herald/dispatch/warm.py)."""
        out = {k.lstrip("_"): getattr(self, k).copy() for k in self._MAP}
        out["counts"] = np.array([self._nfree, self._size], np.int64)
        return out

    def load_map_state(self, state: dict[str, np.ndarray]) -> None:
        """Take back :meth:`map_state` of a map of the same capacity (the rows are the caller's).

        Raises:
            DataError: other arrays or shapes (another capacity).
        """
        mine = self.map_state()
        if set(state) != set(mine) or any(
            not isinstance(state[k], np.ndarray) or state[k].shape != v.shape or state[k].dtype != v.dtype
            for k, v in mine.items()
        ):
            raise DataError(f"a saved worker cache does not fit this cache of {self.capacity_rows} rows")
        for k in self._MAP:
            setattr(self, k, state[k.lstrip("_")].copy())
        self._nfree, self._size = (int(v) for v in state["counts"])
        self.removals += 1

    def _remove(self, keys: KeySet) -> np.ndarray:
        """Drop ``keys`` from the map; returns their (now free) slots, int64 [n].

        Raises:
            ProtocolError: a key is not cached.
        """
        slots = self.slots(keys)
        self.removals += 1
        gone = np.empty(len(keys), np.int64)
        keymap.delete_many_jit(self._buckets, self._slot_ids, self._slot_tab, keys.table, keys.ids, gone)
        self._free[self._nfree : self._nfree + slots.shape[0]] = slots
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
            raise ProtocolError(
                f"plan inserts {new.shape[0]} rows into a cache with {self._nfree} free slots "
                f"(capacity {self.capacity_rows}): cache and scheduler snapshot disagree"
            )
        if new.shape[0]:
            self._nfree -= new.shape[0]
            fresh = self._free[self._nfree : self._nfree + new.shape[0]].copy()
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
        out = np.take(self.rows, slots[write_back], axis=0)  # a copy; faster than fancy indexing
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
        return np.take(self.rows, slots, axis=0)

    def gather(self, slots: np.ndarray, dim: int, device: torch.device) -> torch.Tensor:
        """float32 [n, dim] on ``device``: the embeddings in ``slots`` (a new tensor)."""
        return torch.from_numpy(take_rows_jit(self.rows, slots, dim)).to(device)

    def apply_gradients(
        self, slots: np.ndarray, grads: torch.Tensor | np.ndarray, grad_rows: np.ndarray, table: TableConfig
    ) -> None:
        """The sparse optimizer of ``table`` on the rows in ``slots`` (int64 [n], distinct)
        with the gradients ``grads[grad_rows]`` (float32 [m, dim]; int64 [n]), in place:
        the PS's arithmetic (:func:`herald.ps.kernels.apply_row_jit`, bit-identical to
        :func:`herald.ps.rows.apply_gradients_at`) with the next rows prefetched
        (:func:`herald.worker.kernels.apply_rows_at_jit`).

        Raises:
            ConfigError: ``table`` does not match the cache's row width; grads not [m, dim];
                slots and grad_rows of different lengths.
            ProtocolError: a slot outside the cache or a grad row outside ``grads``.
        """
        if isinstance(grads, torch.Tensor):
            grads = grads.detach().to("cpu").numpy()
        grads = np.ascontiguousarray(grads, np.float32)
        if (  # rows and gradients may be wider than the table's (NOTE [mixed widths] in herald/ps/router.py)
            table.row_width > self.row_width
            or grads.ndim != 2
            or grads.shape[1] < table.dim
            or slots.shape != grad_rows.shape
            or slots.ndim != 1
        ):
            raise ConfigError(
                f"apply_gradients: grads must be float32 [m, >= {table.dim}] (got {grads.shape}), slots "
                f"and grad_rows of one length (got {slots.shape}, {grad_rows.shape}), and the table's "
                f"row width {table.row_width} at most the cache's ({self.row_width})"
            )
        slots = slots.astype(np.int64, copy=False)
        grad_rows = grad_rows.astype(np.int64, copy=False)
        if slots.shape[0] and (
            slots.min() < 0
            or slots.max() >= self.capacity_rows
            or grad_rows.min() < 0
            or grad_rows.max() >= grads.shape[0]
        ):
            raise ProtocolError("apply_gradients: a slot outside the cache or a gradient row outside grads")
        apply_rows_at_jit(self.rows, slots, grads, grad_rows, table.optimizer.kind, table.dim, hyper_params(table))

    def clear(self) -> None:
        """Forget every key (the rows' contents are left; every slot is free)."""
        self._reset_map()

    def lookup_pooled(
        self, slots: np.ndarray, bags: BagLayout, dim: int, divisor: float = 1.0
    ) -> tuple[torch.Tensor, BagGrads]:
        """Sum-pooled embeddings straight from the slots (NOTE [fused bag kernels] in
        herald/worker/kernels.py): ``F.embedding_bag(mode="sum")`` over the gathered rows,
        bit-identical, without the gather copy or the index arrays.

        Args:
            slots: int64 [U], the slot of each distinct key of the micro-batch (table after
                table, as ``bags.id_bounds`` splits them; :meth:`slots`).
            bags: the micro-batch's values and bags (:class:`BagLayout`).
            dim: embedding dim (<= ``row_width``).
            divisor: the backward divides each row's gradient by it (the worker count).

        Returns:
            ``(pooled, grads)``: pooled float32 [B, T, dim] (CPU, requires grad); after
            ``backward()``, ``grads.rows`` is float32 [U, dim], row u the summed gradient of
            distinct key u divided by ``divisor`` (zeros if backward did not reach it).

        Raises:
            ProtocolError: slots, layout or dim inconsistent with each other or the cache.
        """
        bags.check(slots, dim, self.row_width)
        grads = BagGrads((slots.shape[0], dim), bags, np.float32(divisor))
        anchor = torch.empty(0, requires_grad=True)  # gives the output a grad_fn (the rows have none)
        return _PooledSum.apply(anchor, self.rows, slots, bags, dim, grads), grads


class BagLayout:
    """A micro-batch's bags in the flat layout of :class:`~herald.contracts.microbatch.MicroBatch`
    (NOTE [micro-batch layout]): what :meth:`EmbeddingCache.lookup_pooled` pools.

    Args:
        id_bounds: int64 [T + 1]: table t's distinct keys are ``id_bounds[t]:id_bounds[t + 1]``.
        inverse_flat: uint16 or int32 [N]: per table, each value's index into its distinct keys.
        inverse_bounds: int64 [T + 1]: table t's values are ``inverse_flat[inverse_bounds[t]:...]``.
        offsets_flat: int64 [T, B + 1]: table t's bag b is its values ``offsets[t, b]:offsets[t, b + 1]``.
    """

    __slots__ = ("id_bounds", "inverse", "inverse_bounds", "offsets")

    def __init__(
        self, id_bounds: np.ndarray, inverse_flat: np.ndarray, inverse_bounds: np.ndarray, offsets_flat: np.ndarray
    ):
        self.id_bounds, self.inverse = id_bounds, inverse_flat
        self.inverse_bounds, self.offsets = inverse_bounds, offsets_flat

    @classmethod
    def of(cls, mb) -> BagLayout:
        """The layout of a :class:`~herald.contracts.microbatch.MicroBatch`."""
        return cls(mb.id_bounds, mb.inverse_flat, mb.inverse_bounds, mb.offsets_flat)

    def check(self, slots: np.ndarray, dim: int, row_width: int) -> None:
        """Raise :class:`ProtocolError` unless dtypes and shapes fit the kernels (the
        values are checked by :func:`~herald.worker.kernels.pooled_sum_jit` on the way)."""
        ib, off, inv, idb = self.inverse_bounds, self.offsets, self.inverse, self.id_bounds
        t = idb.shape[0] - 1
        ok = (
            isinstance(slots, np.ndarray)
            and slots.dtype == np.int64
            and slots.ndim == 1
            and all(isinstance(a, np.ndarray) and a.dtype == np.int64 for a in (idb, ib, off))
            and isinstance(inv, np.ndarray)
            and inv.dtype in (np.uint16, np.int32)
            and inv.ndim == 1
            and idb.ndim == 1
            and t >= 0
            and ib.shape == (t + 1,)
            and off.ndim == 2
            and off.shape[0] == t
            and off.shape[1] >= 1
            and idb[-1] == slots.shape[0]
            and 0 < dim <= row_width
        )
        if not ok:
            raise ProtocolError(_LAYOUT_FIX)


_LAYOUT_FIX = (
    "lookup_pooled: slots and bag layout do not fit (int64 slots [U], id_bounds and inverse_bounds "
    "[T + 1], offsets [T, B + 1]; uint16 or int32 inverse; bounds and offsets consistent, every value "
    "within its table's distinct keys, slots within the cache, 0 < dim <= row_width): build the layout "
    "with BagLayout.of(micro_batch) and the slots with cache.slots(keys)"
)


class BagGrads:
    """Gradients of the distinct rows of one :meth:`EmbeddingCache.lookup_pooled`.

    Attributes:
        rows: float32 [U, dim]: written by the backward; zeros if backward did not reach
            the lookup (read it after ``backward()``).
    """

    __slots__ = ("_rows", "bags", "divisor", "shape")

    def __init__(self, shape: tuple[int, int], bags: BagLayout, divisor: np.float32):
        self._rows: np.ndarray | None = None
        self.shape, self.bags, self.divisor = shape, bags, divisor

    @property
    def rows(self) -> np.ndarray:
        if self._rows is None:
            self._rows = np.zeros(self.shape, np.float32)
        return self._rows

    def fill(self, grad_out: np.ndarray) -> None:
        """The backward: :func:`~herald.worker.kernels.bag_grads_jit` of ``grad_out``
        (float32 [B, T, dim], C-contiguous) into :attr:`rows`."""
        b = self.bags
        if self._rows is None:
            self._rows = np.empty(self.shape, np.float32)  # the kernel writes every element
        bag_grads_jit(grad_out, b.id_bounds, b.inverse, b.inverse_bounds, b.offsets, self.divisor, self._rows)


class _PooledSum(torch.autograd.Function):
    """Forward :func:`~herald.worker.kernels.pooled_sum_jit`, backward
    :func:`~herald.worker.kernels.bag_grads_jit` into ``BagGrads.rows`` (the cache rows
    themselves get no autograd gradient: the sparse optimizer applies ``BagGrads``)."""

    @staticmethod
    def forward(
        ctx, anchor: torch.Tensor, table: np.ndarray, slots: np.ndarray, bags: BagLayout, dim: int, grads: BagGrads
    ):
        b = bags.offsets.shape[1] - 1
        out = np.empty((b, bags.offsets.shape[0], dim), np.float32)
        bad = pooled_sum_jit(table, slots, bags.id_bounds, bags.inverse, bags.inverse_bounds, bags.offsets, out)
        if bad >= 0:
            raise ProtocolError(f"table {bad}: {_LAYOUT_FIX}")
        ctx.grads = grads
        return torch.from_numpy(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        ctx.grads.fill(np.ascontiguousarray(grad_out.detach().to("cpu", torch.float32).numpy()))
        return torch.zeros(0), None, None, None, None, None

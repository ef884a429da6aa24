"""Columnar sample batches: labels, dense features and one jagged array per table.

See docs/design.md, "Data model". Keys are unsigned 64-bit everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from herald.errors import DataError

KEY_DTYPE = np.dtype(np.uint64)
OFFSET_DTYPE = np.dtype(np.int64)


@dataclasses.dataclass(frozen=True)
class Schema:
    """Names of a source's columns: how many dense features and which sparse tables.

    Args:
        table_names: one name per embedding table (sparse feature), in order.
        dense_dim: number of dense float features per sample (``D``), >= 0.
    """

    table_names: tuple[str, ...]
    dense_dim: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "table_names", tuple(self.table_names))
        if self.dense_dim < 0:
            raise DataError(f"dense_dim must be >= 0, got {self.dense_dim}")
        if len(set(self.table_names)) != len(self.table_names):
            raise DataError(f"table names must be unique, got {self.table_names}")

    @property
    def num_tables(self) -> int:
        return len(self.table_names)


class SampleBatch:
    """A batch of ``B`` samples in columnar form.

    Layout, for ``B = 3`` samples, ``D = 2`` dense features and two tables, where
    table ``"user"`` is single-hot and table ``"tags"`` is multi-hot::

        labels  float32 [B]          [1.0, 0.0, 1.0]
        dense   float32 [B, D]       [[0.1, 0.2], [0.0, 1.3], [2.0, 0.5]]

        table "user"   values  uint64 [nnz=3]  [ 7,  9,  7]
                       offsets int64  [B+1]    [0, 1, 2, 3]          (lengths 1,1,1)
        table "tags"   values  uint64 [nnz=4]  [11, 12, 13, 11]
                       offsets int64  [B+1]    [0, 2, 2, 4]          (lengths 2,0,2)

    Sample ``i`` of table ``t`` uses ``values[t][offsets[t][i]:offsets[t][i+1]]``,
    as in TorchRec's ``KeyedJaggedTensor`` (here one numpy pair per table).

    Args:
        labels: float32 [B].
        dense: float32 [B, D] (``D`` may be 0).
        values: one uint64 [nnz_t] array per table.
        offsets: one int64 [B+1] array per table, starting at 0, non-decreasing,
            ending at ``nnz_t``.
        table_names: one name per table; defaults to ``t0, t1, ...``.
        validate: check shapes, dtypes and offsets (default); pass ``False`` only
            for arrays produced by herald's own kernels.

    Raises:
        DataError: a shape, dtype or offset is inconsistent. Keys given as signed
            or floating arrays are rejected rather than converted, so that no id is
            silently truncated or rounded.
    """

    __slots__ = ("labels", "dense", "values", "offsets", "table_names")

    def __init__(
        self,
        labels: np.ndarray,
        dense: np.ndarray,
        values: Sequence[np.ndarray],
        offsets: Sequence[np.ndarray],
        table_names: Sequence[str] | None = None,
        *,
        validate: bool = True,
    ) -> None:
        self.labels = labels
        self.dense = dense
        self.values = list(values)
        self.offsets = list(offsets)
        if table_names is None:
            table_names = [f"t{i}" for i in range(len(self.values))]
        self.table_names = tuple(table_names)
        if validate:
            self._validate()

    # ------------------------------------------------------------------ checks
    def _validate(self) -> None:
        b = self.labels.shape[0] if self.labels.ndim == 1 else -1
        if self.labels.dtype != np.float32 or self.labels.ndim != 1:
            raise DataError(f"labels must be float32 [B], got {self.labels.dtype} {self.labels.shape}")
        if self.dense.dtype != np.float32 or self.dense.ndim != 2 or self.dense.shape[0] != b:
            raise DataError(f"dense must be float32 [B={b}, D], got {self.dense.dtype} {self.dense.shape}")
        if not (len(self.values) == len(self.offsets) == len(self.table_names)):
            raise DataError(
                f"need one values and one offsets array per table: got {len(self.values)} values, "
                f"{len(self.offsets)} offsets, {len(self.table_names)} names"
            )
        for name, v, o in zip(self.table_names, self.values, self.offsets):
            if v.dtype != KEY_DTYPE or v.ndim != 1:
                raise DataError(
                    f"table {name!r}: values must be uint64 [nnz], got {v.dtype} {v.shape}; "
                    "convert ids with herald.hashing (never via int32 or float)"
                )
            if o.dtype != OFFSET_DTYPE or o.shape != (b + 1,):
                raise DataError(f"table {name!r}: offsets must be int64 [B+1={b + 1}], got {o.dtype} {o.shape}")
            if o[0] != 0 or o[-1] != v.shape[0] or (b > 0 and np.any(o[1:] < o[:-1])):
                raise DataError(
                    f"table {name!r}: offsets must start at 0, be non-decreasing and end at nnz={v.shape[0]}"
                )

    # --------------------------------------------------------------- accessors
    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_tables(self) -> int:
        return len(self.values)

    @property
    def dense_dim(self) -> int:
        return int(self.dense.shape[1])

    @property
    def schema(self) -> Schema:
        return Schema(self.table_names, self.dense_dim)

    def lengths(self, table: int) -> np.ndarray:
        """int64 [B]: number of ids of each sample in ``table``."""
        return np.diff(self.offsets[table])

    def is_single_hot(self, table: int) -> bool:
        """True when every sample has exactly one id in ``table``."""
        return self.values[table].shape[0] == len(self) and bool(np.all(self.lengths(table) == 1))

    def __repr__(self) -> str:
        nnz = [int(v.shape[0]) for v in self.values]
        return f"SampleBatch(B={len(self)}, D={self.dense_dim}, tables={list(self.table_names)}, nnz={nnz})"

    def equals(self, other: SampleBatch) -> bool:
        """Exact equality of every array and the table names (for tests)."""
        return (
            self.table_names == other.table_names
            and np.array_equal(self.labels, other.labels)
            and np.array_equal(self.dense, other.dense)
            and all(np.array_equal(a, b) for a, b in zip(self.values, other.values))
            and all(np.array_equal(a, b) for a, b in zip(self.offsets, other.offsets))
        )

    # ----------------------------------------------------------- construction
    @classmethod
    def empty(cls, schema: Schema) -> SampleBatch:
        """A batch of zero samples with ``schema``'s columns."""
        return cls(
            np.zeros(0, np.float32),
            np.zeros((0, schema.dense_dim), np.float32),
            [np.zeros(0, KEY_DTYPE) for _ in schema.table_names],
            [np.zeros(1, OFFSET_DTYPE) for _ in schema.table_names],
            schema.table_names,
        )

    @classmethod
    def from_single_hot(
        cls,
        labels: np.ndarray,
        dense: np.ndarray,
        ids: np.ndarray,
        table_names: Sequence[str] | None = None,
    ) -> SampleBatch:
        """Build a batch where every table is single-hot.

        Args:
            labels: float32 [B]; dense: float32 [B, D]; ids: uint64 [B, T].
        """
        b = ids.shape[0]
        offsets = np.arange(b + 1, dtype=OFFSET_DTYPE)
        values = [np.ascontiguousarray(ids[:, t]) for t in range(ids.shape[1])]
        return cls(labels, dense, values, [offsets] * ids.shape[1], table_names)

    # ------------------------------------------------------------- transforms
    def take(self, index: np.ndarray) -> SampleBatch:
        """The samples at ``index`` (int array [n], any order, repeats allowed).

        Used to cut a global batch into micro-batches by an allocation.

        Raises:
            DataError: an index is out of range.
        """
        index = np.asarray(index, dtype=np.int64)
        n = len(self)
        if index.size and (index.min() < -n or index.max() >= n):
            raise DataError(f"take: index out of range for a batch of {n} samples")
        index = np.where(index < 0, index + n, index)
        if not self.values:
            return SampleBatch(self.labels[index], self.dense[index], [], [], self.table_names, validate=False)
        # every table at once: [T, n] starts and lengths, one cumsum (per-table numpy calls
        # cost more than the arithmetic at micro-batch sizes)
        table_offsets = np.stack(self.offsets)
        starts = table_offsets[:, index]
        lens = table_offsets[:, index + 1] - starts
        new_off = np.zeros((len(self.values), index.shape[0] + 1), OFFSET_DTYPE)
        np.cumsum(lens, axis=1, out=new_off[:, 1:])
        single = (lens == 1).all(axis=1).tolist()
        values = []
        for t, v in enumerate(self.values):
            if single[t]:
                values.append(v[starts[t]])
            else:
                # Gather each sample's run: position j of the output reads
                # starts[i] + (j - new_off[i]) for the sample i that owns j.
                off = new_off[t]
                owner = np.repeat(np.arange(index.shape[0]), lens[t])
                pos = starts[t][owner] + (np.arange(off[-1]) - off[:-1][owner])
                values.append(v[pos])
        return SampleBatch(
            self.labels[index], self.dense[index], values, list(new_off), self.table_names, validate=False
        )

    def slice(self, start: int, stop: int) -> SampleBatch:
        """Samples ``start:stop`` (views where possible; offsets rebased to 0)."""
        n = len(self)
        start, stop = max(0, min(start, n)), max(0, min(stop, n))
        stop = max(start, stop)
        values, offsets = [], []
        for v, o in zip(self.values, self.offsets):
            base = o[start]
            values.append(v[base : o[stop]])
            offsets.append(o[start : stop + 1] - base)
        return SampleBatch(
            self.labels[start:stop], self.dense[start:stop], values, offsets, self.table_names, validate=False
        )

    @staticmethod
    def concat(batches: Sequence[SampleBatch]) -> SampleBatch:
        """Concatenate batches with the same schema, in order.

        Raises:
            DataError: no batches, or their schemas differ.
        """
        if not batches:
            raise DataError("concat needs at least one batch")
        first = batches[0]
        for b in batches[1:]:
            if b.table_names != first.table_names or b.dense_dim != first.dense_dim:
                raise DataError(f"concat: schema mismatch {first.schema} vs {b.schema}")
        if len(batches) == 1:
            return first
        values, offsets = [], []
        for t in range(first.num_tables):
            values.append(np.concatenate([b.values[t] for b in batches]))
            parts, base = [np.zeros(1, OFFSET_DTYPE)], 0
            for b in batches:
                parts.append(b.offsets[t][1:] + base)
                base += int(b.offsets[t][-1])
            offsets.append(np.concatenate(parts))
        return SampleBatch(
            np.concatenate([b.labels for b in batches]),
            np.concatenate([b.dense for b in batches]),
            values,
            offsets,
            first.table_names,
            validate=False,
        )

    def to_torch(self, device: str | object = "cpu") -> dict:
        """Tensors on ``device``: ``labels`` [B], ``dense`` [B, D] float32 and, per
        table name, ``(values int64 [nnz], offsets int64 [B+1])``.

        Ids are reinterpreted (not converted) as int64, because torch has no uint64
        indexing; the bits are unchanged and ``.view(torch.uint64)``-style
        reinterpretation recovers them. On the CPU the tensors share the batch's
        memory, except arrays that are read-only (Arrow buffers of a Parquet batch),
        which are copied: torch tensors are writable.
        """
        out = {"labels": _tensor(self.labels).to(device), "dense": _tensor(self.dense).to(device)}
        for name, v, o in zip(self.table_names, self.values, self.offsets):
            out[name] = (_tensor(v.view(np.int64)).to(device), _tensor(o).to(device))
        return out

    def pin_memory(self) -> SampleBatch:
        """A copy in page-locked (pinned) host memory, same arrays and dtypes; what
        ``torch.utils.data.DataLoader(pin_memory=True)`` calls on each batch, so that
        later copies to the accelerator can be asynchronous.

        Raises:
            RuntimeError: from torch, when no accelerator is available (DataLoader
                itself turns ``pin_memory`` off then, with a warning).
        """

        def pinned(a: np.ndarray) -> np.ndarray:
            return _tensor(a.view(np.int64) if a.dtype == KEY_DTYPE else a).pin_memory().numpy().view(a.dtype)

        return SampleBatch(
            pinned(self.labels),
            pinned(self.dense),
            [pinned(v) for v in self.values],
            [pinned(o) for o in self.offsets],
            self.table_names,
            validate=False,
        )


def _tensor(a: np.ndarray):
    """A CPU torch tensor over ``a`` (C-contiguous), copied when ``a`` is read-only."""
    import torch

    a = np.ascontiguousarray(a)
    return torch.from_numpy(a if a.flags.writeable else a.copy())

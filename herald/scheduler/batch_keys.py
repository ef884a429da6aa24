"""A global batch's keys as the scheduler's kernels read them: every key looked up (or
inserted) in the snapshots' key map, and the batch as a sample-major CSR of slots.

``(samp_off int64 [B+1], samp_slot int32 [nnz], samp_tab int16 [nnz])``: the keys of
sample ``i`` are the slots ``samp_slot[samp_off[i]:samp_off[i+1]]`` of the tables
``samp_tab[...]``, table-major within the sample (docs/scheduler.md, "Exact semantics").
"""

from __future__ import annotations

import numpy as np

from herald.errors import DataError
from herald.scheduler import keymap_kernels as KM
from herald.scheduler.parallel import ParallelPasses
from herald.scheduler.state import Snapshots

#: most tables whose arrays :func:`sample_csr` passes to the kernels as tuples (else it concatenates)
MAX_TUPLE_TABLES = 64


def sample_csr(batch, snap: Snapshots, par: ParallelPasses | None, feature_tables: np.ndarray | None = None):
    """Key lookup and the sample-major CSR (int64 [B+1], int32 [nnz], int16 [nnz]) of ``batch``.

    ``feature_tables`` (int16 [T], or None: feature t reads table t) is the table of each of
    the batch's features: a key is (table, id), so features sharing a table share its keys
    (NOTE [tables and features] in herald/contracts/features.py); such batches take the
    concatenating path.

    The kernels read the batch's per-table arrays directly (a tuple of arrays) when
    they are all C-contiguous uint64 ids and int64 offsets and there are at most
    :data:`MAX_TUPLE_TABLES` tables (numba compiles one kernel per tuple length, with a
    branch per table at each runtime index); otherwise the ids are concatenated and
    the offsets stacked first (:func:`sample_csr_concat`). Both give the same CSR; with
    ``par`` the lookup and gather run on its threads.

    Raises:
        DataError: key ids that are not uint64.
    """
    values = tuple(batch.values)
    offsets = tuple(batch.offsets)
    B = len(batch)
    nnz = 0
    direct = len(values) <= MAX_TUPLE_TABLES and feature_tables is None
    for v, o in zip(values, offsets):
        nnz += v.shape[0]
        if v.dtype != np.uint64 or o.dtype != np.int64 or not v.flags.c_contiguous or not o.flags.c_contiguous:
            direct = False
    if not direct:
        return sample_csr_concat(batch, snap, feature_tables)
    values, offsets = _same_flags(values), _same_flags(offsets)
    if par is not None:
        return par.lookup_and_gather(snap, values, offsets, B, nnz)
    slots = snap.lookup_tables(values, nnz)
    samp_off = np.empty(B + 1, np.int64)
    samp_slot = np.empty(nnz, np.int32)
    samp_tab = np.empty(nnz, np.int16)
    KM.gather_samples_tables_jit(offsets, slots, samp_off, samp_slot, samp_tab)
    return samp_off, samp_slot, samp_tab


def _same_flags(arrays: tuple) -> tuple:
    """``arrays``, as read-only views when some are writeable and some not: numba types a tuple
    by its arrays' flags too, and one of mixed flags (an Arrow batch's zero-copy columns beside
    copied ones) is a heterogeneous tuple its kernels cannot index at a runtime position."""
    if len({a.flags.writeable for a in arrays}) <= 1:
        return arrays
    views = []
    for a in arrays:
        view = a.view()
        view.flags.writeable = False
        views.append(view)
    return tuple(views)


def sample_csr_concat(batch, snap: Snapshots, feature_tables: np.ndarray | None = None):
    """:func:`sample_csr` for batches whose arrays the kernels cannot take as a tuple, or
    whose features share tables (``feature_tables``).

    Raises:
        DataError: key ids that are not uint64.
    """
    T = batch.num_tables
    nnz = np.array([v.shape[0] for v in batch.values], np.int64)
    ids = np.concatenate(batch.values) if T > 1 else batch.values[0]
    if ids.dtype != np.uint64:
        raise DataError(f"key ids must be uint64, got {ids.dtype}")
    tabs = np.repeat(np.arange(T, dtype=np.int16) if feature_tables is None else feature_tables, nnz)
    slots = snap.lookup(tabs, ids)
    offsets = np.stack(batch.offsets)
    base = np.zeros(T, np.int64)
    np.cumsum(nnz[:-1], out=base[1:])
    B = len(batch)
    samp_off = np.empty(B + 1, np.int64)
    samp_slot = np.empty(slots.shape[0], np.int32)
    samp_tab = np.empty(slots.shape[0], np.int16)
    KM.gather_samples_jit(offsets, base, slots, samp_off, samp_slot, samp_tab)
    if feature_tables is not None:  # the kernel writes each key's feature: its table
        samp_tab = feature_tables[samp_tab]
    return samp_off, samp_slot, samp_tab

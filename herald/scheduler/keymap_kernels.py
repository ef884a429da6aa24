"""Numba kernels of the batch CSR: a global batch's keys, as key-map slots, per sample.

The key map itself (``(table, uint64 id) -> dense slot``, slots in lookup order, also
straight from a batch's per-table id arrays) is the shared one: NOTE [key map] in
:mod:`herald.keymap`, used by :class:`herald.scheduler.state.Snapshots`. Same conventions
as :mod:`herald.scheduler.kernels` (``nogil``, preallocated outputs).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from herald.keymap import find_or_insert_jit, home_jit
from herald.scheduler.kernels import JIT


@nb.njit(**JIT)
def gather_samples_jit(offsets, value_base, slots_flat, out_off, out_slot, out_tab):
    """Sample-major CSR of a batch: sample ``i`` uses ``out_slot[out_off[i]:out_off[i+1]]``.

    Args:
        offsets: int64 [T, B+1] per-table offsets; value_base: int64 [T] start of table t
            in ``slots_flat`` int32 [nnz]. out_off int64 [B+1], out_slot int32 [nnz],
            out_tab int16 [nnz] (written; tables in order within a sample).
    """
    T = offsets.shape[0]
    B = offsets.shape[1] - 1
    out_off[0] = 0
    p = 0
    for i in range(B):
        for t in range(T):
            for j in range(offsets[t, i], offsets[t, i + 1]):
                out_slot[p] = slots_flat[value_base[t] + j]
                out_tab[p] = t
                p += 1
        out_off[i + 1] = p


@nb.njit(**JIT)
def gather_samples_tables_jit(offsets, slots_flat, out_off, out_slot, out_tab):
    """:func:`gather_samples_jit` reading the per-table offsets of a batch directly.

    Args:
        offsets: tuple of T int64 [B+1] arrays; slots_flat: int32 [nnz] table-major.
        out_off int64 [B+1], out_slot int32 [nnz], out_tab int16 [nnz] (written).
    """
    T = len(offsets)
    B = out_off.shape[0] - 1
    out_off[:] = 0
    for t in range(T):  # sample lengths, then their prefix sums
        o = offsets[t]
        for i in range(B):
            out_off[i + 1] += o[i + 1] - o[i]
    for i in range(B):
        out_off[i + 1] += out_off[i]
    cur = out_off[:B].copy()  # next free position of each sample (tables in order)
    base = 0
    for t in range(T):
        o = offsets[t]
        tt = np.int16(t)
        for i in range(B):
            p = cur[i]
            for j in range(o[i], o[i + 1]):
                out_slot[p] = slots_flat[base + j]
                out_tab[p] = tt
                p += 1
            cur[i] = p
        base += o[B]


@nb.njit(**JIT)
def insert_missing_tables_jit(buckets, slot_ids, slot_tab, n_slots, values, slots, start):
    """Second half of the parallel key lookup: the keys of a batch that a read-only
    lookup did not find (``slots[i] == -1``, table-major as in
    :func:`herald.keymap.find_or_insert_tables_jit`) are found or inserted in table-major
    order from position ``start``, so new keys get the slots the serial lookup gives.

    Args:
        buckets, slot_ids, slot_tab (an array): the map; n_slots: int64 [1] (updated).
        values: tuple of T uint64 [nnz_t] arrays; slots: int32 [sum nnz_t] (completed).

    Returns:
        the position reached: ``slots.shape[0]``, or less when a new key found all slots
        in use (grow the key state and call again from there).
    """
    mask = nb.uint64(buckets.shape[0] - 1)
    n = n_slots[0]
    i = 0
    for t in range(len(values)):
        v_t = values[t]
        m = v_t.shape[0]
        if i + m <= start:
            i += m
            continue
        for j in range(max(0, start - i), m):
            p = i + j
            if slots[p] >= 0:
                continue
            v = v_t[j]
            s = find_or_insert_jit(buckets, slot_ids, slot_tab, t, v, home_jit(t, v, mask), n)
            if s < 0:  # all slots in use
                n_slots[0] = n
                return p
            slots[p] = s
            n = max(n, s + 1)  # a new key took slot n
        i += m
    n_slots[0] = n
    return i

"""Numba kernels of the batch CSR: a global batch's keys, as key-map slots, per sample.

The key map itself (``(table, uint64 id) -> dense slot``, slots in lookup order, also
straight from a batch's per-table id arrays) is the shared one: NOTE [key map] in
:mod:`herald.keymap`, used by :class:`herald.scheduler.state.Snapshots`. Same conventions
as :mod:`herald.scheduler.kernels` (``nogil``, preallocated outputs).
"""

from __future__ import annotations

import numba as nb
import numpy as np

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

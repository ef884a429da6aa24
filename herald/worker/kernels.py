"""Numba kernels of the worker: key positions and per-segment unique ids.

The worker cache's (table, id) -> slot map is the shared one (:mod:`herald.keymap`).
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True, nogil=True)
def positions_jit(uniq, bounds, q_tab, q_key, out):
    """out[i] = row of (q_tab[i], q_key[i]) in ``uniq`` (uint64 [u], each table's ids
    sorted, table t at ``uniq[bounds[t]:bounds[t + 1]]``), by binary search.

    Returns the index of the first key that is absent, or -1 when all are present.
    """
    for i in range(q_key.shape[0]):
        t = q_tab[i]
        if t < 0 or t + 1 >= bounds.shape[0]:
            return i
        lo = bounds[t]
        hi = bounds[t + 1]
        k = q_key[i]
        while lo < hi:
            mid = (lo + hi) >> 1
            if uniq[mid] < k:
                lo = mid + 1
            else:
                hi = mid
        if lo == bounds[t + 1] or uniq[lo] != k:
            return i
        out[i] = lo
    return -1


@nb.njit(cache=True, nogil=True)
def segment_unique_jit(values, bounds, uniq, inverse, uniq_bounds):
    """Per segment ``values[bounds[t]:bounds[t + 1]]`` (uint64): its sorted distinct
    values and the inverse index, as ``np.unique(segment, return_inverse=True)`` gives.

    Writes ``uniq`` (uint64 [n], segment t's distinct values at
    ``uniq[uniq_bounds[t]:uniq_bounds[t + 1]]``), ``inverse`` (int64 [n], index into the
    segment's own distinct values) and ``uniq_bounds`` (int64 [T + 1]).
    """
    uniq_bounds[0] = 0
    for t in range(bounds.shape[0] - 1):
        lo = bounds[t]
        hi = bounds[t + 1]
        base = uniq_bounds[t]
        k = -1
        if hi > lo:
            seg = values[lo:hi]
            order = np.argsort(seg, kind="mergesort")
            for j in range(hi - lo):
                v = seg[order[j]]
                if k < 0 or uniq[base + k] != v:
                    k += 1
                    uniq[base + k] = v
                inverse[lo + order[j]] = k
        uniq_bounds[t + 1] = base + k + 1

"""Numba kernels of the worker embedding cache: a (table, id) -> slot map.

Open addressing with linear probing and backward-shift deletion (no tombstones),
so a cache that inserts and evicts every step never degrades. The map has a
fixed power-of-two size, at least twice the cache capacity. Empty buckets have
``tab == -1``.
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True, nogil=True, inline="always")
def _bucket(t, key, mask):
    h = key ^ (nb.uint64(t) * nb.uint64(0x9E3779B97F4A7C15))
    h = (h ^ (h >> nb.uint64(33))) * nb.uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> nb.uint64(33))
    return nb.int64(h & nb.uint64(mask))


@nb.njit(cache=True, nogil=True, inline="always")
def _probe(m_tab, m_key, t, key, mask):
    """Bucket holding (t, key), or the empty bucket where it would go."""
    b = _bucket(t, key, mask)
    while m_tab[b] != -1 and not (m_tab[b] == t and m_key[b] == key):
        b = (b + 1) & mask
    return b


@nb.njit(cache=True, nogil=True)
def map_lookup_jit(m_tab, m_key, m_val, q_tab, q_key, out):
    """out[i] = slot of (q_tab[i], q_key[i]), or -1 when absent."""
    mask = m_tab.shape[0] - 1
    for i in range(q_key.shape[0]):
        b = _probe(m_tab, m_key, q_tab[i], q_key[i], mask)
        out[i] = m_val[b] if m_tab[b] != -1 else -1
    return out


@nb.njit(cache=True, nogil=True)
def map_insert_jit(m_tab, m_key, m_val, q_tab, q_key, q_val):
    """Insert or overwrite; returns the number of keys that were new."""
    mask = m_tab.shape[0] - 1
    new = 0
    for i in range(q_key.shape[0]):
        b = _probe(m_tab, m_key, q_tab[i], q_key[i], mask)
        if m_tab[b] == -1:
            new += 1
        m_tab[b] = q_tab[i]
        m_key[b] = q_key[i]
        m_val[b] = q_val[i]
    return new


@nb.njit(cache=True, nogil=True)
def map_delete_jit(m_tab, m_key, m_val, q_tab, q_key, out):
    """Remove keys; out[i] = the slot it held, or -1 when absent."""
    mask = m_tab.shape[0] - 1
    for i in range(q_key.shape[0]):
        b = _probe(m_tab, m_key, q_tab[i], q_key[i], mask)
        out[i] = -1
        if m_tab[b] == -1:
            continue
        out[i] = m_val[b]
        # backward-shift deletion: pull later members of the cluster into the hole
        hole = b
        j = (b + 1) & mask
        while m_tab[j] != -1:
            home = _bucket(m_tab[j], m_key[j], mask)
            # move j into hole unless its home lies cyclically in (hole, j]
            if (j > hole and (home <= hole or home > j)) or (j < hole and (home <= hole and home > j)):
                m_tab[hole] = m_tab[j]
                m_key[hole] = m_key[j]
                m_val[hole] = m_val[j]
                hole = j
            j = (j + 1) & mask
        m_tab[hole] = -1
    return out


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

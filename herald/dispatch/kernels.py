"""Numba kernels of the dispatcher: micro-batch building and early-pull marking.

Pure functions over preallocated arrays, all ``nogil`` so the
dispatcher's pipeline threads (NOTE [dispatch pipeline] in
:mod:`herald.dispatch.pipeline`) run them in parallel with the scheduler's kernels.
Allocation is in :mod:`herald.dispatch.microbatch` and :mod:`herald.dispatch.pipeline`;
the layout they fill, and its validation, in :mod:`herald.contracts.microbatch`.
"""

from __future__ import annotations

import numba as nb
import numpy as np

JIT = dict(nogil=True, cache=True)

#: multiplier of the (table, id) hash of NOTE [early pulls]: ``id ^ (table * KEY_MIX)``
KEY_MIX = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)


# ----------------------------------------------------------------------------- micro-batches
@nb.njit(**JIT)
def count_rank_nnz_jit(order, wstart, offsets, out_nnz):
    """Ids of each table in each rank's samples.

    Args:
        order: int64 [M] rows of the global batch (in ``[0, B)``), rank w's are
            ``order[wstart[w]:wstart[w + 1]]``; wstart: int64 [W+1].
        offsets: int64 [T, B+1], table t's offsets.
        out_nnz: int64 [W, T] (written).
    """
    W = wstart.shape[0] - 1
    T = offsets.shape[0]
    for w in range(W):
        for t in range(T):
            n = 0
            for q in range(wstart[w], wstart[w + 1]):
                i = order[q]
                n += offsets[t, i + 1] - offsets[t, i]
            out_nnz[w, t] = n


@nb.njit(**JIT)
def _probe_jit(keys, used, v, mask):
    """Slot of ``v`` in an open-addressing table (its own, or the empty one where it goes)."""
    h = np.int64((v * KEY_MIX) >> np.uint64(32)) & mask
    while used[h] and keys[h] != v:
        h = (h + 1) & mask
    return h


@nb.njit(**JIT)
def segment_unique_jit(seg, n, out_uniq, ubase, out_inv, ibase, keys, local, used, rank):
    """Sorted distinct values of ``seg[:n]`` (uint64) into ``out_uniq[ubase:ubase + u]``
    and each value's index among them into ``out_inv[ibase:ibase + n]``, as
    ``np.unique(seg[:n], return_inverse=True)``; returns u.

    A hash table (``keys`` uint64, ``local`` int32, ``used`` bool, each [C], C a power
    of two >= 2n; ``rank`` int32 [>= n]: scratch) numbers the distinct values in
    order of appearance; only those are sorted, then renumbered by rank.
    """
    cap = 16
    while cap < 2 * n:
        cap <<= 1
    mask = cap - 1
    used[:cap] = False
    u = 0
    for j in range(n):
        v = seg[j]
        h = _probe_jit(keys, used, v, mask)
        if not used[h]:
            used[h] = True
            keys[h] = v
            local[h] = u
            out_uniq[ubase + u] = v
            u += 1
        out_inv[ibase + j] = local[h]
    out_uniq[ubase : ubase + u].sort()
    for k in range(u):
        rank[local[_probe_jit(keys, used, out_uniq[ubase + k], mask)]] = k
    for j in range(n):
        out_inv[ibase + j] = rank[out_inv[ibase + j]]
    return u


@nb.njit(**JIT)
def build_ranks_jit(order, wstart, values, vbounds, offsets, rank_nnz, out_inv, out_uniq, out_offsets, out_ubounds):
    """Every rank's micro-batch ids: per table its sorted distinct ids and the inverse
    index (``np.unique(ids, return_inverse=True)`` per (rank, table)), and its offsets.

    Args:
        order, wstart: as :func:`count_rank_nnz_jit`.
        values: uint64 [nnz] every table's ids, table after table; table t's are
            ``values[vbounds[t]:vbounds[t + 1]]`` (vbounds int64 [T+1]) indexed by ``offsets[t]``.
        offsets: int64 [T, B+1]; rank_nnz: int64 [W, T] from :func:`count_rank_nnz_jit`.
        out_inv: int32 [N], N = rank_nnz.sum() (written): rank w's region starts at
            ``base_w = rank_nnz[:w].sum()``; table t's inverse at ``base_w + rank_nnz[w, :t].sum()``,
            each an index into that table's distinct ids.
        out_uniq: uint64 [N] (written): rank w's distinct ids at ``base_w + out_ubounds[w, t]``
            to ``base_w + out_ubounds[w, t + 1]``, table after table.
        out_offsets: int64 [T * (M + W)] (written): rank w's offsets, int64 [T, b_w + 1] row
            major, start at ``T * (wstart[w] + w)``.
        out_ubounds: int64 [W, T+1] (written), relative to ``base_w``.
    """
    W = wstart.shape[0] - 1
    T = offsets.shape[0]
    maxn = 0
    for w in range(W):
        for t in range(T):
            maxn = max(maxn, rank_nnz[w, t])
    cap = 16
    while cap < 2 * maxn:
        cap <<= 1
    seg = np.empty(maxn, np.uint64)
    keys = np.empty(cap, np.uint64)
    local = np.empty(cap, np.int32)
    used = np.empty(cap, np.bool_)
    rank = np.empty(maxn, np.int32)
    base = 0
    for w in range(W):
        lo = wstart[w]
        b = wstart[w + 1] - lo
        orow = T * (lo + w)
        n_before = 0
        ub = 0
        out_ubounds[w, 0] = 0
        for t in range(T):
            vb = vbounds[t]
            out_offsets[orow] = 0
            n = 0
            for k in range(b):
                i = order[lo + k]
                for p in range(offsets[t, i], offsets[t, i + 1]):
                    seg[n] = values[vb + p]
                    n += 1
                out_offsets[orow + k + 1] = n
            orow += b + 1
            if n > 0:
                ub += segment_unique_jit(seg, n, out_uniq, base + ub, out_inv, base + n_before, keys, local, used, rank)
            out_ubounds[w, t + 1] = ub
            n_before += n
        base += n_before


# ----------------------------------------------------------------------------- early pulls
@nb.njit(**JIT)
def _slot_jit(h, mask):
    z = (h ^ (h >> np.uint64(31))) * _M1
    return np.int64((z ^ (z >> np.uint64(29))) & mask)


@nb.njit(**JIT)
def touched_set_jit(table, ids, keep, out_set, out_has_zero):
    """Hash set of ``id ^ (table * KEY_MIX)`` over the keys with ``keep`` (NOTE [early pulls]).

    Args:
        table: int32 [n]; ids: uint64 [n]; keep: bool [n].
        out_set: uint64 [C] zeros on entry, C a power of two > the kept keys (written;
            0 marks an empty slot); out_has_zero: bool [1] (written: hash 0 is in the set).
    """
    mask = np.uint64(out_set.shape[0] - 1)
    out_has_zero[0] = False
    for i in range(ids.shape[0]):
        if not keep[i]:
            continue
        h = ids[i] ^ (np.uint64(table[i]) * KEY_MIX)
        if h == 0:
            out_has_zero[0] = True
            continue
        s = _slot_jit(h, mask)
        while out_set[s] != 0 and out_set[s] != h:
            s = (s + 1) & np.int64(mask)
        out_set[s] = h


@nb.njit(**JIT)
def not_touched_jit(table, ids, touched_set, has_zero, out_early):
    """``out_early[i]`` (bool [n], written): key i's hash is not in ``touched_set``
    (built by :func:`touched_set_jit`)."""
    mask = np.uint64(touched_set.shape[0] - 1)
    for i in range(ids.shape[0]):
        h = ids[i] ^ (np.uint64(table[i]) * KEY_MIX)
        if h == 0:
            out_early[i] = not has_zero[0]
            continue
        s = _slot_jit(h, mask)
        found = False
        while touched_set[s] != 0:
            if touched_set[s] == h:
                found = True
                break
            s = (s + 1) & np.int64(mask)
        out_early[i] = not found

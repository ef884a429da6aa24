"""Numba kernels of the worker: key positions, per-segment unique ids, and the cache's
hot path (NOTE [fused bag kernels]: pooled lookup, its backward, the prefetching
sparse-optimizer loop).

The worker cache's (table, id) -> slot map is the shared one (:mod:`herald.keymap`).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from herald.keymap import prefetch_jit
from herald.ps import kernels as ps_kernels

_AHEAD = 16  # values / rows ahead whose row is prefetched (random rows of the slot array)

#: The PS's optimizer step (:func:`herald.ps.kernels.apply_row_jit`), the same Python source
#: inlined into :func:`apply_rows_at_jit` at numba's IR level, so each optimizer gets its own
#: row loop; the arithmetic is that function's, bit for bit (tests/worker/test_cache.py).
#: As for every cached kernel calling another file's: after editing ``apply_row_jit``,
#: numba's cache of this module is stale until this file changes (clear ``__pycache__``).
apply_row_inline_jit = nb.njit(nogil=True, inline="always")(ps_kernels.apply_row_jit.py_func)


@nb.njit(cache=True, nogil=True)
def pairs_sorted_jit(table, ids):
    """Whether (table int32 [n], ids uint64 [n]) is sorted by table, then id (ties allowed)."""
    for i in range(1, table.shape[0]):
        if table[i] < table[i - 1] or (table[i] == table[i - 1] and ids[i] < ids[i - 1]):
            return False
    return True


@nb.njit(cache=True, nogil=True)
def member_jit(k_table, k_ids, o_table, o_ids, out):
    """out[i] = whether (k_table[i], k_ids[i]) is one of the pairs (o_table, o_ids), which
    are sorted by table, then id (:func:`pairs_sorted_jit`); binary search, ids compared whole."""
    m = o_table.shape[0]
    for i in range(k_table.shape[0]):
        t, x = k_table[i], k_ids[i]
        lo, hi = 0, m
        while lo < hi:
            mid = (lo + hi) >> 1
            if o_table[mid] < t or (o_table[mid] == t and o_ids[mid] < x):
                lo = mid + 1
            else:
                hi = mid
        out[i] = lo < m and o_table[lo] == t and o_ids[lo] == x


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


# ------------------------------------------------------------------ pooled lookup and its gradient
#
# NOTE [fused bag kernels]. The sum-pooled lookup of a micro-batch straight from the cache
# slots, and its backward (each distinct row's summed gradient), without the gather copy,
# the index arrays and the autograd nodes of ``F.embedding_bag``. Layout as a MicroBatch
# holds it (NOTE [micro-batch layout]): table t's distinct ids are rows
# ``id_bounds[t]:id_bounds[t + 1]`` of ``slots``; its values are ``inverse[inverse_bounds[t] +
# j]`` (an index into those), bag b is ``j in offsets[t, b]:offsets[t, b + 1]``.
# Forward: a bag's sum starts at 0 and adds its rows in order, as ``F.embedding_bag(mode=
# "sum")`` does on the CPU: bit-identical. Backward: a row's gradient starts at 0 and adds
# its bags' gradients in (table, bag, position) order, then is divided by the worker count;
# torch's dense backward adds the same float32 terms in the order of an unstable sort of the
# values (observed: any micro-batch of more than 16 values), so rows used once are
# bit-identical and rows used k times agree within the rounding of a k-term sum. Neither
# order is the single-process reference's (it pools table by table), so the exactness
# tolerance covers both (tests/worker/test_kernels.py, test_cache.py).


@nb.njit(cache=True, nogil=True, inline="always")
def prefetch_row_jit(a, i):
    """Prefetch row ``a[i]`` of a 2-d C-contiguous array: every 64-byte line of it."""
    r = a[i]
    for d in range(0, r.shape[0], 16):
        prefetch_jit(r, d)
    prefetch_jit(r, r.shape[0] - 1)


@nb.njit(cache=True, nogil=True)
def take_rows_jit(src, slots, ncols):
    """float32 [n, ncols]: ``src[slots, :ncols]`` (slots int64 [n], each in range), about 3x
    faster than numpy's fancy indexing of a column slice, which copies row by row."""
    out = np.empty((slots.shape[0], ncols), src.dtype)
    for i in range(slots.shape[0]):
        row = src[slots[i]]
        for j in range(ncols):
            out[i, j] = row[j]
    return out


@nb.njit(cache=True, nogil=True)
def pooled_sum_jit(rows, slots, id_bounds, inverse, inverse_bounds, offsets, out):
    """``out[b, t, :] = sum_j rows[slots[id_bounds[t] + inverse[inverse_bounds[t] + j]], :dim]``
    over bag (t, b), ``dim = out.shape[2]``: NOTE [fused bag kernels].

    rows float32 [C, W >= dim]; slots int64 [U]; id_bounds, inverse_bounds int64 [T + 1];
    inverse uint16 or int32 [N]; offsets int64 [T, B + 1]; out float32 [B, T, dim]
    (shapes and dtypes checked by the caller).

    Returns -1, or the first table whose bounds, offsets, values or slots are out of range
    (checked on the way, so the caller needs no O(N) pass; ``out`` is then partly written).
    """
    dim = out.shape[2]
    nb_ = offsets.shape[1] - 1
    if id_bounds[0] != 0 or inverse_bounds[0] != 0:
        return 0
    for t in range(offsets.shape[0]):
        base = id_bounds[t]
        nu = id_bounds[t + 1] - base
        ib = inverse_bounds[t]
        n = inverse_bounds[t + 1] - ib
        if (
            nu < 0
            or id_bounds[t + 1] > slots.shape[0]
            or offsets[t, 0] != 0
            or offsets[t, nb_] != n
            or inverse_bounds[t + 1] > inverse.shape[0]
        ):
            return t
        for j in range(min(_AHEAD, n)):
            v = nb.int64(inverse[ib + j])
            if 0 <= v < nu and 0 <= slots[base + v] < rows.shape[0]:
                prefetch_row_jit(rows, slots[base + v])
        for b in range(nb_):
            o = out[b, t]
            for d in range(dim):
                o[d] = np.float32(0.0)
            lo = offsets[t, b]
            hi = offsets[t, b + 1]
            if hi < lo:
                return t
            for j in range(lo, hi):
                if j + _AHEAD < n:
                    a = nb.int64(inverse[ib + j + _AHEAD])
                    if 0 <= a < nu and 0 <= slots[base + a] < rows.shape[0]:
                        prefetch_row_jit(rows, slots[base + a])
                v = nb.int64(inverse[ib + j])
                if v < 0 or v >= nu:
                    return t
                s = slots[base + v]
                if s < 0 or s >= rows.shape[0]:
                    return t
                r = rows[s]
                for d in range(dim):
                    o[d] += r[d]
    return -1


@nb.njit(cache=True, nogil=True)
def bag_grads_jit(grad_out, id_bounds, inverse, inverse_bounds, offsets, divisor, out):
    """``out[u] = (sum of grad_out[b, t] over the values of row u) / divisor``: the
    backward of :func:`pooled_sum_jit`, NOTE [fused bag kernels]; the layout as it was
    checked there.

    grad_out float32 [B, T, dim] C-contiguous; out float32 [U, dim]; divisor float32 (the
    executor's worker count; 1 divides nothing). Rows no value uses get 0.
    """
    dim = out.shape[1]
    for u in range(out.shape[0]):
        for d in range(dim):
            out[u, d] = np.float32(0.0)
    for t in range(offsets.shape[0]):
        base = id_bounds[t]
        ib = inverse_bounds[t]
        n = inverse_bounds[t + 1] - ib
        for b in range(offsets.shape[1] - 1):
            g = grad_out[b, t]
            for j in range(offsets[t, b], offsets[t, b + 1]):
                if j + _AHEAD < n:
                    prefetch_row_jit(out, base + inverse[ib + j + _AHEAD])
                o = out[base + inverse[ib + j]]
                for d in range(dim):
                    o[d] += g[d]
    if divisor != np.float32(1.0):
        for u in range(out.shape[0]):
            for d in range(dim):
                out[u, d] = out[u, d] / divisor
    return out


@nb.njit(cache=True, nogil=True, inline="always")
def _apply_rows_loop_jit(rows, slots, grads, grad_rows, kind, dim, hp):
    n = slots.shape[0]
    for i in range(min(_AHEAD, n)):
        prefetch_row_jit(rows, slots[i])
    for i in range(n):
        if i + _AHEAD < n:
            prefetch_row_jit(rows, slots[i + _AHEAD])
            prefetch_row_jit(grads, grad_rows[i + _AHEAD])
        apply_row_inline_jit(rows[slots[i]], grads[grad_rows[i]], kind, dim, hp)


@nb.njit(cache=True, nogil=True)
def apply_rows_at_jit(rows, slots, grads, grad_rows, kind, dim, hp):
    """:func:`herald.ps.kernels.apply_rows_at_jit` (the PS's ``apply_row_jit`` on
    ``rows[slots[i]]`` with ``grads[grad_rows[i]]``, in place: bit-identical), faster: the
    row step inlined (:data:`apply_row_inline_jit`) into one loop per optimizer, where
    ``kind`` is a constant (LLVM drops the other optimizers' code from the loop: 3-4x
    fewer ns per row), and the rows ``_AHEAD`` updates ahead prefetched (the slots are
    random rows of the cache)."""
    if kind == 0:
        _apply_rows_loop_jit(rows, slots, grads, grad_rows, 0, dim, hp)
    elif kind == 1:
        _apply_rows_loop_jit(rows, slots, grads, grad_rows, 1, dim, hp)
    elif kind == 2:
        _apply_rows_loop_jit(rows, slots, grads, grad_rows, 2, dim, hp)
    else:
        _apply_rows_loop_jit(rows, slots, grads, grad_rows, 3, dim, hp)

"""Numba kernels of the parameter server (and of the worker cache, which reuses them).

Pure functions over preallocated arrays; the Python around them validates, allocates
and grows arrays. Nothing here is fastmath: the same kernel gives bit-identical results
in every process (NOTE [ps exactness] in docs/ps.md).

The key -> row map of a table is the shared one (NOTE [key map] in :mod:`herald.keymap`;
Persia §4.2.2 keeps rows in an array list, the map indexes it): buckets hold row slots,
``row_keys[slot]`` holds the key, one map per table. The pending-step map of the
aggregation (below) keeps its keys in its own buckets (``pk``/``pi``).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from herald.keymap import key_hash_jit
from herald.hashing import splitmix64_jit as mix64_jit# the splitmix64 finaliser

SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM = 0, 1, 2, 3
INIT_UNIFORM, INIT_NORMAL, INIT_ZEROS = 0, 1, 2


@nb.njit(cache=True, nogil=True)
def shard_of_jit(table_salt, keys, num_shards, out):
    """``out[i] = mix64(keys[i] ^ table_salt) mod num_shards`` (Persia §4.2.3 uniform sharding)."""
    n = nb.uint64(num_shards)
    for i in range(keys.shape[0]):
        out[i] = nb.int64(mix64_jit(nb.uint64(keys[i]) ^ table_salt) % n)
    return out


@nb.njit(cache=True, nogil=True)
def init_row_jit(row, key, table_seed, dim, init_kind, scale, state_kind, init_acc):
    """Initialise one row from (table_seed, key): embedding by ``init_kind``, then state.

    Element ``j`` draws ``x = mix64(mix64(table_seed ^ key) + j * golden)``; its top 24
    bits give ``u`` in [0, 1) (uniform: ``(2u - 1) * scale``), and for normal a second
    24-bit field gives Box-Muller's angle.
    """
    h = mix64_jit(table_seed ^ nb.uint64(key))
    inv = 1.0 / 16777216.0
    for j in range(dim):
        if init_kind == 2:
            row[j] = np.float32(0.0)
            continue
        x = mix64_jit(h + nb.uint64(j) * nb.uint64(0x9E3779B97F4A7C15))
        u = np.float64(x >> nb.uint64(40)) * inv
        if init_kind == 0:
            row[j] = np.float32((2.0 * u - 1.0) * scale)
        else:
            u1 = u + inv  # (0, 1]
            u2 = np.float64((x >> nb.uint64(16)) & nb.uint64(0xFFFFFF)) * inv
            row[j] = np.float32(np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2) * scale)
    acc = np.float32(init_acc) if (state_kind == 1 or state_kind == 2) else np.float32(0.0)
    for j in range(dim, row.shape[0]):
        row[j] = acc


@nb.njit(cache=True, nogil=True)
def init_rows_jit(rows, keys, table_seed, dim, init_kind, scale, state_kind, init_acc):
    for i in range(keys.shape[0]):
        init_row_jit(rows[i], keys[i], table_seed, dim, init_kind, scale, state_kind, init_acc)
    return rows


@nb.njit(cache=True, nogil=True)
def apply_row_jit(row, g, kind, dim, hp):
    """Apply one sparse-optimizer step to ``row`` (float32 [row_width]) with gradient ``g``.

    ``hp`` float32 [5] = (lr, eps, beta1, beta2, weight_decay). Arithmetic in float32,
    as torch.optim does on float32 tensors; Adam's bias corrections in float64 (as torch
    computes them on Python floats) then rounded to float32.
    """
    lr = hp[0]
    eps = hp[1]
    wd = hp[4]
    if kind == 0:
        if wd == 0:  # the branch outside the loop lets LLVM vectorise it (same arithmetic)
            for j in range(dim):
                row[j] = row[j] - lr * g[j]
        else:
            for j in range(dim):
                row[j] = row[j] - lr * (g[j] + wd * row[j])
    elif kind == 1:
        for j in range(dim):
            gj = g[j]
            if wd != 0:
                gj = gj + wd * row[j]
            s = row[dim + j] + gj * gj
            row[dim + j] = s
            row[j] = row[j] - lr * gj / (np.sqrt(s) + eps)
    elif kind == 2:
        acc = np.float32(0.0)
        for j in range(dim):
            gj = g[j]
            if wd != 0:
                gj = gj + wd * row[j]
            acc += gj * gj
        s = row[dim] + acc / np.float32(dim)
        row[dim] = s
        denom = np.sqrt(s) + eps
        for j in range(dim):
            gj = g[j]
            if wd != 0:
                gj = gj + wd * row[j]
            row[j] = row[j] - lr * gj / denom
    else:
        b1 = hp[2]
        b2 = hp[3]
        one = np.float32(1.0)
        t = row[3 * dim] + one
        row[3 * dim] = t
        tt = np.float64(t)
        bc1 = 1.0 - np.float64(b1) ** tt
        bc2 = 1.0 - np.float64(b2) ** tt
        step_size = np.float32(np.float64(lr) / bc1)
        bc2_sqrt = np.float32(np.sqrt(bc2))
        for j in range(dim):
            gj = g[j]
            if wd != 0:
                gj = gj + wd * row[j]
            m = row[dim + j]
            m = m + (one - b1) * (gj - m)
            v = row[2 * dim + j] * b2 + (one - b2) * gj * gj
            row[dim + j] = m
            row[2 * dim + j] = v
            row[j] = row[j] - step_size * m / (np.sqrt(v) / bc2_sqrt + eps)


@nb.njit(cache=True, nogil=True)
def apply_rows_jit(rows, grads, kind, dim, hp):
    """``apply_row_jit`` on each ``rows[i]`` with ``grads[i]``."""
    for i in range(rows.shape[0]):
        apply_row_jit(rows[i], grads[i], kind, dim, hp)


@nb.njit(cache=True, nogil=True)
def apply_rows_at_jit(rows, slots, grads, grad_rows, kind, dim, hp):
    """``apply_row_jit`` on ``rows[slots[i]]`` with ``grads[grad_rows[i]]``, in place: the
    same arithmetic as :func:`apply_rows_jit` without gathering the rows."""
    for i in range(slots.shape[0]):
        apply_row_jit(rows[slots[i]], grads[grad_rows[i]], kind, dim, hp)


# ----------------------------------------------------------------------------- pending-step map
#
# Not herald.keymap: PendingStep (herald/ps/aggregate.py) allocates this map with its keys in
# the buckets (``pk uint64 [hcap]`` beside ``pi int64 [hcap]``, -1 = empty); moving it onto the
# shared map (buckets -> p, key in ``p_key[p]``) needs aggregate.py to drop ``pk``. Same mixer.


@nb.njit(cache=True, nogil=True)
def ht_probe_jit(ht_keys, ht_slots, key):
    """Position of ``key`` in the map, or of the empty bucket where it would go."""
    mask = nb.uint64(ht_keys.shape[0] - 1)
    h = key_hash_jit(0, key) & mask
    while True:
        if ht_slots[h] < 0 or ht_keys[h] == key:
            return h
        h = (h + nb.uint64(1)) & mask


@nb.njit(cache=True, nogil=True)
def ht_rebuild_jit(ht_keys, ht_slots, row_keys, n_rows):
    """Fill an empty map (``ht_slots`` all -1) with ``row_keys[:n_rows]`` -> slot."""
    for s in range(n_rows):
        h = ht_probe_jit(ht_keys, ht_slots, row_keys[s])
        ht_keys[h] = row_keys[s]
        ht_slots[h] = s


@nb.njit(cache=True, nogil=True)
def gather_jit(rows, slots, out):
    """``out[i, :] = rows[slots[i], :]`` (out float32 [n, row_width])."""
    w = rows.shape[1]
    for i in range(slots.shape[0]):
        src = rows[slots[i]]
        dst = out[i]
        for j in range(w):
            dst[j] = src[j]
    return out


@nb.njit(cache=True, nogil=True)
def scatter_jit(rows, slots, src):
    """``rows[slots[i], :] = src[i, :]``."""
    w = rows.shape[1]
    for i in range(slots.shape[0]):
        dst = rows[slots[i]]
        s = src[i]
        for j in range(w):
            dst[j] = s[j]


@nb.njit(cache=True, nogil=True)
def count_marked_jit(marks, slots):
    """Number of ``i`` with ``marks[slots[i]] > 0`` (pulls of rows with open aggregations)."""
    c = 0
    for i in range(slots.shape[0]):
        if marks[slots[i]] > 0:
            c += 1
    return c


@nb.njit(cache=True, nogil=True)
def first_duplicate_jit(stamps, stamp, slots):
    """Stamp ``stamps[slots[i]] = stamp``; return the first ``i`` whose slot was already
    stamped by this call (a duplicate key), or -1."""
    for i in range(slots.shape[0]):
        if stamps[slots[i]] == stamp:
            return i
        stamps[slots[i]] = stamp
    return -1


@nb.njit(cache=True, nogil=True)
def first_nonfinite_row_jit(a):
    """The first row of the float32 [n, d] array ``a`` holding a NaN or an infinity, or -1."""
    for i in range(a.shape[0]):
        r = a[i]
        for j in range(r.shape[0]):
            if not np.isfinite(r[j]):
                return i
    return -1


# ----------------------------------------------------------------------------- aggregation
#
# One pending step (NOTE [ps aggregation] in herald/ps/aggregate.py):
#   map  pk uint64 [hcap], pi int64 [hcap]           key -> pending index p (-1 empty)
#   per p: p_slot int64, p_expected int32, p_arrived int32, p_head int64 (entry list)
#   per entry e: e_rank int32, e_next int64, e_grad float32 [dim]
#   cnt int64 [3] = (number of p, number of entries, number of open p)


@nb.njit(cache=True, nogil=True)
def check_push_grad_jit(pk, pi, p_expected, p_arrived, p_head, e_rank, e_next,
                        keys, contributors, rank):
    """Validate a gradient push against one step's pending state without changing it.

    Returns (code, i): code 0 ok; 1 contributors[i] == 0; 2 contributors differ from an
    earlier contribution to the same (key, step); 3 (key, step) already complete; 4 this
    rank already contributed to (key, step).
    """
    for i in range(keys.shape[0]):
        c = np.int64(contributors[i])
        if c == 0:
            return 1, i
        h = ht_probe_jit(pk, pi, nb.uint64(keys[i]))
        p = pi[h]
        if p < 0:
            continue
        if p_expected[p] != c:
            return 2, i
        if p_arrived[p] >= p_expected[p]:
            return 3, i
        e = p_head[p]
        while e >= 0:
            if e_rank[e] == rank:
                return 4, i
            e = e_next[e]
    return 0, -1


@nb.njit(cache=True, nogil=True)
def push_grad_jit(rows, row_marks, slots, keys, grads, contributors, rank,
                  pk, pi, p_key, p_slot, p_expected, p_arrived, p_head,
                  e_rank, e_next, e_grad, cnt, kind, dim, hp):
    """Record one contributor's gradients for one step; apply the optimizer to every
    (key, step) whose last contributor this is.

    A key with ``contributors[i] == 1`` and no pending state is applied at once. Others
    are kept until ``contributors[i]`` ranks have arrived, then summed in increasing rank
    order (``0 + g_r0 + g_r1 + ...`` in float32, so the result does not depend on the
    arrival order) and applied once. The caller validated with :func:`check_push_grad_jit`
    and guarantees room for ``len(keys)`` new pending indices and entries.
    Returns the number of rows updated.
    """
    applied = 0
    for i in range(keys.shape[0]):
        c = np.int32(contributors[i])
        key = nb.uint64(keys[i])
        s = slots[i]
        h = ht_probe_jit(pk, pi, key)
        p = pi[h]
        if p < 0 and c == 1:
            apply_row_jit(rows[s], grads[i], kind, dim, hp)
            applied += 1
            continue
        if p < 0:
            p = cnt[0]
            cnt[0] += 1
            cnt[2] += 1
            pk[h] = key
            pi[h] = p
            p_key[p] = key
            p_slot[p] = s
            p_expected[p] = c
            p_arrived[p] = 0
            p_head[p] = -1
            row_marks[s] += 1
        e = cnt[1]
        cnt[1] += 1
        e_rank[e] = rank
        e_next[e] = p_head[p]
        p_head[p] = e
        ge = e_grad[e]
        gi = grads[i]
        for j in range(dim):
            ge[j] = gi[j]
        p_arrived[p] += 1
        if p_arrived[p] == p_expected[p]:
            n = p_arrived[p]
            ids = np.empty(n, np.int64)
            rk = np.empty(n, np.int64)
            e = p_head[p]
            k = 0
            while e >= 0:
                ids[k] = e
                rk[k] = e_rank[e]
                k += 1
                e = e_next[e]
            order = np.argsort(rk)
            acc = np.zeros(dim, np.float32)
            for k in range(n):
                src = e_grad[ids[order[k]]]
                for j in range(dim):
                    acc[j] += src[j]
            apply_row_jit(rows[s], acc, kind, dim, hp)
            applied += 1
            row_marks[s] -= 1
            cnt[2] -= 1
    return applied


@nb.njit(cache=True, nogil=True)
def copy_rows_jit(dst, src, n):
    """``dst[:n] = src[:n]`` for 2-d float32 arrays (used when a table grows)."""
    for i in range(n):
        d = dst[i]
        s = src[i]
        for j in range(s.shape[0]):
            d[j] = s[j]

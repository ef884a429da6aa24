"""Row kernels: sharding a key, initialising, updating, checking and copying rows.

Pure functions over preallocated arrays, shared by the shards and the worker cache (the
worker's own kernels reuse :func:`apply_row_jit`: bit-identical rows). Nothing here is
fastmath: the same kernel gives bit-identical results in every process (NOTE [ps
exactness] in docs/ps.md).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from herald.hashing import splitmix64_jit as mix64_jit  # the splitmix64 finaliser

SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM = 0, 1, 2, 3
INIT_UNIFORM, INIT_NORMAL, INIT_ZEROS = 0, 1, 2
#: the codes :func:`finite_rows_jit` returns (the flat kernels' codes: herald/ps/kernels/directory.py)
OK, NONFINITE = 0, 16


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
    """One sparse-optimizer step on ``row`` (float32 [row_width]) with gradient ``g``; ``hp``
    float32 [5] = (lr, eps, beta1, beta2, weight_decay). Arithmetic in float32, as torch.optim
    on float32 tensors; Adam's bias corrections in float64 (torch: Python floats), rounded."""
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


@nb.njit(cache=True, nogil=True)
def copy_rows_jit(dst, src, n):
    """``dst[:n] = src[:n]`` for 2-d float32 arrays (used when a table grows)."""
    for i in range(n):
        d = dst[i]
        s = src[i]
        for j in range(s.shape[0]):
            d[j] = s[j]


@nb.njit(cache=True, nogil=True)
def put_rows_jit(dst, pos, src):
    """``dst[pos[i]] = src[i]`` for 2-d float32 arrays, ``pos`` int64 [n] or None (``dst[i] =
    src[i]``), shapes checked by the caller (:func:`herald.ps.wire.put_rows`): numpy's
    ``dst[pos] = src`` copies small rows one by one (66 against ~10 us, 2,500 rows of 17)."""
    for i in range(src.shape[0]):
        d = dst[i] if pos is None else dst[pos[i]]
        s = src[i]
        for j in range(s.shape[0]):
            d[j] = s[j]


@nb.njit(cache=True, nogil=True)
def shard_order_jit(salts, tables, keys, num_shards, num_tables, order, starts):
    """Group keys by owning shard (``mix64(key ^ salts[table]) mod S``), each shard's by
    table: ``order[starts[s]:starts[s + 1]]`` are the positions of shard s's keys, table
    after table, each table's ascending (a counting sort). Returns whether ``order`` is
    ``0, 1, ..., n - 1`` (the keys were grouped so already)."""
    n = nb.uint64(num_shards)
    m = keys.shape[0]
    group = np.empty(m, np.int64)
    fill = np.zeros(num_shards * num_tables + 1, np.int64)
    for i in range(m):
        t = nb.int64(tables[i])
        g = nb.int64(mix64_jit(nb.uint64(keys[i]) ^ salts[t]) % n) * num_tables + t
        group[i] = g
        fill[g + 1] += 1
    for g in range(num_shards * num_tables):
        fill[g + 1] += fill[g]
    for s in range(num_shards + 1):
        starts[s] = fill[s * num_tables]
    same = True
    for i in range(m):
        g = group[i]
        at = fill[g]
        order[at] = i
        fill[g] = at + 1
        if at != i:
            same = False
    return same


_EXPONENT = np.uint32(0x7F800000)  # float32 exponent bits: all set = NaN or infinity


@nb.njit(cache=True, nogil=True)
def finite_rows_jit(a):
    """``(NONFINITE, i)`` for the first row i of ``a`` (float32 [n, w]) holding a NaN or an
    infinity, else ``(OK, -1)``. The one check of every float32 payload a shard stores:
    gradients (``grad_inputs_check_jit``) and rows (``flat_push_rows_jit``), run
    before anything is changed (NOTE [ps limits]). A float32 is NaN or infinite when its
    8 exponent bits are all set; or-ing that test over a row is a loop LLVM vectorises
    (3x ``np.isfinite`` per element on 128-wide rows)."""
    u = a.view(np.uint32)
    for i in range(u.shape[0]):
        r = u[i]
        bad = nb.uint32(0)
        for j in range(r.shape[0]):
            bad |= nb.uint32((r[j] & _EXPONENT) == _EXPONENT)
        if bad:
            return NONFINITE, i
    return OK, -1

"""Numba kernels of the parameter server (and of the worker cache, which reuses them).

Pure functions over preallocated arrays; the Python around them validates, allocates
and grows arrays. Nothing here is fastmath: the same kernel gives bit-identical results
in every process (NOTE [ps exactness] in docs/ps.md).

The key -> row map of a table is the shared one (NOTE [key map] in :mod:`herald.keymap`;
Persia §4.2.2 keeps rows in an array list, the map indexes it): buckets hold row slots,
``row_keys[slot]`` holds the key, one map per table. A shard serves every table of a
request in one call of the flat kernels (NOTE [table directory] below); the pending
aggregations of a step are one map of (table, key) over all tables ("flat aggregation").
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from herald.hashing import splitmix64_jit as mix64_jit  # the splitmix64 finaliser
from herald.keymap import AHEAD1, AHEAD2, RING, find_or_insert_jit, home_jit, prefetch_jit, probe_jit

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


# ----------------------------------------------------------------------------- table directory
#
# NOTE [table directory]
# ~~~~~~~~~~~~~~~~~~~~~~
# The flat kernels below serve keys of every table of a shard in one call (NOTE [ps wire
# protocol], flat parts). Each table keeps its own arrays (herald/ps/table.py); the kernels
# reach them through the shard's directory (:class:`herald.ps.store.TableSet`): ``d`` int64
# [T, D_COLS], one row per table holding the data addresses of its arrays (``D_ROWS`` ..
# ``D_CLOCKS``), their sizes, its row count (``D_NROWS``, the one copy of it: the kernels
# insert rows and update it) and its settings (dim, width, initialiser, optimizer, LRU bound).
# A kernel rebuilds a table's arrays from its row (:func:`dir_rows` ...: ``numba.carray`` on
# the address, no copy) when the table of the next key differs from the last one's, so keys
# grouped by table cost one switch per group. Invariant: every address names an array the
# table holds, and the table rewrites its row (``TableSet.publish``) whenever it replaces an
# array, before any kernel runs again (single-threaded shard). Typed lists of the arrays would
# cost ~1.2 us of unboxing per list per call, seven lists per call; the directory is two
# plain arrays.

D_ROWS, D_KEYS, D_BUCKETS, D_MARKS, D_STAMPS, D_USED, D_CLOCKS = range(7)
D_CAP, D_NBUCKETS, D_NROWS, D_WIDTH, D_DIM, D_INIT, D_STATE, D_OPT, D_BOUNDED, D_ROOM = range(7, 17)
D_COLS = 17
#: codes the flat kernels return with the index of the key at fault (SHORT: of the table)
OK, DUPLICATE, FULL, UNKNOWN_TABLE, WRONG_SHAPE, NOT_OWNED, SHORT, NEED_STATE = 0, 1, 2, 3, 4, 5, 6, 7
AGG_ZERO, AGG_DIFFER, AGG_COMPLETE, AGG_TWICE, ABOVE_BOUND, NONFINITE = 11, 12, 13, 14, 15, 16
#: modes of :func:`flat_push_grad_jit`
CHECK_AND_APPLY, CHECK_ONLY, APPLY_ONLY = 0, 1, 2


@intrinsic
def voidptr_jit(typingctx, addr):
    """The integer ``addr`` as a ``void*`` (for ``numba.carray``)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(addr), codegen


@nb.njit(inline="always", nogil=True)
def dir_rows(d, t):
    return nb.carray(voidptr_jit(d[t, D_ROWS]), (d[t, D_CAP], d[t, D_WIDTH]), np.float32)


@nb.njit(inline="always", nogil=True)
def dir_keys(d, t):
    return nb.carray(voidptr_jit(d[t, D_KEYS]), d[t, D_CAP], np.uint64)


@nb.njit(inline="always", nogil=True)
def dir_buckets(d, t):
    return nb.carray(voidptr_jit(d[t, D_BUCKETS]), d[t, D_NBUCKETS], np.int64)


@nb.njit(inline="always", nogil=True)
def dir_marks(d, t):
    return nb.carray(voidptr_jit(d[t, D_MARKS]), d[t, D_CAP], np.int32)


@nb.njit(inline="always", nogil=True)
def dir_stamps(d, t):
    return nb.carray(voidptr_jit(d[t, D_STAMPS]), d[t, D_CAP], np.uint32)


@nb.njit(inline="always", nogil=True)
def dir_used(d, t):
    return nb.carray(voidptr_jit(d[t, D_USED]), d[t, D_CAP], np.uint64)


@nb.njit(inline="always", nogil=True)
def dir_clocks(d, t):
    return nb.carray(voidptr_jit(d[t, D_CLOCKS]), d[t, D_CAP], np.uint64)


@nb.njit(inline="always", nogil=True)
def dir_rows_flat(d, t):
    return nb.carray(voidptr_jit(d[t, D_ROWS]), d[t, D_CAP] * d[t, D_WIDTH], np.float32)


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


@nb.njit(cache=True, nogil=True)
def flat_room_jit(d, salts, num_shards, shard, want_dim, want_width, tables, keys, counts, check_room):
    """Validate a flat part's keys (NOTE [ps wire protocol]) and count them per table into
    ``counts`` (int64 [T], zeroed here); changes nothing.

    Every ``tables[i]`` must be a table of ``d``, of dim ``want_dim`` and row width
    ``want_width`` (a want < 0: not checked), and ``keys[i]`` must belong to ``shard``
    (``mix64(key ^ salts[t]) mod num_shards``). Returns ``(code, i)``: UNKNOWN_TABLE /
    WRONG_SHAPE / NOT_OWNED of key i; else, with ``check_room``, SHORT with the first table
    whose row count plus its keys exceeds its room (``D_ROOM``: the caller makes room for
    the table's unseen keys, or refuses, then calls again without ``check_room``); else OK.
    """
    n_tables = d.shape[0]
    n = nb.uint64(num_shards)
    for t in range(counts.shape[0]):
        counts[t] = 0
    for i in range(keys.shape[0]):
        t = nb.int64(tables[i])
        if t >= n_tables:
            return UNKNOWN_TABLE, i
        if (want_dim >= 0 and d[t, D_DIM] != want_dim) or (want_width >= 0 and d[t, D_WIDTH] != want_width):
            return WRONG_SHAPE, i
        if num_shards > 1 and nb.int64(mix64_jit(nb.uint64(keys[i]) ^ salts[t]) % n) != shard:
            return NOT_OWNED, i
        counts[t] += 1
    if check_room:
        for t in range(n_tables):
            if counts[t] and d[t, D_NROWS] + counts[t] > d[t, D_ROOM]:
                return SHORT, t
    return OK, -1


@nb.njit(cache=True, nogil=True)
def flat_slots_jit(d, seeds, fparams, tables, keys, out, stamp, lru, state):
    """Slots of ``(tables[i], keys[i])`` in their tables (the directory ``d``), inserting
    unseen keys with initialised rows (:func:`init_row_jit`, from ``seeds[t]`` and
    ``fparams[t] = (scale, initial accumulator)``); rows of LRU-bounded tables get
    ``lru`` as their last use. With ``stamp != 0`` each row is stamped and a key whose row
    this call already stamped is a duplicate. The caller made room (:func:`flat_room_jit`).

    The lookups are software-pipelined as in herald/keymap.py (the home bucket of the key
    ``AHEAD1`` ahead, then the key and row of the slot found ``AHEAD2`` ahead, are
    prefetched), across tables; so are the slot's stamp (``stamp != 0``) and, with
    ``state``, its mark and clock (a gradient push reads them next).

    Returns ``(code, i)``: OK, DUPLICATE (key i repeats an earlier one) or FULL (no room:
    a caller bug).
    """
    m = keys.shape[0]
    if m == 0:
        return OK, -1
    ring = np.empty(RING, np.uint64)
    ta_cur = nb.int64(tables[0])  # the tables of the keys ahead, and their arrays
    ba = dir_buckets(d, ta_cur)
    tb_cur = ta_cur
    bb = ba
    kb = dir_keys(d, tb_cur)
    rb = dir_rows_flat(d, tb_cur)
    wb = d[tb_cur, D_WIDTH]
    sbs = dir_stamps(d, tb_cur)
    mb = dir_marks(d, tb_cur)
    cb = dir_clocks(d, tb_cur)
    for a in range(min(AHEAD1, m)):
        ta = nb.int64(tables[a])
        if ta != ta_cur:
            ta_cur = ta
            ba = dir_buckets(d, ta)
        ring[a] = home_jit(0, nb.uint64(keys[a]), nb.uint64(ba.shape[0] - 1))
        prefetch_jit(ba, ring[a])
    cur = nb.int64(tables[0])
    buckets = dir_buckets(d, cur)
    row_keys = dir_keys(d, cur)
    rows = dir_rows(d, cur)
    stamps = dir_stamps(d, cur)
    used = dir_used(d, cur)
    n = d[cur, D_NROWS]
    for i in range(m):
        a = i + AHEAD1
        if a < m:  # stage 1: hash and prefetch the bucket of key a
            ta = nb.int64(tables[a])
            if ta != ta_cur:
                ta_cur = ta
                ba = dir_buckets(d, ta)
            ha = home_jit(0, nb.uint64(keys[a]), nb.uint64(ba.shape[0] - 1))
            ring[a & (RING - 1)] = ha
            prefetch_jit(ba, ha)
        b = i + AHEAD2
        if b < m:  # stage 2: the bucket of key b is near; prefetch its slot's key and row
            tb = nb.int64(tables[b])
            if tb != tb_cur:
                tb_cur = tb
                bb = dir_buckets(d, tb)
                kb = dir_keys(d, tb)
                rb = dir_rows_flat(d, tb)
                wb = d[tb, D_WIDTH]
                sbs = dir_stamps(d, tb)
                mb = dir_marks(d, tb)
                cb = dir_clocks(d, tb)
            sb = bb[ring[b & (RING - 1)]]
            if sb >= 0:
                prefetch_jit(kb, sb)
                prefetch_jit(rb, sb * wb)
                prefetch_jit(rb, sb * wb + wb - 1)  # a row may span two cache lines
                if stamp != 0:
                    prefetch_jit(sbs, sb)
                if state:
                    prefetch_jit(mb, sb)
                    prefetch_jit(cb, sb)
        t = nb.int64(tables[i])
        if t != cur:
            d[cur, D_NROWS] = n
            cur = t
            buckets = dir_buckets(d, t)
            row_keys = dir_keys(d, t)
            rows = dir_rows(d, t)
            stamps = dir_stamps(d, t)
            used = dir_used(d, t)
            n = d[t, D_NROWS]
        key = nb.uint64(keys[i])
        s = find_or_insert_jit(buckets, row_keys, 0, 0, key, ring[i & (RING - 1)], n)
        if s < 0:
            d[cur, D_NROWS] = n
            return FULL, i
        if s == n:
            n += 1
            init_row_jit(rows[s], key, seeds[t], d[t, D_DIM], d[t, D_INIT], fparams[t, 0], d[t, D_STATE], fparams[t, 1])
        out[i] = s
        if d[t, D_BOUNDED]:
            used[s] = lru
        if stamp != 0:
            if stamps[s] == stamp:
                d[cur, D_NROWS] = n
                return DUPLICATE, i
            stamps[s] = stamp
    d[cur, D_NROWS] = n
    return OK, -1


@nb.njit(cache=True, nogil=True)
def flat_rows_at_jit(d, tables, slots, out, count_marks):
    """The rows at ``(tables[i], slots[i])`` into ``out`` (float32 [n, width]): a pull's read,
    once its slots were found (:func:`flat_room_jit` of the tables' dim and ``out``'s width,
    then :func:`flat_slots_jit`). Returns the keys whose row has an open aggregation
    (counted only with ``count_marks``)."""
    m = slots.shape[0]
    pending = 0
    if m == 0:
        return 0
    cur = nb.int64(tables[0])
    rows = dir_rows(d, cur)
    marks = dir_marks(d, cur)
    w = out.shape[1]
    ta = cur  # the table of the key AHEAD1 ahead, whose row is prefetched
    ra = dir_rows_flat(d, ta)
    for i in range(m):
        a = i + AHEAD1
        if a < m:
            if nb.int64(tables[a]) != ta:
                ta = nb.int64(tables[a])
                ra = dir_rows_flat(d, ta)
            prefetch_jit(ra, slots[a] * w)
            prefetch_jit(ra, slots[a] * w + w - 1)
        t = nb.int64(tables[i])
        if t != cur:
            cur = t
            rows = dir_rows(d, t)
            marks = dir_marks(d, t)
        s = slots[i]
        src = rows[s]
        dst = out[i]
        for j in range(w):
            dst[j] = src[j]
        if count_marks and marks[s] > 0:
            pending += 1
    return pending


@nb.njit(cache=True, nogil=True)
def flat_pull_clocked_jit(
    d,
    seeds,
    fparams,
    salts,
    num_shards,
    shard,
    counts,
    check_room,
    tables,
    keys,
    dim,
    c_c,
    staleness,
    slots,
    c_g,
    out,
    lru,
    count_marks,
):
    """A conditional pull (NOTE [clock frames] in herald/ps/wire.py): :func:`flat_room_jit`,
    then ``c_g[i]`` = the clock of every key; the rows of the keys not valid (i >=
    len(c_c), or ``c_g > c_c[i] + staleness``) go to ``out`` in key order. Returns
    ``(code, i, rows fetched, pending)``."""
    code, at = flat_room_jit(d, salts, num_shards, shard, dim, out.shape[1], tables, keys, counts, check_room)
    if code != OK:
        return code, at, 0, 0
    code, at = flat_slots_jit(d, seeds, fparams, tables, keys, slots, 0, lru, False)
    if code != OK:
        return code, at, 0, 0
    m = keys.shape[0]
    if m == 0:
        return OK, -1, 0, 0
    cur = nb.int64(tables[0])
    rows = dir_rows(d, cur)
    marks = dir_marks(d, cur)
    clocks = dir_clocks(d, cur)
    w = out.shape[1]
    k = 0
    pending = 0
    s_max = nb.uint64(staleness)
    for i in range(m):
        t = nb.int64(tables[i])
        if t != cur:
            cur = t
            rows = dir_rows(d, t)
            marks = dir_marks(d, t)
            clocks = dir_clocks(d, t)
        s = slots[i]
        g = clocks[s]
        c_g[i] = g
        if i < c_c.shape[0]:
            c = nb.uint64(c_c[i])
            if g <= c or g - c <= s_max:
                continue
        src = rows[s]
        dst = out[k]
        for j in range(w):
            dst[j] = src[j]
        k += 1
        if count_marks and marks[s] > 0:
            pending += 1
    return OK, -1, k, pending


_EXPONENT = np.uint32(0x7F800000)  # float32 exponent bits: all set = NaN or infinity


@nb.njit(cache=True, nogil=True)
def finite_rows_jit(a):
    """``(NONFINITE, i)`` for the first row i of ``a`` (float32 [n, w]) holding a NaN or an
    infinity, else ``(OK, -1)``. The one check of every float32 payload a shard stores:
    gradients (:func:`grad_inputs_check_jit`) and rows (:func:`flat_push_rows_jit`), run
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


@nb.njit(cache=True, nogil=True)
def flat_push_rows_jit(
    d,
    seeds,
    fparams,
    salts,
    num_shards,
    shard,
    counts,
    check_room,
    tables,
    keys,
    src,
    advance,
    has_advance,
    slots,
    c_g,
    stamp,
    lru,
):
    """A write-back: every row of ``src`` (float32 [n, width]) finite (:func:`finite_rows_jit`:
    NONFINITE, before any room is made or key inserted), :func:`flat_room_jit`, then
    overwrite the rows of unique keys with ``src``; with ``has_advance`` also ``c_g +=
    advance[i]`` and ``c_g`` after into ``c_g[i]``. No row is written when a key repeats.
    Returns ``(code, i)``."""
    code, at = finite_rows_jit(src)
    if code != OK:
        return code, at
    code, at = flat_room_jit(d, salts, num_shards, shard, -1, src.shape[1], tables, keys, counts, check_room)
    if code != OK:
        return code, at
    code, at = flat_slots_jit(d, seeds, fparams, tables, keys, slots, stamp, lru, False)
    if code != OK:
        return code, at
    m = keys.shape[0]
    if m == 0:
        return OK, -1
    cur = nb.int64(tables[0])
    rows = dir_rows(d, cur)
    clocks = dir_clocks(d, cur)
    w = src.shape[1]
    for i in range(m):
        t = nb.int64(tables[i])
        if t != cur:
            cur = t
            rows = dir_rows(d, t)
            clocks = dir_clocks(d, t)
        s = slots[i]
        dst = rows[s]
        r = src[i]
        for j in range(w):
            dst[j] = r[j]
        if has_advance:
            clocks[s] += nb.uint64(advance[i])
            c_g[i] = clocks[s]
    return OK, -1


# ----------------------------------------------------------------------------- flat aggregation
#
# The open aggregations of one step over every table of a shard (NOTE [ps aggregation] in
# herald/ps/aggregate.py, :class:`~herald.ps.aggregate.PendingStep`): a key map (NOTE [key
# map]) of (table, key) -> pending index p (``buckets`` int64, -1 empty; key ``p_key[p]``,
# table ``p_table[p]``, -1 = forgotten); per p: ``p_slot``, ``p_expected``, ``p_arrived``,
# ``p_head`` (its entry list); per entry e: ``e_rank``, ``e_next``, ``e_grad`` float32 [dim];
# ``cnt`` int64 [3] = (p used, entries used, open p); per table: ``open_t`` (open p) and
# ``opened_at`` (when its open count last left 0).


@nb.njit(cache=True, nogil=True)
def grad_inputs_check_jit(grads, contributors, bound):
    """``(code, i, largest contributors)``: ABOVE_BOUND if ``contributors[i] > bound``, else
    NONFINITE if gradient row i holds a NaN or an infinity (:func:`finite_rows_jit`), else OK."""
    cmax = 0
    for i in range(contributors.shape[0]):
        c = nb.int64(contributors[i])
        if c > bound:
            return ABOVE_BOUND, i, c
        if c > cmax:
            cmax = c
    code, i = finite_rows_jit(grads)
    return code, i, cmax


@nb.njit(cache=True, nogil=True)
def _aggregation_check_jit(
    tables, keys, contributors, rank, buckets, p_key, p_table, p_expected, p_arrived, p_head, e_rank, e_next
):
    """NOTE [ps aggregation]'s rules for one push against a step's pending state: ``(code, i)``."""
    mask = nb.uint64(buckets.shape[0] - 1)
    for i in range(keys.shape[0]):
        c = nb.int64(contributors[i])
        if c == 0:
            return AGG_ZERO, i
        t = nb.int64(tables[i])
        key = nb.uint64(keys[i])
        p = buckets[probe_jit(buckets, p_key, p_table, t, key, home_jit(t, key, mask))]
        if p < 0:
            continue
        if p_expected[p] != c:
            return AGG_DIFFER, i
        if p_arrived[p] >= p_expected[p]:
            return AGG_COMPLETE, i
        e = p_head[p]
        while e >= 0:
            if e_rank[e] == rank:
                return AGG_TWICE, i
            e = e_next[e]
    return OK, -1


@nb.njit(cache=True, nogil=True)
def _aggregation_apply_jit(
    d,
    hp,
    tables,
    keys,
    grads,
    contributors,
    rank,
    slots,
    buckets,
    p_key,
    p_table,
    p_slot,
    p_expected,
    p_arrived,
    p_head,
    e_rank,
    e_next,
    e_grad,
    cnt,
    open_t,
    opened_at,
    now,
):
    """Record one contributor's gradients (checked, room reserved); apply the optimizer of
    each key's table to every (key, step) whose last contributor this is; tick the clock of
    every row left without an open aggregation. Returns the rows updated."""
    m = keys.shape[0]
    if m == 0:
        return 0
    applied = 0
    mask = nb.uint64(buckets.shape[0] - 1)
    cur = nb.int64(tables[0])
    rows = dir_rows(d, cur)
    marks = dir_marks(d, cur)
    clocks = dir_clocks(d, cur)
    kind = d[cur, D_OPT]
    dim = d[cur, D_DIM]
    hpt = hp[cur]
    acc = np.empty(e_grad.shape[1] if e_grad.shape[1] > grads.shape[1] else grads.shape[1], np.float32)
    ids = np.empty(16, np.int64)  # a completed (key, step)'s entries, by increasing rank
    rk = np.empty(16, np.int64)
    for i in range(m):
        t = nb.int64(tables[i])
        if t != cur:
            cur = t
            rows = dir_rows(d, t)
            marks = dir_marks(d, t)
            clocks = dir_clocks(d, t)
            kind = d[t, D_OPT]
            dim = d[t, D_DIM]
            hpt = hp[t]
        c = np.int32(contributors[i])
        key = nb.uint64(keys[i])
        s = slots[i]
        h = probe_jit(buckets, p_key, p_table, t, key, home_jit(t, key, mask))
        p = buckets[h]
        if p < 0 and c == 1:
            apply_row_jit(rows[s], grads[i], kind, dim, hpt)
            applied += 1
            if marks[s] == 0:  # NOTE [embedding clocks]: an applied update without an open one left
                clocks[s] += nb.uint64(1)
            continue
        if p < 0:
            p = cnt[0]
            cnt[0] += 1
            cnt[2] += 1
            buckets[h] = p
            p_key[p] = key
            p_table[p] = t
            p_slot[p] = s
            p_expected[p] = c
            p_arrived[p] = 0
            p_head[p] = -1
            marks[s] += 1
            if open_t[t] == 0:
                opened_at[t] = now
            open_t[t] += 1
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
            if n > ids.shape[0]:
                ids = np.empty(2 * n, np.int64)
                rk = np.empty(2 * n, np.int64)
            e = p_head[p]
            k = 0
            while e >= 0:  # insertion by rank (ranks of one (key, step) are distinct)
                r = nb.int64(e_rank[e])
                q = k
                while q > 0 and rk[q - 1] > r:
                    rk[q] = rk[q - 1]
                    ids[q] = ids[q - 1]
                    q -= 1
                rk[q] = r
                ids[q] = e
                k += 1
                e = e_next[e]
            for j in range(dim):
                acc[j] = np.float32(0.0)
            for k in range(n):
                src = e_grad[ids[k]]
                for j in range(dim):
                    acc[j] += src[j]
            apply_row_jit(rows[s], acc, kind, dim, hpt)
            applied += 1
            marks[s] -= 1
            cnt[2] -= 1
            open_t[t] -= 1
        if marks[s] == 0:
            clocks[s] += nb.uint64(1)
    return applied


@nb.njit(cache=True, nogil=True)
def flat_push_grad_jit(
    d,
    seeds,
    fparams,
    salts,
    num_shards,
    shard,
    counts,
    check_room,
    hp,
    tables,
    keys,
    grads,
    contributors,
    rank,
    bound,
    slots,
    stamp,
    lru,
    mode,
    buckets,
    p_key,
    p_table,
    p_slot,
    p_expected,
    p_arrived,
    p_head,
    e_rank,
    e_next,
    e_grad,
    cnt,
    open_t,
    opened_at,
    now,
):
    """One contributor's gradients for one step (NOTE [ps aggregation]).

    ``mode`` CHECK_ONLY: validate without changing a row (:func:`flat_room_jit` of the
    gradients' dim, every ``contributors[i] <= bound``, every gradient finite, keys unique:
    slots found or inserted and rows stamped, then the aggregation rules against the step's
    state); returns ``(code, i, largest contributors)``. APPLY_ONLY: record and apply what a
    CHECK_ONLY call accepted (``slots`` its slots; state room reserved); returns ``(OK, -1,
    rows updated)``. CHECK_AND_APPLY: both, after a check of the state's room before any
    change (NEED_STATE: the step has no state, or too small a one: make room, call again).

    Applying: a key with ``contributors[i] == 1`` and no pending state is applied at once.
    Others are kept until ``contributors[i]`` ranks have arrived, then summed in increasing
    rank order (``0 + g_r0 + g_r1 + ...`` in float32, so the result does not depend on the
    arrival order) and applied once with the optimizer of the key's table (``d[t, D_OPT]``,
    ``hp[t]``: :func:`apply_row_jit`); then the clock of every row without an open
    aggregation left ticks (NOTE [embedding clocks]).
    """
    m = keys.shape[0]
    if mode != APPLY_ONLY:
        code, at = flat_room_jit(d, salts, num_shards, shard, grads.shape[1], -1, tables, keys, counts, check_room)
        if code != OK:
            return code, at, 0
        code, at, cmax = grad_inputs_check_jit(grads, contributors, bound)
        if code != OK:
            return code, at, cmax
        if mode == CHECK_AND_APPLY and cmax > 1:
            need = cnt[0] + m
            if (
                need > p_key.shape[0]
                or 2 * need > buckets.shape[0]
                or cnt[1] + m > e_rank.shape[0]
                or cnt[1] + m > e_grad.shape[0]
                or e_grad.shape[1] < grads.shape[1]
                or open_t.shape[0] < d.shape[0]
            ):
                return NEED_STATE, -1, cmax
        code, at = flat_slots_jit(d, seeds, fparams, tables, keys, slots, stamp, lru, True)
        if code != OK:
            return code, at, cmax
        code, at = _aggregation_check_jit(
            tables, keys, contributors, rank, buckets, p_key, p_table, p_expected, p_arrived, p_head, e_rank, e_next
        )
        if code != OK or mode == CHECK_ONLY:
            return code, at, cmax
    applied = _aggregation_apply_jit(
        d,
        hp,
        tables,
        keys,
        grads,
        contributors,
        rank,
        slots,
        buckets,
        p_key,
        p_table,
        p_slot,
        p_expected,
        p_arrived,
        p_head,
        e_rank,
        e_next,
        e_grad,
        cnt,
        open_t,
        opened_at,
        now,
    )
    return OK, -1, applied

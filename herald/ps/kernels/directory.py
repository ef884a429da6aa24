"""Table directory kernels: a shard's tables reached from one kernel call, and the key
lookups every flat op starts with (the room check and the slots).

NOTE [table directory]
~~~~~~~~~~~~~~~~~~~~~~
The flat kernels serve keys of every table of a shard in one call (NOTE [ps wire
protocol], flat parts). Each table keeps its own arrays (herald/ps/table_arrays.py); the
kernels reach them through the shard's directory (:class:`herald.ps.directory.TableDirectory`):
``d`` int64 [T, D_COLS], one row per table holding the data addresses of its arrays
(``D_ROWS`` .. ``D_CLOCKS``), their sizes, its row count (``D_NROWS``, the one copy of it:
the kernels insert rows and update it) and its settings (dim, width, initialiser,
optimizer, LRU bound). A kernel rebuilds a table's arrays from its row (:func:`dir_rows`
...: ``numba.carray`` on the address, no copy) when the table of the next key differs
from the last one's, so keys grouped by table cost one switch per group. The kernels take
the directory with the tables' other settings as one tuple, the shard's *table space*
``space = (d, seeds uint64 [T], fparams float64 [T, 2], salts uint64 [T], hp float32
[T, 5], counts int64 [T], num_shards, shard)`` (:attr:`TableDirectory.space`).

Invariant: every address names an array the table holds. A table's arrays are replaced
in one place only (:meth:`herald.ps.table_arrays.TableArrays.install`), which rewrites the
table's row of the directory before any kernel runs again (single-threaded shard); with
``HERALD_PS_DEBUG=1`` (on in the tests) every such publish is followed by
:func:`herald.ps.directory.check_directory`, which verifies every address and size against
the arrays the table holds. Typed lists of the arrays would cost ~1.2 us of unboxing per
list per call, seven lists per call; the directory is two plain arrays.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from herald.hashing import splitmix64_jit as mix64_jit
from herald.keymap import AHEAD1, AHEAD2, RING, find_or_insert_jit, home_jit, prefetch_jit
from herald.ps.kernels.rows import init_row_jit

D_ROWS, D_KEYS, D_BUCKETS, D_MARKS, D_STAMPS, D_USED, D_CLOCKS = range(7)
D_CAP, D_NBUCKETS, D_NROWS, D_WIDTH, D_DIM, D_INIT, D_STATE, D_OPT, D_BOUNDED, D_ROOM = range(7, 17)
D_COLS = 17
#: codes the flat kernels return with the index of the key at fault (SHORT: of the table)
OK, DUPLICATE, FULL, UNKNOWN_TABLE, WRONG_SHAPE, NOT_OWNED, SHORT, NEED_STATE = 0, 1, 2, 3, 4, 5, 6, 7
AGG_ZERO, AGG_DIFFER, AGG_COMPLETE, AGG_TWICE, ABOVE_BOUND, NONFINITE = 11, 12, 13, 14, 15, 16


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
    """Table ``t``'s rows, float32 [capacity, width]."""
    return nb.carray(voidptr_jit(d[t, D_ROWS]), (d[t, D_CAP], d[t, D_WIDTH]), np.float32)


@nb.njit(inline="always", nogil=True)
def dir_rows_flat(d, t):
    """Table ``t``'s rows as one float32 [capacity * width] (for prefetching a row's lines)."""
    return nb.carray(voidptr_jit(d[t, D_ROWS]), d[t, D_CAP] * d[t, D_WIDTH], np.float32)


def _vector(column: int, size: int, dtype):
    """The inline accessor of the 1-d array at ``column`` of size ``d[t, size]``."""

    @nb.njit(inline="always", nogil=True)
    def get(d, t):
        return nb.carray(voidptr_jit(d[t, column]), d[t, size], dtype)

    return get


dir_keys = _vector(D_KEYS, D_CAP, np.uint64)
dir_buckets = _vector(D_BUCKETS, D_NBUCKETS, np.int64)
dir_marks = _vector(D_MARKS, D_CAP, np.int32)
dir_stamps = _vector(D_STAMPS, D_CAP, np.uint32)
dir_used = _vector(D_USED, D_CAP, np.uint64)
dir_clocks = _vector(D_CLOCKS, D_CAP, np.uint64)


@nb.njit(cache=True, nogil=True)
def flat_room_jit(space, check_room, want_dim, want_width, tables, keys):
    """Validate a flat part's keys (NOTE [ps wire protocol]) and count them per table into
    the space's ``counts`` (zeroed here); changes nothing.

    Every ``tables[i]`` must be a table of the directory, of dim ``want_dim`` and row width
    ``want_width`` (a want < 0: not checked), and ``keys[i]`` must belong to the space's
    shard (``mix64(key ^ salts[t]) mod num_shards``). Returns ``(code, i)``: UNKNOWN_TABLE /
    WRONG_SHAPE / NOT_OWNED of key i; else, with ``check_room``, SHORT with the first table
    whose row count plus its keys exceeds its room (``D_ROOM``: the caller makes room for
    the table's unseen keys, or refuses, then calls again without ``check_room``); else OK.
    """
    d, _, _, salts, _, counts, num_shards, shard = space
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


# The lookup loop below is one software pipeline (herald/keymap.py): its three stages share
# the ring of home buckets and the arrays of the tables ahead, carried from one key to the
# next, so it stays one function: with the stages' table switches and prefetches in inlined
# helpers (tuples of arrays) the lookups of 2,500 keys took ~10% longer.
@nb.njit(cache=True, nogil=True)
def flat_slots_jit(space, tables, keys, out, stamp, lru, state):
    """Slots of ``(tables[i], keys[i])`` in their tables, inserting unseen keys with
    initialised rows (:func:`~herald.ps.kernels.rows.init_row_jit`, from ``seeds[t]`` and
    ``fparams[t] = (scale, initial accumulator)``); rows of LRU-bounded tables get ``lru`` as
    their last use. With ``stamp != 0`` each row is stamped and a key whose row this call
    already stamped is a duplicate. The caller made room (:func:`flat_room_jit`).

    The lookups are software-pipelined as in herald/keymap.py (the home bucket of the key
    ``AHEAD1`` ahead, then the key and row of the slot found ``AHEAD2`` ahead, are
    prefetched), across tables; so are the slot's stamp (``stamp != 0``) and, with
    ``state``, its mark and clock (a gradient push reads them next).

    Returns ``(code, i)``: OK, DUPLICATE (key i repeats an earlier one) or FULL (no room:
    a caller bug).
    """
    d, seeds, fparams = space[0], space[1], space[2]
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

"""Flat reads and writes of rows: a pull's copy, the conditional pull, the write-back.

Each runs over the keys of every table of one request part through the shard's table
space (NOTE [table directory] in herald/ps/kernels/directory.py), after the room check
and the slot lookups of :mod:`herald.ps.kernels.directory`.
"""

from __future__ import annotations

import numba as nb

from herald.keymap import AHEAD1, prefetch_jit
from herald.ps.kernels.directory import (
    OK,
    dir_clocks,
    dir_marks,
    dir_rows,
    dir_rows_flat,
    flat_room_jit,
    flat_slots_jit,
)
from herald.ps.kernels.rows import finite_rows_jit


@nb.njit(cache=True, nogil=True)
def flat_rows_at_jit(d, tables, slots, out, count_marks):
    """The rows at ``(tables[i], slots[i])`` into ``out`` (float32 [n, width]): a pull's read,
    once its slots were found (``flat_room_jit`` of the tables' dim and ``out``'s width,
    then ``flat_slots_jit``). Returns the keys whose row has an open aggregation
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
def flat_pull_clocked_jit(space, check_room, tables, keys, dim, c_c, staleness, slots, c_g, out, lru, count_marks):
    """A conditional pull (NOTE [clock frames] in herald/ps/wire.py): :func:`flat_room_jit`,
    then ``c_g[i]`` = the clock of every key; the rows of the keys not valid (i >=
    len(c_c), or ``c_g > c_c[i] + staleness``) go to ``out`` in key order. Returns
    ``(code, i, rows fetched, pending)``."""
    code, at = flat_room_jit(space, check_room, dim, out.shape[1], tables, keys)
    if code != OK:
        return code, at, 0, 0
    code, at = flat_slots_jit(space, tables, keys, slots, 0, lru, False)
    if code != OK:
        return code, at, 0, 0
    m = keys.shape[0]
    if m == 0:
        return OK, -1, 0, 0
    d = space[0]
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


@nb.njit(cache=True, nogil=True)
def flat_push_rows_jit(space, check_room, tables, keys, src, advance, has_advance, slots, c_g, stamp, lru):
    """A write-back: every row of ``src`` (float32 [n, width]) finite (:func:`finite_rows_jit`:
    NONFINITE, before any room is made or key inserted), :func:`flat_room_jit`, then
    overwrite the rows of unique keys with ``src``; with ``has_advance`` also ``c_g +=
    advance[i]`` and ``c_g`` after into ``c_g[i]``. No row is written when a key repeats.
    Returns ``(code, i)``."""
    code, at = finite_rows_jit(src)
    if code != OK:
        return code, at
    code, at = flat_room_jit(space, check_room, -1, src.shape[1], tables, keys)
    if code != OK:
        return code, at
    code, at = flat_slots_jit(space, tables, keys, slots, stamp, lru, False)
    if code != OK:
        return code, at
    m = keys.shape[0]
    if m == 0:
        return OK, -1
    d = space[0]
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

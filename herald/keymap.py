"""The (table, id) -> slot hash map of the scheduler, the PS and the worker cache.

NOTE [key map]. Open addressing with linear probing over a bucket array that holds
slots; the keys live in the user's per-slot arrays:

================  ===================  ================================================
array             dtype [shape]        meaning
================  ===================  ================================================
``buckets``       int32/int64 [H]      slot of the key hashed there, -1 = empty;
                                       H a power of two
``slot_ids``      uint64 [S]           id of each slot's key (never narrowed)
``slot_tab``      int [S], or one int  table of each slot's key; one int when every key
                                       of the map is in the same table (the PS keeps
                                       one map per table)
================  ===================  ================================================

- home bucket: ``key_hash(t, id) & (H - 1)`` with
  ``key_hash(t, id) = splitmix64(id ^ (t + 1) * 0x9E3779B97F4A7C15)`` (the splitmix64 of
  NOTE [id hash], :func:`herald.hashing.splitmix64_jit`); every uint64 is a valid id.
- the caller keeps the live keys <= H / 2 (:func:`bucket_count`); to grow, it rebuilds a
  larger bucket array from the slot arrays (:func:`new_buckets`). Bucket positions
  are never observable: slots are what the users store and report.
- slots are the user's: :func:`find_or_insert_many_jit` hands out ``n, n + 1, ...`` in
  lookup order (the scheduler's dense slots, the PS's rows), :func:`insert_many_jit` takes
  the slot the user chose (the worker cache's free list).
- deletion shifts the rest of the probe cluster back (no tombstones), so a map that inserts
  and deletes every step (the worker cache) never degrades.

Batch lookups are software-pipelined: the home bucket of the key ``AHEAD1`` ahead and the
id of the slot in the bucket of the key ``AHEAD2`` ahead are prefetched, so the random
accesses of consecutive keys overlap. Kernels are ``nogil`` and write into preallocated
outputs; the users allocate and grow.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from herald.hashing import splitmix64_jit

JIT = dict(nogil=True, cache=True)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ONE = np.uint64(1)
AHEAD1, AHEAD2, RING = 8, 4, 16  # pipeline distances (keys) and ring of home buckets (a power of 2)


# ----------------------------------------------------------------------------- helpers
@intrinsic
def prefetch_jit(typingctx, arr, idx):
    """Software prefetch (read, keep in all levels) of ``arr[idx]``, 1-d array of any
    layout; a hint only: no effect on results."""
    if not isinstance(arr, types.Array) or arr.ndim != 1 or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        aryty, idxty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        i = context.cast(builder, args[1], idxty, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [i], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


def item(x, i):
    """``x[i]`` for an array, ``x`` for a scalar (a ``slot_tab`` or ``tables`` that is one
    table for the whole map)."""
    return x if np.ndim(x) == 0 else x[i]


def set_item(x, i, v):
    """``x[i] = v`` for an array; nothing for a scalar (its one table is every key's)."""
    if np.ndim(x):
        x[i] = v


# Not inline="always": inlined into the inline kernels below, numba 0.68 left slot_tab
# unwritten; LLVM inlines these anyway.
@overload(item)
def _item_ol(x, i):
    if isinstance(x, types.Array):
        return lambda x, i: x[i]
    if isinstance(x, types.Integer):
        return lambda x, i: x
    return None


@overload(set_item)
def _set_item_ol(x, i, v):
    if isinstance(x, types.Array):

        def impl(x, i, v):
            x[i] = v

        return impl
    if isinstance(x, types.Integer):
        return lambda x, i, v: None
    return None


@nb.njit(**JIT)
def key_hash_jit(table, key):
    """uint64 hash of the key ``(table, key)``: ``splitmix64(key ^ (table + 1) * golden)``."""
    return splitmix64_jit(nb.uint64(key) ^ (nb.uint64(table + 1) * GOLDEN))


@nb.njit(inline="always", **JIT)
def home_jit(table, key, mask):
    """Home bucket of ``(table, key)`` in a map of ``mask + 1`` buckets (``mask`` uint64).

    Bucket positions are uint64 throughout: numba indexes with an unsigned integer without
    the negative-index wraparound test (measurably faster in the probe loops)."""
    return key_hash_jit(table, key) & mask


@nb.njit(inline="always", **JIT)
def probe_jit(buckets, slot_ids, slot_tab, t, v, b):
    """Bucket holding ``(t, v)``, or the empty bucket where it would go, from bucket ``b``."""
    mask = nb.uint64(buckets.shape[0] - 1)
    while True:
        s = buckets[b]
        if s < 0 or (slot_ids[s] == v and item(slot_tab, s) == t):
            return b
        b = (b + _ONE) & mask


# ----------------------------------------------------------------------------- one key
@nb.njit(**JIT)
def find_jit(buckets, slot_ids, slot_tab, t, v):
    """Slot of ``(t, v)``, or -1."""
    b = home_jit(t, v, nb.uint64(buckets.shape[0] - 1))
    return buckets[probe_jit(buckets, slot_ids, slot_tab, t, v, b)]


@nb.njit(inline="always", **JIT)
def find_or_insert_jit(buckets, slot_ids, slot_tab, t, v, b, n):
    """Slot of ``(t, v)`` probing from its home bucket ``b``; a new key gets slot ``n``
    (the next free one), or -1 when all ``S = slot_ids.shape[0]`` slots are in use."""
    mask = nb.uint64(buckets.shape[0] - 1)
    while True:  # probe_jit, then the insertion, in one loop (a few % faster)
        s = buckets[b]
        if s < 0:
            if n == slot_ids.shape[0]:
                return nb.int64(-1)
            buckets[b] = n
            slot_ids[n] = v
            set_item(slot_tab, n, t)
            return nb.int64(n)
        if slot_ids[s] == v and item(slot_tab, s) == t:
            return nb.int64(s)
        b = (b + _ONE) & mask


@nb.njit(inline="always", **JIT)
def delete_jit(buckets, slot_ids, slot_tab, t, v):
    """Remove ``(t, v)``; returns the slot it held, or -1 when absent. The later members of
    its probe cluster shift back into the hole (no tombstones)."""
    mask = nb.uint64(buckets.shape[0] - 1)
    b = probe_jit(buckets, slot_ids, slot_tab, t, v, home_jit(t, v, mask))
    gone = nb.int64(buckets[b])
    if gone < 0:
        return gone
    hole = b
    j = (b + _ONE) & mask
    while buckets[j] >= 0:
        s = buckets[j]
        home = home_jit(item(slot_tab, s), slot_ids[s], mask)
        # move j into the hole unless its home lies cyclically in (hole, j]
        if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
            buckets[hole] = s
            hole = j
        j = (j + _ONE) & mask
    buckets[hole] = -1
    return gone


# ----------------------------------------------------------------------------- batches
@nb.njit(**JIT)
def _lookup_many_jit(buckets, slot_ids, slot_tab, n_slots, tables, ids, out_slot, insert):
    """:func:`find_or_insert_many_jit` (``insert``) or :func:`find_many_jit` (absent -> -1).

    The pipeline is written out here, not in helper functions: numba 0.68 compiles the
    loop 2-3x slower when its stages are separate functions (inline or not).
    """
    mask = nb.uint64(buckets.shape[0] - 1)
    n = n_slots[0]
    m = ids.shape[0]
    ring = np.empty(RING, np.uint64)  # home buckets of the keys up to AHEAD1 ahead
    for a in range(min(AHEAD1, m)):
        ring[a] = home_jit(item(tables, a), ids[a], mask)
        prefetch_jit(buckets, ring[a])
    for i in range(m):
        a = i + AHEAD1
        if a < m:  # stage 1: hash and prefetch the bucket of key a
            ha = home_jit(item(tables, a), ids[a], mask)
            ring[a & (RING - 1)] = ha
            prefetch_jit(buckets, ha)
        b = i + AHEAD2
        if b < m:  # stage 2: the bucket of key b is near; prefetch its slot's id
            sb = buckets[ring[b & (RING - 1)]]
            if sb >= 0:
                prefetch_jit(slot_ids, sb)
        t = item(tables, i)
        if insert:
            s = find_or_insert_jit(buckets, slot_ids, slot_tab, t, ids[i], ring[i & (RING - 1)], n)
            if s < 0:  # all slots in use
                n_slots[0] = n
                return i
            if s == n:
                n += 1
        else:
            s = buckets[probe_jit(buckets, slot_ids, slot_tab, t, ids[i], ring[i & (RING - 1)])]
            if s >= 0:
                n += 1
        out_slot[i] = s
    n_slots[0] = n
    return m


@nb.njit(**JIT)
def find_many_jit(buckets, slot_ids, slot_tab, tables, ids, out_slot):
    """``out_slot[i]`` = slot of ``(tables[i], ids[i])``, or -1 when absent.

    Args:
        buckets, slot_ids, slot_tab: the map (NOTE [key map]).
        tables: int [n], or one int for all keys; ids: uint64 [n]; out_slot: int [n] (written).

    Returns:
        the number of keys found.
    """
    found = np.zeros(1, np.int64)
    _lookup_many_jit(buckets, slot_ids, slot_tab, found, tables, ids, out_slot, False)
    return found[0]


@nb.njit(**JIT)
def find_or_insert_many_jit(buckets, slot_ids, slot_tab, n_slots, tables, ids, out_slot):
    """Slots of keys ``(tables[i], ids[i])``, inserting unseen keys at slots ``n_slots[0]``,
    ``n_slots[0] + 1``, ... (in lookup order).

    Args:
        buckets, slot_ids, slot_tab: the map (NOTE [key map]); ``slot_ids`` and an array
            ``slot_tab`` get the new keys.
        n_slots: int64 [1], slots in use (updated).
        tables: int [n], or one int for all keys; ids: uint64 [n]; out_slot: int [n] (written).

    Returns:
        keys processed: fewer than n when a new key found all ``slot_ids.shape[0]`` slots
        in use (grow the slot arrays, and the buckets to keep load <= 1/2, and call again
        on the rest).
    """
    return _lookup_many_jit(buckets, slot_ids, slot_tab, n_slots, tables, ids, out_slot, True)


@nb.njit(**JIT)
def find_or_insert_tables_jit(buckets, slot_ids, slot_tab, n_slots, values, out_slot):
    """:func:`find_or_insert_many_jit` of the keys of a batch given as per-table id
    arrays, without concatenating them: keys in table-major order (table 0's ids, then
    table 1's, ...), through the same pipeline.

    Args:
        buckets, slot_ids, slot_tab (an array): the map; n_slots: int64 [1] (updated).
        values: tuple of T uint64 [nnz_t] arrays (key ``(t, values[t][j])``);
        out_slot: int [sum nnz_t] (written).

    Returns:
        keys processed (table-major); fewer than ``out_slot.shape[0]`` when a new key
        found all slots in use (grow and finish the rest with ``find_or_insert_many_jit``).
    """
    mask = nb.uint64(buckets.shape[0] - 1)
    n = n_slots[0]
    T = len(values)
    ring = np.empty(RING, np.uint64)  # home buckets of the keys up to AHEAD1 ahead
    ta = 0  # (table, index) of the next key to hash (stage 1)
    ja = 0
    a = 0  # its table-major position
    i = 0
    for t in range(T):
        v_t = values[t]
        for j in range(v_t.shape[0]):
            while a < i + AHEAD1 and ta < T:  # stage 1: hash and prefetch buckets ahead
                va = values[ta]
                if ja < va.shape[0]:
                    ha = home_jit(ta, va[ja], mask)
                    ring[a & (RING - 1)] = ha
                    prefetch_jit(buckets, ha)
                    ja += 1
                    a += 1
                else:
                    ta += 1
                    ja = 0
            b = i + AHEAD2
            if b < a:  # stage 2: the bucket of key b is near; prefetch its slot's id
                sb = buckets[ring[b & (RING - 1)]]
                if sb >= 0:
                    prefetch_jit(slot_ids, sb)
            s = find_or_insert_jit(buckets, slot_ids, slot_tab, t, v_t[j], ring[i & (RING - 1)], n)
            if s < 0:  # all slots in use
                n_slots[0] = n
                return i
            out_slot[i] = s
            if s == n:
                n += 1
            i += 1
    n_slots[0] = n
    return i


@nb.njit(**JIT)
def insert_many_jit(buckets, slot_ids, slot_tab, tables, ids, slots):
    """Put key ``(tables[i], ids[i])`` at slot ``slots[i]`` (the caller's choice): inserted
    when absent, moved there when present. Returns the number of keys that were new."""
    mask = nb.uint64(buckets.shape[0] - 1)
    new = 0
    for i in range(ids.shape[0]):
        t = item(tables, i)
        v = ids[i]
        b = probe_jit(buckets, slot_ids, slot_tab, t, v, home_jit(t, v, mask))
        if buckets[b] < 0:
            new += 1
        s = slots[i]
        buckets[b] = s
        slot_ids[s] = v
        set_item(slot_tab, s, t)
    return new


@nb.njit(**JIT)
def delete_many_jit(buckets, slot_ids, slot_tab, tables, ids, out_slot):
    """Remove keys ``(tables[i], ids[i])``; ``out_slot[i]`` = the slot it held, or -1."""
    for i in range(ids.shape[0]):
        out_slot[i] = delete_jit(buckets, slot_ids, slot_tab, item(tables, i), ids[i])
    return out_slot


@nb.njit(**JIT)
def rehash_jit(buckets, slot_ids, slot_tab, n):
    """Fill an all -1 ``buckets`` with slots ``0..n-1`` (distinct keys)."""
    mask = nb.uint64(buckets.shape[0] - 1)
    for s in range(n):
        b = home_jit(item(slot_tab, s), slot_ids[s], mask)
        while buckets[b] >= 0:
            b = (b + _ONE) & mask
        buckets[b] = s


# ----------------------------------------------------------------------------- sizing
def bucket_count(max_keys: int) -> int:
    """Buckets for up to ``max_keys`` live keys at load <= 1/2: the least power of two
    >= ``2 * max_keys`` (at least 16)."""
    return 1 << max(4, int(2 * max_keys - 1).bit_length())


def new_buckets(max_keys: int, slot_ids: np.ndarray, slot_tab, n: int, dtype=np.int32) -> np.ndarray:
    """A bucket array for up to ``max_keys`` keys holding slots ``0..n-1`` (grow = rehash).

    Args:
        max_keys: keys the map must hold at load <= 1/2 (>= n).
        slot_ids: uint64 [S]; slot_tab: int [S] or one int (NOTE [key map]); n: slots in use.
        dtype: of the slots (int32 up to 2**31 - 1 slots, else int64).

    Returns:
        ``dtype`` [:func:`bucket_count` (max_keys)].
    """
    buckets = np.full(bucket_count(max(int(max_keys), int(n))), -1, dtype)
    rehash_jit(buckets, slot_ids, slot_tab, int(n))
    return buckets

"""Numba kernels of the key map: ``(table, uint64 id) -> dense slot``, and the batch CSR.

Split from :mod:`herald.scheduler.kernels` (same conventions: ``nogil``, preallocated
outputs). The lookup is software-pipelined: the bucket of the key ``_AHEAD1`` ahead and
the id of the slot found in the bucket of the key ``_AHEAD2`` ahead are prefetched, so
the random accesses of consecutive keys overlap. Slots are assigned in lookup order.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from herald.scheduler.kernels import JIT, key_hash_jit, prefetch_jit

_AHEAD1, _AHEAD2, _RING = 8, 4, 16  # pipeline distances (keys) and ring of hashes (a power of 2)


@nb.njit(inline="always", nogil=True, cache=True)
def _find_or_insert_jit(hk_slot, slot_ids, slot_tab, h, t, v, n, S, mask):
    """Slot of key (t, v) probing from bucket ``h``; a new key gets slot ``n`` (the next
    free one), or -1 when all ``S`` slots are taken."""
    while True:
        s = hk_slot[h]
        if s < 0:
            if n == S:
                return -1
            hk_slot[h] = n
            slot_ids[n] = v
            slot_tab[n] = t
            return n
        if slot_ids[s] == v and slot_tab[s] == t:
            return s
        h = (h + np.uint64(1)) & mask


@nb.njit(**JIT)
def keymap_lookup_jit(hk_slot, slot_ids, slot_tab, n_slots, tables, ids, out_slot):
    """Map keys to dense slots, inserting unseen keys (open addressing, linear probing).

    Args:
        hk_slot: int32 [H], H a power of two >= 2 S, -1 = empty.
        slot_ids: uint64 [S]; slot_tab: int16 [S]: the key of each slot.
        n_slots: int64 [1], number of slots in use (updated).
        tables: int16 [n]; ids: uint64 [n]; out_slot: int32 [n] (written).

    Returns:
        entries processed: fewer than n when a new key found all S slots in use (grow the
        arrays and call again on the rest).
    """
    mask = np.uint64(hk_slot.shape[0] - 1)
    S = slot_ids.shape[0]
    n = n_slots[0]
    m = ids.shape[0]
    ring = np.empty(_RING, np.uint64)  # hashes of the keys _AHEAD1 ahead (software pipeline)
    for i in range(min(_AHEAD1, m)):
        ring[i] = key_hash_jit(tables[i], ids[i]) & mask
        prefetch_jit(hk_slot, ring[i])
    for i in range(m):
        a = i + _AHEAD1
        if a < m:  # stage 1: hash and prefetch the bucket of key a
            ha = key_hash_jit(tables[a], ids[a]) & mask
            ring[a & (_RING - 1)] = ha
            prefetch_jit(hk_slot, ha)
        b = i + _AHEAD2
        if b < m:  # stage 2: the bucket of key b is near; prefetch its slot's id
            sb = hk_slot[ring[b & (_RING - 1)]]
            if sb >= 0:
                prefetch_jit(slot_ids, sb)
        s = _find_or_insert_jit(hk_slot, slot_ids, slot_tab, ring[i & (_RING - 1)], tables[i], ids[i], n, S, mask)
        if s < 0:  # the key state is full
            n_slots[0] = n
            return i
        out_slot[i] = s
        if s == n:
            n += 1
    n_slots[0] = n
    return m


@nb.njit(**JIT)
def keymap_rehash_jit(hk_slot, slot_ids, slot_tab, n):
    """Fill an all -1 ``hk_slot`` int32 [H] with slots ``0..n-1``."""
    mask = np.uint64(hk_slot.shape[0] - 1)
    for s in range(n):
        h = key_hash_jit(slot_tab[s], slot_ids[s]) & mask
        while hk_slot[h] >= 0:
            h = (h + np.uint64(1)) & mask
        hk_slot[h] = s


@nb.njit(**JIT)
def gather_samples_jit(offsets, value_base, slots_flat, out_off, out_slot, out_tab):
    """Sample-major CSR of a batch: sample ``i`` uses ``out_slot[out_off[i]:out_off[i+1]]``.

    Args:
        offsets: int64 [T, B+1] per-table offsets; value_base: int64 [T] start of table t
            in ``slots_flat`` int32 [nnz]. out_off int64 [B+1], out_slot int32 [nnz],
            out_tab int16 [nnz] (written; tables in order within a sample).
    """
    T = offsets.shape[0]
    B = offsets.shape[1] - 1
    out_off[0] = 0
    p = 0
    for i in range(B):
        for t in range(T):
            for j in range(offsets[t, i], offsets[t, i + 1]):
                out_slot[p] = slots_flat[value_base[t] + j]
                out_tab[p] = t
                p += 1
        out_off[i + 1] = p



@nb.njit(**JIT)
def keymap_lookup_tables_jit(hk_slot, slot_ids, slot_tab, n_slots, values, out_slot):
    """:func:`keymap_lookup_jit` over the per-table id arrays of a batch, without
    concatenating them: keys in table-major order (table 0's ids, then table 1's, ...).

    Args:
        values: tuple of T uint64 [nnz_t] arrays; out_slot: int32 [sum nnz_t] (written).
        Others as :func:`keymap_lookup_jit`.

    Returns:
        entries processed (table-major); fewer than ``out_slot.shape[0]`` when a new key
        found all slots in use (grow and finish the rest with :func:`keymap_lookup_jit`).
    """
    mask = np.uint64(hk_slot.shape[0] - 1)
    S = slot_ids.shape[0]
    n = n_slots[0]
    T = len(values)
    ring = np.empty(_RING, np.uint64)  # hashes of the keys up to _AHEAD1 ahead
    ta = 0  # (table, index) of the next key to hash (stage 1)
    ja = 0
    a = 0   # its table-major position
    i = 0
    for t in range(T):
        v_t = values[t]
        tt = np.int16(t)
        for j in range(v_t.shape[0]):
            while a < i + _AHEAD1 and ta < T:  # stage 1: hash and prefetch buckets ahead
                va = values[ta]
                if ja < va.shape[0]:
                    ha = key_hash_jit(np.int16(ta), va[ja]) & mask
                    ring[a & (_RING - 1)] = ha
                    prefetch_jit(hk_slot, ha)
                    ja += 1
                    a += 1
                else:
                    ta += 1
                    ja = 0
            b = i + _AHEAD2
            if b < a:  # stage 2: the bucket of key b is near; prefetch its slot's id
                sb = hk_slot[ring[b & (_RING - 1)]]
                if sb >= 0:
                    prefetch_jit(slot_ids, sb)
            s = _find_or_insert_jit(hk_slot, slot_ids, slot_tab, ring[i & (_RING - 1)], tt, v_t[j], n, S, mask)
            if s < 0:  # the key state is full
                n_slots[0] = n
                return i
            out_slot[i] = s
            if s == n:
                n += 1
            i += 1
    n_slots[0] = n
    return i


@nb.njit(**JIT)
def gather_samples_tables_jit(offsets, slots_flat, out_off, out_slot, out_tab):
    """:func:`gather_samples_jit` reading the per-table offsets of a batch directly.

    Args:
        offsets: tuple of T int64 [B+1] arrays; slots_flat: int32 [nnz] table-major.
        out_off int64 [B+1], out_slot int32 [nnz], out_tab int16 [nnz] (written).
    """
    T = len(offsets)
    B = out_off.shape[0] - 1
    out_off[:] = 0
    for t in range(T):  # sample lengths, then their prefix sums
        o = offsets[t]
        for i in range(B):
            out_off[i + 1] += o[i + 1] - o[i]
    for i in range(B):
        out_off[i + 1] += out_off[i]
    cur = out_off[:B].copy()  # next free position of each sample (tables in order)
    base = 0
    for t in range(T):
        o = offsets[t]
        tt = np.int16(t)
        for i in range(B):
            p = cur[i]
            for j in range(o[i], o[i + 1]):
                out_slot[p] = slots_flat[base + j]
                out_tab[p] = tt
                p += 1
            cur[i] = p
        base += o[B]

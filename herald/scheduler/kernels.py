"""Numba kernels of the scheduler: key map, allocation, cache snapshots, plan, accounting.

Pure functions over preallocated arrays; validation, allocation and
orchestration live in the Python modules around them. Every kernel is ``nogil``.

The cache-snapshot kernels (LRU lists, LFU heaps) are in
:mod:`herald.scheduler.snapshot_kernels`, the key collection and the after-step update in
:mod:`herald.scheduler.step_kernels` and the key map in
:mod:`herald.scheduler.keymap_kernels`, to keep each module small.

Shared vocabulary (see :mod:`herald.scheduler.state` for the arrays):

- slot: dense int32 index of a feature key ``(table, id)``, given by the key map.
- ``cached`` / ``valid`` uint64 [slots]: bit ``w`` set when worker ``w`` caches the key /
  caches it and its copy is latest (so ``num_workers <= 64``).
- ``owner`` int32 [slots]: the worker holding the only latest copy (dirty), or -1 when
  the PS copy is latest.
- ``use_mask`` uint64 [slots]: bit ``w`` set when worker ``w`` uses the key in the step
  being processed (only meaningful for that step's keys).
- counts int64 [W, 6] in the order of ``plan.CAUSES``.

Herald §4.3 Alg. 1 (allocation), §4.4 Alg. 2 (plan), NOTE [step protocol] in
:mod:`herald.contracts.plan` (docs/design.md, "Consistency protocol").
"""

from __future__ import annotations

from typing import TypedDict

import numba as nb
import numpy as np

from herald.keymap import prefetch_jit


class JitOptions(TypedDict, total=False):
    """The keyword options herald's kernels pass to ``numba.njit`` (typed for the type check)."""

    nogil: bool
    cache: bool
    parallel: bool


#: Every scheduler kernel's options: without the GIL, compiled once per installation.
JIT: JitOptions = {"nogil": True, "cache": True}
_AHEAD = 32  # keys ahead whose record is prefetched in the per-key passes

HIT, MISS_PULL, UPDATE_PULL, GRAD_PUSH, PLAN_PUSH, EVICT_PUSH = 0, 1, 2, 3, 4, 5

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DEBRUIJN_TABLE = np.array(
    [
        0,
        1,
        48,
        2,
        57,
        49,
        28,
        3,
        61,
        58,
        50,
        42,
        38,
        29,
        17,
        4,
        62,
        55,
        59,
        36,
        53,
        51,
        43,
        22,
        45,
        39,
        33,
        30,
        24,
        18,
        12,
        5,
        63,
        47,
        56,
        27,
        60,
        41,
        37,
        16,
        54,
        35,
        52,
        21,
        44,
        32,
        23,
        11,
        46,
        26,
        40,
        15,
        34,
        20,
        31,
        10,
        25,
        14,
        19,
        9,
        13,
        8,
        7,
        6,
    ],
    dtype=np.int64,
)


@nb.njit(**JIT)
def mix64_jit(z):
    """splitmix64 finalizer of a uint64."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@nb.njit(**JIT)
def rng_next_jit(state):
    """Next uint64 of the splitmix64 stream held in ``state`` uint64 [1] (advanced in place)."""
    state[0] += GOLDEN
    return mix64_jit(state[0])


@nb.njit(**JIT)
def lowbit_index_jit(m):
    """Index of the lowest set bit of a non-zero uint64."""
    low = m & (~m + np.uint64(1))
    return _DEBRUIJN_TABLE[np.int64((low * _DEBRUIJN) >> np.uint64(58))]


@nb.njit(**JIT)
def popcount_jit(m):
    n = 0
    while m:
        m &= m - np.uint64(1)
        n += 1
    return n


@nb.njit(inline="always", **JIT)
def add_copies_jit(score, m):
    """``score[w] += 1`` (float64 [W]) for every bit ``w`` of ``m`` (the workers holding a valid copy)."""
    while m:
        score[lowbit_index_jit(m)] += 1.0
        m &= m - np.uint64(1)


@nb.njit(inline="always", **JIT)
def repeats_table_jit(samp_tab, lo, hi):
    """Whether a table comes again among a sample's tables ``samp_tab[lo:hi]`` (int16, else
    ascending): keys of different tables differ, so only then can the sample repeat a key."""
    for p in range(lo + 1, hi):
        if samp_tab[p] <= samp_tab[p - 1]:
            return True
    return False


@nb.njit(**JIT)
def key_hash_jit(table, key):
    return mix64_jit(key ^ (np.uint64(table + 1) * GOLDEN))


# ----------------------------------------------------------------------------- allocation
@nb.njit(**JIT)
def random_alloc_jit(n, per_worker, rng, out_worker):
    """Random partition (vanilla, plan): Fisher-Yates permutation, chunk k -> worker k.

    out_worker int32 [n] (written).
    """
    perm = np.arange(n)
    for i in range(n - 1, 0, -1):
        j = np.int64(rng_next_jit(rng) % np.uint64(i + 1))
        tmp = perm[i]
        perm[i] = perm[j]
        perm[j] = tmp
    for k in range(n):
        out_worker[perm[k]] = k // per_worker


@nb.njit(**JIT)
def pick_jit(score, load, per_worker, ties, rng, maximize):
    """Best available worker by ``score`` (max or min); ties broken by one rng draw."""
    W = score.shape[0]
    nt = 0
    best = 0.0
    for w in range(W):
        if load[w] >= per_worker:
            continue
        s = score[w]
        if nt == 0 or (s > best if maximize else s < best):
            best = s
            nt = 0
        if s == best:
            ties[nt] = w
            nt += 1
    r = rng_next_jit(rng)
    return ties[np.int64(r % np.uint64(nt))]


@nb.njit(**JIT)
def laia_alloc_jit(
    samp_off, samp_slot, samp_tab, table_on, valid, mark, token, num_workers, per_worker, rng, out_worker
):
    """Static / adaptive LAIA (Herald Alg. 1): greedy in sample order, score = distinct
    keys of the sample (in enabled tables) valid in the worker's snapshot.

    Args:
        samp_off int64 [B+1], samp_slot int32 [nnz], samp_tab int16 [nnz]: the batch.
        table_on: bool [T], tables used for scoring (all for static LAIA).
        valid: uint64 [S]. mark: int32 [S] scratch; token: int64 [1] (advanced).
        rng: uint64 [1]; out_worker: int32 [B] (written).
    """
    score = np.zeros(num_workers, np.float64)
    load = np.zeros(num_workers, np.int64)
    ties = np.zeros(num_workers, np.int64)
    tok = token[0]
    nnz = samp_slot.shape[0]
    for i in range(samp_off.shape[0] - 1):
        score[:] = 0.0
        tok += 1
        lo = samp_off[i]
        hi = samp_off[i + 1]
        dedup = repeats_table_jit(samp_tab, lo, hi)
        for p in range(lo, hi):
            if p + _AHEAD < nnz:
                prefetch_jit(valid, samp_slot[p + _AHEAD])
            if not table_on[samp_tab[p]]:
                continue
            s = samp_slot[p]
            if dedup:
                if mark[s] == tok:
                    continue
                mark[s] = tok
            add_copies_jit(score, valid[s])
        w = pick_jit(score, load, per_worker, ties, rng, True)
        out_worker[i] = w
        load[w] += 1
    token[0] = tok


# one function: its per-sample loop state (tokens, loads, gains) stays in registers, as in the
# snapshot kernels, where helpers returning state cost 1.5x (docs/scheduler.md "Speed")
@nb.njit(**JIT)
def costaware_alloc_jit(
    samp_off,
    samp_slot,
    samp_tab,
    table_on,
    valid,
    owner,
    use_mask,
    bcount,
    mark,
    token,
    num_workers,
    per_worker,
    params,
    rng,
    out_worker,
):
    """Cost-aware greedy allocation ("costaware", ours; beyond Herald §4.3/§7).

    Gain of placing sample i on worker w, summed over its distinct keys e:
    ``params[0]`` if e is valid in w's snapshot (a pull saved); ``params[1]`` if w
    already uses e this step (the pull is shared; the key stays sole-user) and e is
    *containable* (used by at most ``params[4]`` samples of the batch), ``params[2]``
    if w uses e but it is not containable; minus ``params[3]`` if e is containable
    and another worker already uses it (sharing: gradient pushes and staleness); minus
    1 if another worker holds e dirty and nobody but it uses e yet (a plan push).
    Samples go in decreasing order of their best snapshot affinity when ``params[5]``
    > 0, else in index order. Ties: one rng draw per sample.

    Args as :func:`laia_alloc_jit`; owner int32 [S]; use_mask uint64 [S] and bcount int32
    [S] scratch (cleared for this batch's keys; use_mask ends holding the allocation's
    usage); params float64 [6].
    """
    B = samp_off.shape[0] - 1
    W = num_workers
    one = np.uint64(1)
    w_valid, w_inuse, w_inuse_hot, w_share, contain, sort_order = (
        params[0],
        params[1],
        params[2],
        params[3],
        params[4],
        params[5],
    )
    nnz = samp_slot.shape[0]
    for p in range(nnz):
        if p + _AHEAD < nnz:
            prefetch_jit(use_mask, samp_slot[p + _AHEAD])
            prefetch_jit(bcount, samp_slot[p + _AHEAD])
        use_mask[samp_slot[p]] = 0
        bcount[samp_slot[p]] = 0
    aff = np.zeros(W, np.float64)
    best_aff = np.zeros(B, np.float64)
    tok = token[0]
    for i in range(B):
        aff[:] = 0
        tok += 1
        for p in range(samp_off[i], samp_off[i + 1]):
            if p + _AHEAD < nnz:
                prefetch_jit(valid, samp_slot[p + _AHEAD])
            s = samp_slot[p]
            if mark[s] == tok:
                continue
            mark[s] = tok
            bcount[s] += 1
            if not table_on[samp_tab[p]]:
                continue
            m = valid[s]
            while m:
                aff[lowbit_index_jit(m)] += 1.0
                m &= m - one
        best_aff[i] = aff.max()
    if sort_order > 0:
        order = np.argsort(-best_aff, kind="mergesort")
    else:
        order = np.arange(B)
    gain = np.zeros(W, np.float64)
    load = np.zeros(W, np.int64)
    ties = np.zeros(W, np.int64)
    for oi in range(B):
        i = order[oi]
        if oi + 1 < B:  # the next sample's records
            i1 = order[oi + 1]
            for p in range(samp_off[i1], samp_off[i1 + 1]):
                prefetch_jit(valid, samp_slot[p])
        gain[:] = 0.0
        base = 0.0
        tok += 1
        for p in range(samp_off[i], samp_off[i + 1]):
            if not table_on[samp_tab[p]]:
                continue
            s = samp_slot[p]
            if mark[s] == tok:
                continue
            mark[s] = tok
            um = use_mask[s]
            containable = bcount[s] <= contain
            o = owner[s]
            if o >= 0 and (um & ~(one << np.uint64(o))) == 0:
                base -= 1.0  # plan push unless placed on the owner
                gain[o] += 1.0
            if um != 0 and containable:
                base -= w_share
            m = valid[s] & ~um
            while m:
                gain[lowbit_index_jit(m)] += w_valid
                m &= m - one
            m = um
            while m:
                w = lowbit_index_jit(m)
                gain[w] += (w_inuse if containable else w_inuse_hot) + (w_share if containable else 0.0)
                m &= m - one
        for w in range(W):
            gain[w] += base
        w = pick_jit(gain, load, per_worker, ties, rng, True)
        out_worker[i] = w
        load[w] += 1
        for p in range(samp_off[i], samp_off[i + 1]):
            use_mask[samp_slot[p]] |= one << np.uint64(w)
    token[0] = tok


@nb.njit(**JIT)
def doi_jit(freq, slot_tab, cached, n, threshold, num_tables, out_infrequent, out_total):
    """Table profiler (Herald §3.2, §4.3): per table, in-cache keys (cached by any worker)
    and those among them accessed fewer than ``threshold`` times (infrequent).

    out_infrequent / out_total int64 [T] (written).
    """
    out_infrequent[:] = 0
    out_total[:] = 0
    for s in range(n):
        if cached[s] != 0:
            t = slot_tab[s]
            out_total[t] += 1
            if freq[s] < threshold:
                out_infrequent[t] += 1

"""Numba kernels of the scheduler: key map, allocation, cache snapshots, plan, accounting.

Pure functions over preallocated arrays; validation, allocation and
orchestration live in the Python modules around them. Every kernel is ``nogil``.

The cache-snapshot kernels (LRU lists, LFU heaps) are in
:mod:`herald.scheduler.snapshot_kernels` and the key map in
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
:mod:`herald.scheduler.plan` (docs/design.md, "Consistency protocol").
"""

from __future__ import annotations

import numba as nb
import numpy as np

from herald.keymap import prefetch_jit

JIT = dict(nogil=True, cache=True)
_AHEAD = 32  # keys ahead whose record is prefetched in the per-key passes

HIT, MISS_PULL, UPDATE_PULL, GRAD_PUSH, PLAN_PUSH, EVICT_PUSH = 0, 1, 2, 3, 4, 5

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
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
    state[0] += _GOLDEN
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
    return mix64_jit(key ^ (np.uint64(table + 1) * _GOLDEN))


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
def _pick_jit(score, load, per_worker, ties, rng, maximize):
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
        w = _pick_jit(score, load, per_worker, ties, rng, True)
        out_worker[i] = w
        load[w] += 1
    token[0] = tok


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
        w = _pick_jit(gain, load, per_worker, ties, rng, True)
        out_worker[i] = w
        load[w] += 1
        for p in range(samp_off[i], samp_off[i + 1]):
            use_mask[samp_slot[p]] |= one << np.uint64(w)
    token[0] = tok


# ----------------------------------------------------------------------------- step keys
@nb.njit(**JIT)
def group_by_worker_jit(worker_of, out_order, out_start):
    """Samples grouped by worker, ascending within a worker (a stable counting sort: the
    same as ``np.argsort(worker_of, kind="stable")``).

    Args:
        worker_of: int32 [B] in ``0..W-1``; out_order: int64 [B]; out_start: int64 [W+1]
            (written: worker w's samples are ``out_order[out_start[w]:out_start[w+1]]``).
    """
    W = out_start.shape[0] - 1
    out_start[:] = 0
    for i in range(worker_of.shape[0]):
        out_start[worker_of[i] + 1] += 1
    for w in range(W):
        out_start[w + 1] += out_start[w]
    cur = out_start[:W].copy()
    for i in range(worker_of.shape[0]):
        w = worker_of[i]
        out_order[cur[w]] = i
        cur[w] += 1


@nb.njit(inline="always", **JIT)
def prefetch_next_sample_jit(batch, q, end, records):
    """Prefetch the entries of ``records`` (an array indexed by slot) of the keys of the
    sample after the ``q``-th of ``order``, when ``q + 1 < end``; ``batch`` as
    :func:`collect_keys_jit`'s."""
    samp_off, samp_slot, order, _ = batch
    if q + 1 < end:
        i1 = order[q + 1]
        for p in range(samp_off[i1], samp_off[i1 + 1]):
            prefetch_jit(records, samp_slot[p])


@nb.njit(**JIT)
def collect_keys_jit(batch, mark, token, use_mask, freq, owner, count_freq, clear_use, plan_push, out):
    """Distinct keys per worker in canonical order (samples in ``order``, tables, values),
    and, when ``plan_push``, the previous step's plan pushes (Herald Alg. 2; their order:
    docs/scheduler.md, "Exact semantics").

    Args:
        batch: ``(samp_off, samp_slot, order, wstart)``: the sample-major CSR (int64 [B+1],
            int32 [nnz]), ``order`` int64 [B] samples grouped by worker, ascending within
            a worker, and ``wstart`` int64 [W+1] group bounds in ``order``.
        use_mask: uint64 [S]: bit w set for K_w; zero on entry for these keys unless
            ``clear_use`` (then cleared first: an allocation used it as scratch).
        freq: int32 [S] popularity (+1 per sample occurrence; the table profiler), updated
            only when ``count_freq``.
        owner: int32 [S]; with ``plan_push``, every key of K_w held dirty by ``o != w`` is
            pushed once by ``o`` in this (worker, canonical) order and ``owner`` becomes
            -1: ``pp_slot`` / ``pp_worker`` int32 [nnz] (written).
        out: ``(out_keys int32 [nnz], out_off int64 [W+1], pp_slot, pp_worker)`` (written).

    Returns:
        the number of plan pushes.
    """
    samp_off, samp_slot, order, wstart = batch
    out_keys, out_off, pp_slot, pp_worker = out
    if clear_use:
        nnz = samp_slot.shape[0]
        for p in range(nnz):
            if p + _AHEAD < nnz:
                prefetch_jit(use_mask, samp_slot[p + _AHEAD])
            use_mask[samp_slot[p]] = 0
    W = wstart.shape[0] - 1
    tok = token[0]
    n = 0
    c = 0
    out_off[0] = 0
    for w in range(W):
        tok += 1
        bit = np.uint64(1) << np.uint64(w)
        for q in range(wstart[w], wstart[w + 1]):
            i = order[q]
            prefetch_next_sample_jit(batch, q, wstart[W], use_mask)
            for p in range(samp_off[i], samp_off[i + 1]):
                s = samp_slot[p]
                if count_freq:
                    freq[s] += 1
                if mark[s] != tok:
                    mark[s] = tok
                    out_keys[n] = s
                    n += 1
                    use_mask[s] |= bit
                    o = owner[s]
                    if plan_push and o >= 0 and o != w:
                        pp_slot[c] = s
                        pp_worker[c] = o
                        owner[s] = -1
                        c += 1
        out_off[w + 1] = n
    token[0] = tok
    return c


@nb.njit(**JIT)
def update_after_step_jit(keys, off, use_mask, valid, owner, full_sync, upd):
    """After backward (NOTE [step protocol], steps 4-5): gradient pushes, local updates, new validity.

    Per worker ``w``, in canonical order of K_w: keys used by >= 2 workers (or every key
    under full-set sync) go to ``grad_push`` with contributors = |U(e)|; sole-user keys
    go to ``update_local``. ``upd`` = ``(gp_slot, gp_contrib, ul_slot, gp_cnt, ul_cnt)``:
    the lists are written at ``off[w] + i`` (int32 / uint16 / int32 arrays [nnz]), their
    counts in ``gp_cnt`` / ``ul_cnt`` int64 [W]. Then: sole-user keys are valid
    only at their user, which owns them (dirty) unless full sync; shared keys are stale
    everywhere and latest at the PS. The last user (highest worker) of a key clears its
    ``use_mask`` (workers are visited in rank order).
    """
    for w in range(off.shape[0] - 1):
        update_worker_jit(w, keys, off, use_mask, valid, owner, full_sync, upd, True)


@nb.njit(**JIT)
def update_worker_jit(w, keys, off, use_mask, valid, owner, full_sync, upd, clear_use):
    """Worker w's part of :func:`update_after_step_jit`. Every user of a key writes the
    same new ``valid`` / ``owner``, so workers may run on several threads; then
    ``clear_use`` must be False (a user clearing ``use_mask`` while another still reads
    it) and ``use_mask`` is cleared after all of them (:mod:`herald.scheduler.parallel_kernels`)."""
    gp_slot, gp_contrib, ul_slot, gp_cnt, ul_cnt = upd
    g = off[w]
    u = off[w]
    hi = off[w + 1]
    for i in range(off[w], hi):  # one pass: lists, then the key's new state (same for every user)
        if i + _AHEAD < hi:
            prefetch_jit(use_mask, keys[i + _AHEAD])
        s = keys[i]
        um = use_mask[s]
        n = popcount_jit(um)
        if n >= 2 or full_sync:
            gp_slot[g] = s
            gp_contrib[g] = n
            g += 1
        if n == 1:
            ul_slot[u] = s
            u += 1
            valid[s] = um
            owner[s] = -1 if full_sync else w
        else:
            valid[s] = 0
            owner[s] = -1
        if clear_use and (um >> np.uint64(w)) == np.uint64(1):  # w is its last user: use_mask
            use_mask[s] = 0  # holds no state between steps
    gp_cnt[w] = g - off[w]
    ul_cnt[w] = u - off[w]


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

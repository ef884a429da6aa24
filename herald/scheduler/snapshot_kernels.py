"""Numba kernels of the cache snapshots: the before-forward part of a step (DESIGN step 1).

Split from :mod:`herald.scheduler.kernels` (same conventions: ``nogil``, preallocated
outputs, counts int64 [W, 6] in ``plan.CAUSES`` order). Worker caches executing the
plans hold exactly what these kernels record (NOTE [step protocol], plan.py).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from herald.scheduler.kernels import EVICT_PUSH, HIT, JIT, MISS_PULL, UPDATE_PULL

# Both cache policies share one step semantics (tests/scheduler/reference.py mirrors it):
# 1. hits and stale copies of K_w are touched in canonical order (LRU: become most
#    recent; LFU: count += 1), 2. victims are the least recent (LRU) / least
#    (count, recency) (LFU) cached keys outside K_w, in that order, 3. misses are
#    inserted in canonical order (LFU count 1). The pull list is K_w's stale or missing
#    keys in canonical order.
_COUNT_SHIFT = np.int64(40)
_COUNT_MAX = np.int64((1 << 23) - 1)


@nb.njit(**JIT)
def _lru_compact_jit(w, log, pos, head, tail):
    """Drop stale entries of worker w's LRU log, keeping order; positions renumbered."""
    j = 0
    for i in range(head[w], tail[w]):
        s = log[w, i]
        if pos[s, w] == i:
            log[w, j] = s
            pos[s, w] = j
            j += 1
    head[w] = 0
    tail[w] = j


@nb.njit(**JIT)
def _lru_append_jit(w, s, log, pos, head, tail):
    """Make ``s`` the most recent key of worker w (its older entry becomes stale)."""
    if tail[w] == log.shape[1]:
        _lru_compact_jit(w, log, pos, head, tail)
    t = tail[w]
    log[w, t] = s
    pos[s, w] = t
    tail[w] = t + 1


@nb.njit(**JIT)
def _evict_record_jit(w, s, cached, valid, owner, ev_slot, ev_wb, e, counts):
    bit = np.uint64(1) << np.uint64(w)
    cached[s] &= ~bit
    valid[s] &= ~bit
    wb = owner[s] == w
    if wb:
        owner[s] = -1
        counts[w, EVICT_PUSH] += 1
    ev_slot[e] = s
    ev_wb[e] = wb


@nb.njit(**JIT)
def snapshot_lru_step_jit(keys, off, cached, valid, owner, cap, pos, log, head, tail, size,
                          ev_slot, ev_wb, ev_cnt, pull_slot, pull_cnt, counts, err):
    """Before-forward part of a step (DESIGN step 1) for LRU snapshots.

    Per worker: touch, evict (write-back when the victim is the only latest copy), pull.
    LRU order per worker is an append-only log ``log`` int32 [W, L] (L > C) of slots,
    oldest first from ``head[w]`` to ``tail[w]`` (int64 [W]); ``pos`` int32 [S, W] is the
    log index of a cached key's live entry (else -1); an entry whose slot's ``pos`` points
    elsewhere is stale and skipped; a full log is compacted in place (amortised O(1)).
    Touches and inserts are sequential writes; only victims cost a random access.
    Outputs at ``off[w] + i``: ev_slot int32, ev_wb bool, pull_slot int32; ev_cnt /
    pull_cnt int64 [W]. err int64 [2]: (1, w) if |K_w| > cap, (2, w) if a pull found the
    PS copy not latest (a protocol bug); state is then partially updated.
    """
    W = off.shape[0] - 1
    for w in range(W):
        lo = off[w]
        hi = off[w + 1]
        if hi - lo > cap:
            err[0] = 1
            err[1] = w
            return
        bit = np.uint64(1) << np.uint64(w)
        miss = 0
        for i in range(lo, hi):  # count and touch in canonical order
            s = keys[i]
            if cached[s] & bit:
                counts[w, HIT if valid[s] & bit else UPDATE_PULL] += 1
                _lru_append_jit(w, s, log, pos, head, tail)
            else:
                miss += 1
        counts[w, MISS_PULL] += miss
        need = size[w] + miss - cap
        e = lo
        while need > 0:
            j = head[w]
            head[w] = j + 1
            s = log[w, j]
            if pos[s, w] != j:
                continue
            pos[s, w] = -1
            size[w] -= 1
            _evict_record_jit(w, s, cached, valid, owner, ev_slot, ev_wb, e, counts)
            e += 1
            need -= 1
        ev_cnt[w] = e - lo
        pc = lo
        for i in range(lo, hi):
            s = keys[i]
            if (valid[s] & bit) == 0:
                if owner[s] >= 0:
                    err[0] = 2
                    err[1] = w
                    return
                if (cached[s] & bit) == 0:
                    _lru_append_jit(w, s, log, pos, head, tail)
                    size[w] += 1
                    cached[s] |= bit
                valid[s] |= bit
                pull_slot[pc] = s
                pc += 1
        pull_cnt[w] = pc - lo


@nb.njit(**JIT)
def _heap_swap_jit(w, i, j, hslot, hprio, pos):
    si = hslot[w, i]
    sj = hslot[w, j]
    pi = hprio[w, i]
    hslot[w, i] = sj
    hprio[w, i] = hprio[w, j]
    hslot[w, j] = si
    hprio[w, j] = pi
    pos[sj, w] = i
    pos[si, w] = j


@nb.njit(**JIT)
def _heap_up_jit(w, i, hslot, hprio, pos):
    while i > 0:
        p = (i - 1) >> 1
        if hprio[w, p] <= hprio[w, i]:
            break
        _heap_swap_jit(w, i, p, hslot, hprio, pos)
        i = p


@nb.njit(**JIT)
def _heap_down_jit(w, i, n, hslot, hprio, pos):
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and hprio[w, c + 1] < hprio[w, c]:
            c += 1
        if hprio[w, i] <= hprio[w, c]:
            break
        _heap_swap_jit(w, i, c, hslot, hprio, pos)
        i = c


@nb.njit(**JIT)
def _heap_push_jit(w, s, prio, hslot, hprio, pos, size):
    i = size[w]
    hslot[w, i] = s
    hprio[w, i] = prio
    pos[s, w] = i
    size[w] += 1
    _heap_up_jit(w, i, hslot, hprio, pos)


@nb.njit(**JIT)
def _heap_pop_jit(w, hslot, hprio, pos, size):
    s = hslot[w, 0]
    pr = hprio[w, 0]
    size[w] -= 1
    last = size[w]
    if last > 0:
        _heap_swap_jit(w, 0, last, hslot, hprio, pos)
        _heap_down_jit(w, 0, last, hslot, hprio, pos)
    pos[s, w] = -1
    return s, pr


@nb.njit(**JIT)
def snapshot_lfu_step_jit(keys, off, use_mask, cached, valid, owner, cap, pos, hslot, hprio,
                          size, seq, ev_slot, ev_wb, ev_cnt, pull_slot, pull_cnt, counts, err):
    """As :func:`snapshot_lru_step_jit` for LFU snapshots (HET §4.3).

    Priority int64 = count << 40 | recency seq (per worker, int64 [W]); min-heap per
    worker hslot int32 / hprio int64 [W, C]; pos int32 [S, W] heap index (else -1).
    Victims are popped in priority order, skipping keys of K_w (use_mask bit w), which
    are pushed back with their priority.
    """
    W = off.shape[0] - 1
    aside_s = np.empty(cap + 1, np.int32)
    aside_p = np.empty(cap + 1, np.int64)
    for w in range(W):
        lo = off[w]
        hi = off[w + 1]
        if hi - lo > cap:
            err[0] = 1
            err[1] = w
            return
        bit = np.uint64(1) << np.uint64(w)
        miss = 0
        for i in range(lo, hi):  # count and touch in canonical order
            s = keys[i]
            if (cached[s] & bit) == 0:
                miss += 1
            else:
                counts[w, HIT if valid[s] & bit else UPDATE_PULL] += 1
                j = pos[s, w]
                cnt = min((hprio[w, j] >> _COUNT_SHIFT) + 1, _COUNT_MAX)
                seq[w] += 1
                hprio[w, j] = (cnt << _COUNT_SHIFT) | seq[w]
                _heap_down_jit(w, j, size[w], hslot, hprio, pos)
        counts[w, MISS_PULL] += miss
        need = size[w] + miss - cap
        e = lo
        na = 0
        while need > 0:
            s, pr = _heap_pop_jit(w, hslot, hprio, pos, size)
            if use_mask[s] & bit:
                aside_s[na] = s
                aside_p[na] = pr
                na += 1
                continue
            _evict_record_jit(w, s, cached, valid, owner, ev_slot, ev_wb, e, counts)
            e += 1
            need -= 1
        for a in range(na):
            _heap_push_jit(w, aside_s[a], aside_p[a], hslot, hprio, pos, size)
        ev_cnt[w] = e - lo
        pc = lo
        for i in range(lo, hi):
            s = keys[i]
            if (valid[s] & bit) == 0:
                if owner[s] >= 0:
                    err[0] = 2
                    err[1] = w
                    return
                if (cached[s] & bit) == 0:
                    seq[w] += 1
                    _heap_push_jit(w, s, (np.int64(1) << _COUNT_SHIFT) | seq[w], hslot, hprio,
                                   pos, size)
                    cached[s] |= bit
                valid[s] |= bit
                pull_slot[pc] = s
                pc += 1
        pull_cnt[w] = pc - lo



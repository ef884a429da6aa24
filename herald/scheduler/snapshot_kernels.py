"""Numba kernels of the cache snapshots: the before-forward part of a step (NOTE [step protocol], steps 1-2).

Split from :mod:`herald.scheduler.kernels` (same conventions: ``nogil``, preallocated
outputs, counts int64 [W, 6] in ``plan.CAUSES`` order). Worker caches executing the
plans hold exactly what these kernels record (NOTE [step protocol], plan.py).

The work of one worker is one function (``lru_worker_jit``, ``lfu_worker_jit``); the
step kernels run them in rank order, :mod:`herald.scheduler.parallel_kernels` on several
threads (Herald §4.4, "Multi-threading"). Worker ``w`` reads and writes only bit ``w`` of
the shared masks, its own column of ``pos`` and its own LRU log / LFU heap, and changes
``owner`` only of its victims that it owns; with ``par`` the mask updates are atomic
(:mod:`herald.scheduler.atomics`), so the threads' results equal the serial ones.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from herald.scheduler.atomics import atomic_and_jit, atomic_or_jit
from herald.scheduler.kernels import EVICT_PUSH, HIT, JIT, MISS_PULL, UPDATE_PULL, prefetch_jit

# Both cache policies share one step semantics (tests/scheduler/reference.py mirrors it):
# 1. hits and stale copies of K_w are touched in canonical order (LRU: become most
#    recent; LFU: count += 1), 2. victims are the least recent (LRU) / least
#    (count, recency) (LFU) cached keys outside K_w, in that order, 3. misses are
#    inserted in canonical order (LFU count 1). The pull list is K_w's stale or missing
#    keys in canonical order.
_COUNT_SHIFT = np.int64(40)
_COUNT_MAX = np.int64((1 << 23) - 1)
_PREFETCH = 16  # LRU victims whose records are prefetched ahead of the eviction
#: the arrays of the tuples the step kernels take (:class:`herald.scheduler.state.Snapshots`'
#: names): a worker's state of each policy, and the outputs of a step's before-forward part
LRU_STATE = ("cached", "valid", "owner", "pos", "log", "head", "tail", "size")
LFU_STATE = ("cached", "valid", "owner", "pos", "hslot", "hprio", "size", "seq")
STEP_OUTPUTS = ("ev_slot", "ev_wb", "ev_cnt", "pull_slot", "pull_cnt", "counts")


@nb.njit(**JIT)
def _lru_compact_jit(w, log, pos, hd, t):
    """Drop the stale entries (-1) of worker w's LRU log ``[hd, t)``, keeping order, and
    renumber positions; returns the new tail (the head becomes 0). Reads the log
    sequentially; the position writes are on no branch, so their misses overlap."""
    j = 0
    for i in range(hd, t):
        s = log[w, i]
        if s >= 0:
            log[w, j] = s
            pos[s, w] = j
            j += 1
    return j


# the compaction check stays at the two call sites: an inline helper returning the new
# (head, tail) pair made the LRU pass ~1.5x slower (the pair left the registers)
@nb.njit(inline="always", **JIT)
def _lru_push_jit(w, s, log, pos, t):
    """Put ``s`` at entry ``t`` of worker w's LRU log and record its position; returns the new tail."""
    log[w, t] = s
    pos[s, w] = t
    return t + 1


@nb.njit(**JIT)
def _evict_record_jit(w, s, cached, valid, owner, ev_slot, ev_wb, e, par):
    """Drop ``s`` from worker w's snapshot (branch-free unless ``par``); returns True if
    its copy was the only latest one (a write-back). With ``par`` the mask updates are
    atomic and ``owner`` is written only when it was ``w`` (another thread may own it)."""
    keep = ~(np.uint64(1) << np.uint64(w))
    o = owner[s]
    wb = o == w
    if par:
        atomic_and_jit(cached, s, keep)
        atomic_and_jit(valid, s, keep)
        if wb:
            owner[s] = -1
    else:
        cached[s] &= keep
        valid[s] &= keep
        owner[s] = -1 if wb else o
    ev_slot[e] = s
    ev_wb[e] = wb
    return wb


@nb.njit(inline="always", **JIT)
def _worker_keys_jit(w, off):
    """Worker w's keys ``keys[lo:hi]`` of the step and its bit: ``(lo, hi, bit)``."""
    return off[w], off[w + 1], np.uint64(1) << np.uint64(w)


@nb.njit(inline="always", **JIT)
def _set_bit_jit(mask, s, bit, par):
    """``mask[s] |= bit`` (atomic with ``par``)."""
    if par:
        atomic_or_jit(mask, s, bit)
    else:
        mask[s] |= bit


@nb.njit(**JIT)
def snapshot_lru_step_jit(keys, off, cap, lru, out, err):
    """Before-forward part of a step (NOTE [step protocol], steps 1-2) for LRU snapshots.

    Per worker: touch, evict (write-back when the victim is the only latest copy), pull.
    ``lru`` = ``(cached, valid, owner, pos, log, head, tail, size)`` (:data:`LRU_STATE`) and
    ``out`` = ``(ev_slot, ev_wb, ev_cnt, pull_slot, pull_cnt, counts)`` (:data:`STEP_OUTPUTS`).
    LRU order per worker is an append-only log ``log`` int32 [W, L] (L > 2C) of slots,
    oldest first from ``head[w]`` to ``tail[w]`` (int64 [W]), used up to
    ``L - w C / W`` entries (different lengths: workers filling at the same rate would
    otherwise all compact in the same step, a latency spike); ``pos`` int32 [S, W] is the
    log index of a cached key's live entry (else -1); a touch overwrites the key's older
    entry with -1 (stale, skipped); a full log is compacted in place (amortised O(1)).
    Touches and inserts are sequential writes; only victims cost a random access, and
    their records are prefetched ``_PREFETCH`` entries ahead. Head, tail, size and the
    counters live in registers within a worker (the reason ``lru_worker_jit`` is one
    function of ~80 lines: through arrays they cost 3x, docs/scheduler.md "Speed").
    Outputs at ``off[w] + i``: ev_slot int32, ev_wb bool, pull_slot int32; ev_cnt /
    pull_cnt int64 [W]. err int64 [2]: (1, w) if |K_w| > cap, (2, w) if a pull found the
    PS copy not latest (a protocol bug); state is then partially updated.
    """
    W = off.shape[0] - 1
    for w in range(W):
        code = lru_worker_jit(w, W, keys, off, cap, lru, out, False)
        if code != 0:
            err[0] = code
            err[1] = w
            return


# one function of ~80 lines: head, tail, size and the counters stay in registers (through
# arrays or helper calls they cost 3x, docs/scheduler.md "Speed")
@nb.njit(**JIT)
def lru_worker_jit(w, W, keys, off, cap, lru, out, par):
    """Worker w's part of :func:`snapshot_lru_step_jit`; returns its error code (0: none).
    ``par``: other threads run other workers at the same time (atomic mask updates)."""
    cached, valid, owner, pos, log, head, tail, size = lru
    ev_slot, ev_wb, ev_cnt, pull_slot, pull_cnt, counts = out
    lo, hi, bit = _worker_keys_jit(w, off)
    if hi - lo > cap:
        return 1
    L = log.shape[1] - (w * cap) // W  # staggered: workers do not all compact in one step
    hd = head[w]
    t = tail[w]
    hit = 0
    upd = 0
    miss = 0
    pc = lo  # pulls: stale or missing keys of K_w in canonical order
    for i in range(lo, hi):  # count and touch in canonical order
        if i + _PREFETCH < hi:
            prefetch_jit(cached, keys[i + _PREFETCH])
        s = keys[i]
        if cached[s] & bit:
            if valid[s] & bit:
                hit += 1
            else:
                upd += 1
                pull_slot[pc] = s
                pc += 1
            log[w, pos[s, w]] = -1  # the older entry is stale
            if t == L:
                t = _lru_compact_jit(w, log, pos, hd, t)
                hd = 0
            t = _lru_push_jit(w, s, log, pos, t)
        else:
            miss += 1
            pull_slot[pc] = s
            pc += 1
    counts[w, HIT] += hit
    counts[w, UPDATE_PULL] += upd
    counts[w, MISS_PULL] += miss
    sz = size[w]
    need = sz + miss - cap
    e = lo
    wbs = 0
    pf = hd
    while need > 0:
        s = log[w, hd]
        hd += 1
        if s < 0:
            continue
        while pf < t and pf < hd + _PREFETCH:  # victims' records, ahead
            if log[w, pf] >= 0:
                prefetch_jit(cached, log[w, pf])
            pf += 1
        pos[s, w] = -1
        sz -= 1
        wbs += _evict_record_jit(w, s, cached, valid, owner, ev_slot, ev_wb, e, par)
        e += 1
        need -= 1
    counts[w, EVICT_PUSH] += wbs
    ev_cnt[w] = e - lo
    # victims are never keys of K_w, so the pull list of the touch pass stands: insert
    # its missing keys in that (canonical) order; hits are not visited again
    code = 0
    for i in range(lo, pc):
        s = pull_slot[i]
        if owner[s] >= 0:
            code = 2
            pc = i
            break
        if (cached[s] & bit) == 0:
            if t == L:
                t = _lru_compact_jit(w, log, pos, hd, t)
                hd = 0
            t = _lru_push_jit(w, s, log, pos, t)
            sz += 1
            _set_bit_jit(cached, s, bit, par)
        _set_bit_jit(valid, s, bit, par)
    pull_cnt[w] = pc - lo
    head[w] = hd
    tail[w] = t
    size[w] = sz
    return code


@nb.njit(**JIT)
def _heap_place_jit(w, i, s, prio, hslot, hprio, pos):
    hslot[w, i] = s
    hprio[w, i] = prio
    pos[s, w] = i


@nb.njit(**JIT)
def _heap_up_jit(w, i, s, prio, hslot, hprio, pos):
    """Sift ``(s, prio)`` up from the hole at ``i`` (one position write per level)."""
    while i > 0:
        p = (i - 1) >> 1
        if hprio[w, p] <= prio:
            break
        _heap_place_jit(w, i, hslot[w, p], hprio[w, p], hslot, hprio, pos)
        i = p
    _heap_place_jit(w, i, s, prio, hslot, hprio, pos)


@nb.njit(**JIT)
def _heap_down_jit(w, i, n, s, prio, hslot, hprio, pos):
    """Sift ``(s, prio)`` down from the hole at ``i`` in a heap of ``n`` entries (the same
    moves as swapping, with one position write per level)."""
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and hprio[w, c + 1] < hprio[w, c]:
            c += 1
        if prio <= hprio[w, c]:
            break
        _heap_place_jit(w, i, hslot[w, c], hprio[w, c], hslot, hprio, pos)
        i = c
    _heap_place_jit(w, i, s, prio, hslot, hprio, pos)


@nb.njit(**JIT)
def _heap_push_jit(w, s, prio, hslot, hprio, pos, n):
    """Push into worker w's heap of ``n`` entries; returns the new size."""
    _heap_up_jit(w, n, s, prio, hslot, hprio, pos)
    return n + 1


@nb.njit(**JIT)
def _heap_pop_jit(w, hslot, hprio, pos, n):
    """Pop the minimum of worker w's heap of ``n`` entries: ``(slot, prio, new size)``."""
    s = hslot[w, 0]
    pr = hprio[w, 0]
    last = n - 1
    if last > 0:
        _heap_down_jit(w, 0, last, hslot[w, last], hprio[w, last], hslot, hprio, pos)
    pos[s, w] = -1
    return s, pr, last


@nb.njit(**JIT)
def snapshot_lfu_step_jit(keys, off, use_mask, cap, lfu, out, err):
    """As :func:`snapshot_lru_step_jit` for LFU snapshots (HET §4.3).

    ``lfu`` = ``(cached, valid, owner, pos, hslot, hprio, size, seq)`` (:data:`LFU_STATE`).
    Priority int64 = count << 40 | recency seq (per worker, int64 [W]); min-heap per
    worker hslot int32 / hprio int64 [W, C]; pos int32 [S, W] heap index (else -1).
    Victims are popped in priority order, skipping keys of K_w (use_mask bit w), which
    are pushed back with their priority. Sizes, sequences and counters live in registers
    within a worker.
    """
    W = off.shape[0] - 1
    aside_s = np.empty(cap + 1, np.int32)
    aside_p = np.empty(cap + 1, np.int64)
    for w in range(W):
        code = lfu_worker_jit(w, keys, off, use_mask, cap, lfu, out, aside_s, aside_p, False)
        if code != 0:
            err[0] = code
            err[1] = w
            return


@nb.njit(**JIT)
def _lfu_evict_jit(w, need, e, bit, use_mask, lfu, ev_slot, ev_wb, aside_s, aside_p, n, par):
    """Evict ``need`` victims from worker w's heap of ``n`` entries, least priority first,
    into ``ev_slot`` / ``ev_wb`` from index ``e`` on; keys of K_w (``use_mask`` & ``bit``)
    popped on the way are set aside in ``aside_s`` / ``aside_p`` and pushed back with their
    priority. Returns ``(e after the last victim, the heap's new size, write-backs)``."""
    cached, valid, owner, pos, hslot, hprio, _, _ = lfu
    na = 0
    wbs = 0
    while need > 0:
        s, pr, n = _heap_pop_jit(w, hslot, hprio, pos, n)
        if use_mask[s] & bit:
            aside_s[na] = s
            aside_p[na] = pr
            na += 1
            continue
        wbs += _evict_record_jit(w, s, cached, valid, owner, ev_slot, ev_wb, e, par)
        e += 1
        need -= 1
    for a in range(na):
        n = _heap_push_jit(w, aside_s[a], aside_p[a], hslot, hprio, pos, n)
    return e, n, wbs


# the touch and insert passes stay in one function, as lru_worker_jit's: the size, sequence
# and counters stay in registers; the eviction, once per worker and step, is its own
@nb.njit(**JIT)
def lfu_worker_jit(w, keys, off, use_mask, cap, lfu, out, aside_s, aside_p, par):
    """Worker w's part of :func:`snapshot_lfu_step_jit` (``aside_s`` int32 / ``aside_p``
    int64 [cap + 1]: scratch of this thread); returns its error code (0: none)."""
    cached, valid, owner, pos, hslot, hprio, size, seq = lfu
    ev_slot, ev_wb, ev_cnt, pull_slot, pull_cnt, counts = out
    lo, hi, bit = _worker_keys_jit(w, off)
    if hi - lo > cap:
        return 1
    n = size[w]
    sq = seq[w]
    hit = 0
    upd = 0
    miss = 0
    for i in range(lo, hi):  # count and touch in canonical order
        s = keys[i]
        if (cached[s] & bit) == 0:
            miss += 1
        else:
            if valid[s] & bit:
                hit += 1
            else:
                upd += 1
            j = pos[s, w]
            cnt = min((hprio[w, j] >> _COUNT_SHIFT) + 1, _COUNT_MAX)
            sq += 1
            _heap_down_jit(w, j, n, s, (cnt << _COUNT_SHIFT) | sq, hslot, hprio, pos)
    counts[w, HIT] += hit
    counts[w, UPDATE_PULL] += upd
    counts[w, MISS_PULL] += miss
    e, n, wbs = _lfu_evict_jit(w, n + miss - cap, lo, bit, use_mask, lfu, ev_slot, ev_wb, aside_s, aside_p, n, par)
    counts[w, EVICT_PUSH] += wbs
    ev_cnt[w] = e - lo
    pc = lo
    code = 0
    for i in range(lo, hi):
        s = keys[i]
        if (valid[s] & bit) == 0:
            if owner[s] >= 0:
                code = 2
                break
            if (cached[s] & bit) == 0:
                sq += 1
                n = _heap_push_jit(w, s, (np.int64(1) << _COUNT_SHIFT) | sq, hslot, hprio, pos, n)
                _set_bit_jit(cached, s, bit, par)
            _set_bit_jit(valid, s, bit, par)
            pull_slot[pc] = s
            pc += 1
    pull_cnt[w] = pc - lo
    size[w] = n
    seq[w] = sq
    return code

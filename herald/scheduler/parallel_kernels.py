"""The scheduler's passes on several threads (Herald §4.4, "Multi-threading").

Herald runs scoring, the cache-snapshot updates and the communication plan on a thread
pool and keeps the worker allocation (the greedy choice, Herald Alg. 1 lines 8-12) on one
thread, or, optionally, splits it lock-free. These are numba ``prange`` kernels
(``parallel=True``, ``nogil``): each splits its loop into ``nchunks`` contiguous chunks
(``nchunks`` = the scheduler's threads), and a chunk works on its own samples, keys or
workers. Every kernel gives exactly the result of the serial kernel it replaces
(``tests/scheduler/test_parallel.py``), for any ``nchunks``:

- key lookup (per table): a read-only lookup in parallel, then the missing keys are
  inserted on one thread in table-major order (the serial slot numbering);
- batch CSR (per sample chunk); LAIA scoring (per sample chunk: the score of a sample
  depends only on the snapshots, not on the other samples' placement), then the greedy
  choice on one thread with the same random draws;
- key collection, cache snapshots, after-step update and plan keys (per worker): worker
  ``w`` changes only bit ``w`` of the shared per-key masks, atomically
  (:mod:`herald.scheduler.atomics`); a plan push is found by the lowest-ranked user other
  than the owner (the serial rule) from the complete ``use_mask``; the after-step update
  writes the same new state from every user, and ``use_mask`` is cleared after it.

The lock-free allocation (:func:`laia_pick_lockfree_par_jit`) is the one kernel whose
result differs from the serial one (see there).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import prange

from herald.keymap import find_many_jit
from herald.scheduler.atomics import atomic_add_jit, atomic_or_jit
from herald.scheduler.kernels import (
    GOLDEN,
    JitOptions,
    add_copies_jit,
    lowbit_index_jit,
    pick_jit,
    prefetch_jit,
    repeats_table_jit,
)
from herald.scheduler.plan_build import copy_worker_lists_jit, plan_bounds_jit, scatter_plan_pushes_jit
from herald.scheduler.snapshot_kernels import lfu_worker_jit, lru_worker_jit
from herald.scheduler.step_kernels import update_worker_jit

PJIT: JitOptions = {"nogil": True, "cache": True, "parallel": True}
_AHEAD = 32  # keys ahead whose record is prefetched (as in kernels.py)


@nb.njit(inline="always")
def _chunk(c, n, nchunks):
    """Bounds of chunk ``c`` of ``range(n)`` split into ``nchunks`` contiguous chunks."""
    return c * n // nchunks, (c + 1) * n // nchunks


# ----------------------------------------------------------------------------- key lookup, CSR
@nb.njit(**PJIT)
def find_tables_par_jit(buckets, slot_ids, slot_tab, values, starts, out_slot):
    """Read-only lookup of a batch's keys, one table per iteration: ``out_slot[starts[t] + j]``
    = slot of ``(t, values[t][j])`` or -1 (then insert with
    :func:`herald.scheduler.keymap_kernels.insert_missing_tables_jit`).

    Args: the map (NOTE [key map]); values: tuple of T uint64 arrays; starts: int64 [T+1]
    table-major bounds; out_slot: int32 [nnz] (written). Returns the keys found.
    """
    found = 0
    for t in prange(len(values)):
        found += find_many_jit(buckets, slot_ids, slot_tab, t, values[t], out_slot[starts[t] : starts[t + 1]])
    return found


@nb.njit(**PJIT)
def gather_samples_tables_par_jit(offsets, slots_flat, out_off, out_slot, out_tab, nchunks):
    """:func:`herald.scheduler.keymap_kernels.gather_samples_tables_jit` by sample chunks
    (same arguments, plus ``nchunks``)."""
    T = len(offsets)
    B = out_off.shape[0] - 1
    base = np.zeros(T, np.int64)
    for t in range(1, T):
        base[t] = base[t - 1] + offsets[t - 1][B]
    out_off[:] = 0
    for c in prange(nchunks):
        lo, hi = _chunk(c, B, nchunks)
        for t in range(T):  # a table's array once per chunk (a tuple index is a switch)
            o = offsets[t]
            for i in range(lo, hi):
                out_off[i + 1] += o[i + 1] - o[i]
    for i in range(B):
        out_off[i + 1] += out_off[i]
    for c in prange(nchunks):
        lo, hi = _chunk(c, B, nchunks)
        cur = out_off[lo:hi].copy()
        for t in range(T):
            o = offsets[t]
            b = base[t]
            tt = np.int16(t)
            for i in range(lo, hi):
                p = cur[i - lo]
                for j in range(o[i], o[i + 1]):
                    out_slot[p] = slots_flat[b + j]
                    out_tab[p] = tt
                    p += 1
                cur[i - lo] = p


# ----------------------------------------------------------------------------- LAIA
@nb.njit(**PJIT)
def laia_scores_par_jit(samp_off, samp_slot, samp_tab, table_on, valid, nchunks, out_score):
    """LAIA scores (Herald Alg. 1 lines 4-7) of every sample: ``out_score[i, w]`` float64
    [B, W] (written) = distinct keys of sample i in enabled tables valid in w's snapshot,
    the score :func:`herald.scheduler.kernels.laia_alloc_jit` computes."""
    B = samp_off.shape[0] - 1
    nnz = samp_slot.shape[0]
    out_score[:] = 0.0
    for c in prange(nchunks):
        lo, hi = _chunk(c, B, nchunks)
        for i in range(lo, hi):
            a = samp_off[i]
            b = samp_off[i + 1]
            row = out_score[i]
            if repeats_table_jit(samp_tab, a, b):
                _score_distinct_jit(samp_slot, samp_tab, a, b, table_on, valid, row)
                continue
            for p in range(a, b):
                if p + _AHEAD < nnz:
                    prefetch_jit(valid, samp_slot[p + _AHEAD])
                if table_on[samp_tab[p]]:
                    add_copies_jit(row, valid[samp_slot[p]])


@nb.njit(nogil=True, cache=True)
def _score_distinct_jit(samp_slot, samp_tab, a, b, table_on, valid, score):
    """Score (float64 [W], added to) of the sample ``samp_*[a:b]`` counting each distinct
    enabled slot once (no shared marks)."""
    buf = np.empty(b - a, np.int32)
    k = 0
    for p in range(a, b):
        if table_on[samp_tab[p]]:
            buf[k] = samp_slot[p]
            k += 1
    buf = np.sort(buf[:k])
    for q in range(k):
        if q == 0 or buf[q] != buf[q - 1]:
            add_copies_jit(score, valid[buf[q]])


@nb.njit(nogil=True, cache=True)
def laia_pick_jit(score, per_worker, rng, out_worker, lo, hi):
    """The greedy choice of LAIA (Herald Alg. 1 lines 8-12) for samples ``lo..hi-1`` in order:
    the available worker with the highest score, ties by one splitmix64 draw of ``rng``
    uint64 [1] per sample; ``per_worker`` samples per worker. out_worker int32 [B]."""
    W = score.shape[1]
    load = np.zeros(W, np.int64)
    ties = np.zeros(W, np.int64)
    for i in range(lo, hi):
        w = pick_jit(score[i], load, per_worker, ties, rng, True)
        out_worker[i] = w
        load[w] += 1


@nb.njit(**PJIT)
def laia_pick_lockfree_par_jit(score, per_worker, nchunks, rng, out_worker):
    """Lock-free allocation (Herald §4.4): the samples and every worker's capacity are
    divided evenly among ``nchunks`` chunks, and each chunk places its samples
    independently (:func:`laia_pick_jit` with its share of the capacity).

    Chunk c has ``cap_c = per_worker // nchunks`` (+1 for the first ``per_worker %
    nchunks`` chunks) samples per worker and the next ``W * cap_c`` samples of the batch.
    Sample i uses the i-th draw of the stream (the draw the serial choice gives it), so
    the result is deterministic for a given ``nchunks``, and with ``nchunks = 1`` it is
    the serial allocation; with more chunks it may differ from it (a sample cannot take a
    worker whose share in its chunk is full). ``rng`` advances by B draws.
    """
    W = score.shape[1]
    B = score.shape[0]
    state0 = rng[0]
    for c in prange(nchunks):
        before = c * (per_worker // nchunks) + min(c, per_worker % nchunks)
        cap = per_worker // nchunks + (1 if c < per_worker % nchunks else 0)
        lo = W * before
        stream = np.empty(1, np.uint64)
        stream[0] = state0 + np.uint64(lo) * GOLDEN
        laia_pick_jit(score, cap, stream, out_worker, lo, lo + W * cap)
    rng[0] = state0 + np.uint64(B) * GOLDEN


# ----------------------------------------------------------------------------- step keys
@nb.njit(**PJIT)
def collect_keys_par_jit(batch, use_mask, freq, owner, count_freq, clear_use, plan_push, out, nchunks):
    """:func:`herald.scheduler.step_kernels.collect_keys_jit` per worker on ``nchunks`` threads
    (same arguments but ``mark`` / ``token``: a worker's first occurrence of a key is the
    one that sets its bit in ``use_mask``). Returns the number of plan pushes."""
    samp_off, samp_slot, order, wstart = batch
    out_keys, out_off, pp_slot, pp_worker = out
    nnz = samp_slot.shape[0]
    W = wstart.shape[0] - 1
    if clear_use:  # an allocation used use_mask as scratch
        for c in prange(nchunks):
            lo, hi = _chunk(c, nnz, nchunks)
            for p in range(lo, hi):
                use_mask[samp_slot[p]] = 0
    region = np.zeros(W + 1, np.int64)  # worker w's keys go first to tmp[region[w]:]
    for w in range(W):
        n = 0
        for q in range(wstart[w], wstart[w + 1]):
            n += samp_off[order[q] + 1] - samp_off[order[q]]
        region[w + 1] = region[w] + n
    tmp = np.empty(nnz, np.int32)
    cand = np.empty(nnz if plan_push else 0, np.int32)  # keys of K_w held dirty by another worker
    cnt = np.zeros(W, np.int64)
    ncand = np.zeros(W, np.int64)
    for c in prange(nchunks):
        w0, w1 = _chunk(c, W, nchunks)
        for w in range(w0, w1):
            cnt[w], ncand[w] = _collect_worker_jit(
                w, batch, use_mask, freq, count_freq, owner, plan_push, tmp, cand, region[w]
            )
    out_off[0] = 0
    for w in range(W):
        out_off[w + 1] = out_off[w] + cnt[w]
    pp_cnt = np.zeros(W, np.int64)
    pp_owner = np.empty(nnz if plan_push else 0, np.int32)
    for c in prange(nchunks):
        w0, w1 = _chunk(c, W, nchunks)
        for w in range(w0, w1):
            out_keys[out_off[w] : out_off[w + 1]] = tmp[region[w] : region[w] + cnt[w]]
            if plan_push:
                pp_cnt[w] = _claim_plan_pushes_jit(w, cand, region[w], ncand[w], use_mask, owner, tmp, pp_owner)
    n = 0
    if plan_push:  # in worker order, canonical order within a worker: the serial push order
        for w in range(W):
            for k in range(region[w], region[w] + pp_cnt[w]):
                pp_slot[n] = tmp[k]
                pp_worker[n] = pp_owner[k]
                n += 1
    return n


@nb.njit(nogil=True, cache=True)
def _collect_worker_jit(w, batch, use_mask, freq, count_freq, owner, plan_push, out, cand, n0):
    """K_w in canonical order into ``out[n0:]`` and, with ``plan_push``, those of its keys
    held dirty by another worker into ``cand[n0:]`` (candidate plan pushes: ``owner``
    does not change in this pass); returns both counts."""
    samp_off, samp_slot, order, wstart = batch
    bit = np.uint64(1) << np.uint64(w)
    n = n0
    m = n0
    end = wstart[w + 1]
    for q in range(wstart[w], end):
        i = order[q]
        if q + 1 < end:  # the next sample's records (written out: as a helper 1.4x slower)
            i1 = order[q + 1]
            for p in range(samp_off[i1], samp_off[i1 + 1]):
                prefetch_jit(use_mask, samp_slot[p])
        for p in range(samp_off[i], samp_off[i + 1]):
            s = samp_slot[p]
            if count_freq:
                atomic_add_jit(freq, s, 1)
            if (use_mask[s] & bit) == 0:  # only this thread sets bit w
                atomic_or_jit(use_mask, s, bit)
                out[n] = s
                n += 1
                if plan_push:
                    o = owner[s]
                    if o >= 0 and o != w:
                        cand[m] = s
                        m += 1
    return n - n0, m - n0


@nb.njit(nogil=True, cache=True)
def _claim_plan_pushes_jit(w, cand, n0, ncand, use_mask, owner, out_slot, out_owner):
    """Plan pushes (Herald Alg. 2) found by worker w among its candidates ``cand[n0:n0 + ncand]``
    (keys of K_w in canonical order held dirty by ``o != w``): those of which w is the
    lowest-ranked user other than o, the worker the serial pass reaches first. Writes
    ``out_slot[n0:]`` / ``out_owner[n0:]`` and sets their ``owner`` to -1 (another
    candidate reading o or -1 skips it either way). Returns the count. ``use_mask``
    must hold every worker's bits."""
    n = n0
    for i in range(n0, n0 + ncand):
        s = cand[i]
        o = owner[s]
        if o < 0:
            continue
        if lowbit_index_jit(use_mask[s] & ~(np.uint64(1) << np.uint64(o))) == w:
            out_slot[n] = s
            out_owner[n] = o
            owner[s] = -1
            n += 1
    return n - n0


# ----------------------------------------------------------------------------- snapshots, update
@nb.njit(**PJIT)
def snapshot_lru_par_jit(keys, off, cap, lru, out, err, nchunks):
    """:func:`herald.scheduler.snapshot_kernels.snapshot_lru_step_jit` per worker on
    ``nchunks`` threads (same arguments). A micro-batch over capacity is reported before
    any state changes."""
    W = off.shape[0] - 1
    if _over_capacity_jit(off, cap, err):
        return
    code = np.zeros(W, np.int64)
    for c in prange(nchunks):
        w0, w1 = _chunk(c, W, nchunks)
        for w in range(w0, w1):
            code[w] = lru_worker_jit(w, W, keys, off, cap, lru, out, True)
    _first_error_jit(code, err)


@nb.njit(**PJIT)
def snapshot_lfu_par_jit(keys, off, use_mask, cap, lfu, out, err, nchunks):
    """:func:`herald.scheduler.snapshot_kernels.snapshot_lfu_step_jit` per worker on
    ``nchunks`` threads (same arguments)."""
    W = off.shape[0] - 1
    if _over_capacity_jit(off, cap, err):
        return
    aside_s = np.empty((nchunks, cap + 1), np.int32)  # each chunk's scratch
    aside_p = np.empty((nchunks, cap + 1), np.int64)
    code = np.zeros(W, np.int64)
    for c in prange(nchunks):
        w0, w1 = _chunk(c, W, nchunks)
        for w in range(w0, w1):
            code[w] = lfu_worker_jit(w, keys, off, use_mask, cap, lfu, out, aside_s[c], aside_p[c], True)
    _first_error_jit(code, err)


@nb.njit(nogil=True, cache=True)
def _over_capacity_jit(off, cap, err):
    for w in range(off.shape[0] - 1):
        if off[w + 1] - off[w] > cap:
            err[0] = 1
            err[1] = w
            return True
    return False


@nb.njit(nogil=True, cache=True)
def _first_error_jit(code, err):
    for w in range(code.shape[0]):
        if code[w] != 0:
            err[0] = code[w]
            err[1] = w
            return


@nb.njit(**PJIT)
def update_after_step_par_jit(keys, off, use_mask, valid, owner, full_sync, upd, nchunks):
    """:func:`herald.scheduler.step_kernels.update_after_step_jit` per worker on ``nchunks``
    threads (same arguments); ``use_mask`` is cleared once every worker has read it."""
    W = off.shape[0] - 1
    for c in prange(nchunks):
        w0, w1 = _chunk(c, W, nchunks)
        for w in range(w0, w1):
            update_worker_jit(w, keys, off, use_mask, valid, owner, full_sync, upd, False)
    n = keys.shape[0]
    for c in prange(nchunks):
        lo, hi = _chunk(c, n, nchunks)
        for i in range(lo, hi):
            use_mask[keys[i]] = 0


# ----------------------------------------------------------------------------- plans
@nb.njit(**PJIT)
def gather_plan_keys_par_jit(off, lists, cnts, pp, keymap, out, nchunks):
    """:func:`herald.scheduler.plan_build.gather_plan_keys_jit` with the workers' lists
    copied on ``nchunks`` threads (same arguments); the plan pushes on one."""
    W = off.shape[0] - 1
    plan_bounds_jit(cnts, pp[1], out[2])
    for c in prange(nchunks):
        w0, w1 = _chunk(c, W, nchunks)
        for w in range(w0, w1):
            copy_worker_lists_jit(w, off, lists, cnts, keymap, out)
    scatter_plan_pushes_jit(pp, keymap, out)

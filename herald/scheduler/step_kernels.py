"""Numba kernels of a step's keys: the samples grouped by worker, each worker's distinct keys
with the previous step's plan pushes (Herald Alg. 2), and the after-step update (gradient
pushes, local updates, new validity; NOTE [step protocol] in :mod:`herald.contracts.plan`).

Split from :mod:`herald.scheduler.kernels` (same conventions and vocabulary: ``nogil``,
preallocated outputs, the per-key masks); their threaded versions are in
:mod:`herald.scheduler.parallel_kernels`.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from herald.scheduler.kernels import JIT, popcount_jit, prefetch_jit

_AHEAD = 32  # keys ahead whose record is prefetched (as in kernels.py)


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


@nb.njit(**JIT)
def clear_mask_jit(mask, slots):
    """``mask[s] = 0`` for every slot ``s`` of ``slots`` (int32 [n]), the records prefetched
    ``_AHEAD`` slots ahead (an allocation used ``use_mask`` as scratch)."""
    n = slots.shape[0]
    for p in range(n):
        if p + _AHEAD < n:
            prefetch_jit(mask, slots[p + _AHEAD])
        mask[slots[p]] = 0


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
        clear_mask_jit(use_mask, samp_slot)
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
            if q + 1 < wstart[W]:  # the next sample's records (written out: as a helper 1.4x slower)
                i1 = order[q + 1]
                for p in range(samp_off[i1], samp_off[i1 + 1]):
                    prefetch_jit(use_mask, samp_slot[p])
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

"""Materialise the :class:`CachePlan` objects of one step from the scheduler's slot lists.

One kernel gathers the keys ``(table, id)`` of every list of every worker into two flat
buffers (``tab`` int32 [N], ``ids`` uint64 [N]) with per-(worker, list) bounds; the plans
are then numpy views of those buffers, so building all plans of a step costs one pass
over its keys and a constant number of small objects per worker (no per-list fancy
indexing). Contents and order are exactly those of the lists (docs/scheduler.md, "Exact
semantics").
"""

from __future__ import annotations

import numba as nb
import numpy as np

from herald.contracts.plan import CachePlan, KeySet
from herald.scheduler.kernels import JIT, prefetch_jit

_AHEAD = 16  # slots ahead whose key is prefetched

#: Lists of a plan in buffer order: evict, pull, grad_push, update_local, plan_push.
NUM_LISTS = 5


@nb.njit(**JIT)
def _copy_keys_jit(src, lo, m, keymap, out_tab, out_ids, n):
    slot_tab, slot_ids = keymap
    hi = lo + m
    for i in range(lo, hi):
        if i + _AHEAD < hi:  # the key map entries of the slot _AHEAD ahead
            prefetch_jit(slot_ids, src[i + _AHEAD])
            prefetch_jit(slot_tab, src[i + _AHEAD])
        s = src[i]
        out_tab[n] = slot_tab[s]
        out_ids[n] = slot_ids[s]
        n += 1
    return n


@nb.njit(**JIT)
def gather_plan_keys_jit(off, lists, cnts, pp, keymap, out):
    """Keys of all plan lists of all workers, worker-major then list order.

    Args:
        off: int64 [W+1]; list k of worker w is ``lists[k][off[w]:off[w] + cnts[k][w]]``
            with ``lists`` = ``(ev_slot, pull_slot, gp_slot, ul_slot)`` (int32 slots [nnz])
            and ``cnts`` = ``(ev_cnt, pull_cnt, gp_cnt, ul_cnt)``, int64 [W] each (no
            stacking in Python).
        pp: ``(pp_slot, pp_worker)``, int32 [P]: plan pushes in push order and the pushing
            worker (grouped by worker here, push order kept).
        keymap: ``(slot_tab int16 [S], slot_ids uint64 [S])``.
        out: ``(out_tab int32 [N], out_ids uint64 [N], out_bounds int64 [W, NUM_LISTS + 1])``
            with N = the sum of the counts + P (written): list k of worker w is
            ``out_*[out_bounds[w, k]:out_bounds[w, k + 1]]``.
    """
    plan_bounds_jit(cnts, pp[1], out[2])
    for w in range(off.shape[0] - 1):
        copy_worker_lists_jit(w, off, lists, cnts, keymap, out)
    scatter_plan_pushes_jit(pp, keymap, out)


@nb.njit(**JIT)
def plan_bounds_jit(cnts, pp_worker, out_bounds):
    """``out_bounds`` of :func:`gather_plan_keys_jit` (column 5 ends as the start of each
    worker's plan pushes, the cursor of :func:`scatter_plan_pushes_jit`)."""
    ev_cnt, pull_cnt, gp_cnt, ul_cnt = cnts
    W = out_bounds.shape[0]
    out_bounds[:, 5] = 0
    for i in range(pp_worker.shape[0]):
        out_bounds[pp_worker[i], 5] += 1
    n = 0
    for w in range(W):
        out_bounds[w, 0] = n
        out_bounds[w, 1] = n = n + ev_cnt[w]
        out_bounds[w, 2] = n = n + pull_cnt[w]
        out_bounds[w, 3] = n = n + gp_cnt[w]
        n += ul_cnt[w]
        out_bounds[w, 4] = n
        n += out_bounds[w, 5]
        out_bounds[w, 5] = out_bounds[w, 4]


@nb.njit(**JIT)
def copy_worker_lists_jit(w, off, lists, cnts, keymap, out):
    """Worker w's evict, pull, grad_push and update_local keys into its part of the buffers."""
    out_tab, out_ids, out_bounds = out
    lo = off[w]
    n = _copy_keys_jit(lists[0], lo, cnts[0][w], keymap, out_tab, out_ids, out_bounds[w, 0])
    n = _copy_keys_jit(lists[1], lo, cnts[1][w], keymap, out_tab, out_ids, n)
    n = _copy_keys_jit(lists[2], lo, cnts[2][w], keymap, out_tab, out_ids, n)
    _copy_keys_jit(lists[3], lo, cnts[3][w], keymap, out_tab, out_ids, n)


@nb.njit(**JIT)
def scatter_plan_pushes_jit(pp, keymap, out):
    """The plan pushes, grouped by pushing worker in push order; then ``out_bounds[:, 5]``
    becomes each worker's end."""
    pp_slot, pp_worker = pp
    slot_tab, slot_ids = keymap
    out_tab, out_ids, out_bounds = out
    W = out_bounds.shape[0]
    for i in range(pp_slot.shape[0]):
        w = pp_worker[i]
        s = pp_slot[i]
        n = out_bounds[w, 5]
        out_tab[n] = slot_tab[s]
        out_ids[n] = slot_ids[s]
        out_bounds[w, 5] = n + 1
    for w in range(W - 1):
        out_bounds[w, 5] = out_bounds[w + 1, 0]
    if W > 0:
        out_bounds[W - 1, 5] = out_tab.shape[0]


def _keyset(tab: np.ndarray, ids: np.ndarray) -> KeySet:
    # The buffers are already int32 / uint64 and contiguous: KeySet's validation would
    # only re-check what gather_plan_keys_jit guarantees, so set the fields directly.
    ks = KeySet.__new__(KeySet)
    ks.table = tab
    ks.ids = ids
    return ks


def build_plans(off, before, after, pp, slot_tab, slot_ids, *, gather=None) -> list:
    """Per worker, its :class:`CachePlan` of one step.

    Args:
        off: int64 [W+1] bounds of each worker's keys in the step's lists.
        before: ``(ev_slot, ev_wb, ev_cnt, pull_slot, pull_cnt)`` of the snapshot step.
        after: ``(gp_slot, gp_contrib, ul_slot, gp_cnt, ul_cnt)`` of the update step.
        pp: ``(slot int32 [P], worker int32 [P])`` plan pushes, or None (last step).
        slot_tab: int16 [S]; slot_ids: uint64 [S]: the key map.
        gather: a replacement of :func:`gather_plan_keys_jit` with its arguments (the
            parallel one, :meth:`herald.scheduler.parallel.ParallelPasses.gather_plan_keys`).
    """
    ev_slot, ev_wb, ev_cnt, pull_slot, pull_cnt = before
    gp_slot, gp_contrib, ul_slot, gp_cnt, ul_cnt = after
    W = off.shape[0] - 1
    if pp is None:
        pp = (np.zeros(0, np.int32), np.zeros(0, np.int32))
    N = int(ev_cnt.sum() + pull_cnt.sum() + gp_cnt.sum() + ul_cnt.sum()) + pp[0].shape[0]
    tab = np.empty(N, np.int32)
    ids = np.empty(N, np.uint64)
    bounds = np.empty((W, NUM_LISTS + 1), np.int64)
    lists, cnts = (ev_slot, pull_slot, gp_slot, ul_slot), (ev_cnt, pull_cnt, gp_cnt, ul_cnt)
    (gather or gather_plan_keys_jit)(off, lists, cnts, pp, (slot_tab, slot_ids), (tab, ids, bounds))
    plans = []
    for w, b in enumerate(bounds.tolist()):
        ks = [_keyset(tab[b[k] : b[k + 1]], ids[b[k] : b[k + 1]]) for k in range(NUM_LISTS)]
        lo = int(off[w])
        plans.append(
            CachePlan(
                evict=ks[0],
                write_back=ev_wb[lo : lo + b[1] - b[0]],
                pull=ks[1],
                grad_push=ks[2],
                contributors=gp_contrib[lo : lo + b[3] - b[2]],
                update_local=ks[3],
                plan_push=ks[4],
            )
        )
    return plans

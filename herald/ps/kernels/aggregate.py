"""Gradient push kernels: NOTE [ps aggregation]'s checks and the aggregation of one step.

The open aggregations of one step over every table of a shard (NOTE [ps aggregation] in
herald/ps/aggregate.py, :class:`~herald.ps.aggregate.PendingStep`) travel as one tuple,
``agg = (buckets, p_key, p_table, p_slot, p_expected, p_arrived, p_head, e_rank, e_next,
e_grad, cnt, open_t, opened_at)`` (:data:`herald.ps.aggregate.STATE_FIELDS`): a key map
(NOTE [key map]) of (table, key) -> pending index p (``buckets`` int64, -1 empty; key
``p_key[p]``, table ``p_table[p]``, -1 = forgotten); per p: ``p_slot``, ``p_expected``,
``p_arrived``, ``p_head`` (its entry list); per entry e: ``e_rank``, ``e_next``, ``e_grad``
float32 [dim]; ``cnt`` int64 [3] = (p used, entries used, open p); per table: ``open_t``
(open p) and ``opened_at`` (when its open count last left 0). A plain tuple: numba unboxes
it as fast as its arrays one by one (a named tuple costs ~1 us more per call).

One entry point per use: :func:`push_grad_jit` (a request of one part: checked and
applied in one call), :func:`push_grad_check_jit` and :func:`push_grad_apply_jit` (a
request of several parts: every part checked before any is applied).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from herald.keymap import home_jit, probe_jit
from herald.ps.kernels.directory import (
    ABOVE_BOUND,
    AGG_COMPLETE,
    AGG_DIFFER,
    AGG_TWICE,
    AGG_ZERO,
    D_DIM,
    D_OPT,
    NEED_STATE,
    OK,
    dir_clocks,
    dir_marks,
    dir_rows,
    flat_room_jit,
    flat_slots_jit,
)
from herald.ps.kernels.rows import apply_row_jit, finite_rows_jit


@nb.njit(cache=True, nogil=True)
def grad_inputs_check_jit(grads, contributors, bound):
    """``(code, i, largest contributors)``: ABOVE_BOUND if ``contributors[i] > bound``, else
    NONFINITE if gradient row i holds a NaN or an infinity (:func:`finite_rows_jit`), else OK."""
    cmax = 0
    for i in range(contributors.shape[0]):
        c = nb.int64(contributors[i])
        if c > bound:
            return ABOVE_BOUND, i, c
        if c > cmax:
            cmax = c
    code, i = finite_rows_jit(grads)
    return code, i, cmax


@nb.njit(cache=True, nogil=True)
def _aggregation_check_jit(tables, keys, contributors, rank, agg):
    """NOTE [ps aggregation]'s rules for one push against a step's pending state: ``(code, i)``."""
    buckets, p_key, p_table, _, p_expected, p_arrived, p_head, e_rank, e_next = agg[:9]
    mask = nb.uint64(buckets.shape[0] - 1)
    for i in range(keys.shape[0]):
        c = nb.int64(contributors[i])
        if c == 0:
            return AGG_ZERO, i
        t = nb.int64(tables[i])
        key = nb.uint64(keys[i])
        p = buckets[probe_jit(buckets, p_key, p_table, t, key, home_jit(t, key, mask))]
        if p < 0:
            continue
        if p_expected[p] != c:
            return AGG_DIFFER, i
        if p_arrived[p] >= p_expected[p]:
            return AGG_COMPLETE, i
        e = p_head[p]
        while e >= 0:
            if e_rank[e] == rank:
                return AGG_TWICE, i
            e = e_next[e]
    return OK, -1


# The loop below stays one function: splitting it into inlined helpers over ``agg`` (opening
# a (key, step), keeping an entry, the rank-order sum) made a step's gradient push of two
# contributors ~20% slower (the helpers' tuple unpacking in the loop; measured against this
# form on 2,500 keys).
@nb.njit(cache=True, nogil=True)
def _aggregation_apply_jit(space, tables, keys, grads, contributors, rank, slots, agg, now):
    """Record one contributor's gradients (checked, room reserved); apply the optimizer of
    each key's table to every (key, step) whose last contributor this is; tick the clock of
    every row left without an open aggregation. Returns the rows updated."""
    d, hp = space[0], space[4]
    buckets, p_key, p_table, p_slot, p_expected, p_arrived, p_head, e_rank, e_next, e_grad, cnt, open_t, opened_at = agg
    m = keys.shape[0]
    if m == 0:
        return 0
    applied = 0
    mask = nb.uint64(buckets.shape[0] - 1)
    cur = nb.int64(tables[0])
    rows = dir_rows(d, cur)
    marks = dir_marks(d, cur)
    clocks = dir_clocks(d, cur)
    kind = d[cur, D_OPT]
    dim = d[cur, D_DIM]
    hpt = hp[cur]
    acc = np.empty(e_grad.shape[1] if e_grad.shape[1] > grads.shape[1] else grads.shape[1], np.float32)
    ids = np.empty(16, np.int64)  # a completed (key, step)'s entries, by increasing rank
    rk = np.empty(16, np.int64)
    for i in range(m):
        t = nb.int64(tables[i])
        if t != cur:
            cur = t
            rows = dir_rows(d, t)
            marks = dir_marks(d, t)
            clocks = dir_clocks(d, t)
            kind = d[t, D_OPT]
            dim = d[t, D_DIM]
            hpt = hp[t]
        c = np.int32(contributors[i])
        key = nb.uint64(keys[i])
        s = slots[i]
        h = probe_jit(buckets, p_key, p_table, t, key, home_jit(t, key, mask))
        p = buckets[h]
        if p < 0 and c == 1:
            apply_row_jit(rows[s], grads[i], kind, dim, hpt)
            applied += 1
            if marks[s] == 0:  # NOTE [embedding clocks]: an applied update without an open one left
                clocks[s] += nb.uint64(1)
            continue
        if p < 0:
            p = cnt[0]
            cnt[0] += 1
            cnt[2] += 1
            buckets[h] = p
            p_key[p] = key
            p_table[p] = t
            p_slot[p] = s
            p_expected[p] = c
            p_arrived[p] = 0
            p_head[p] = -1
            marks[s] += 1
            if open_t[t] == 0:
                opened_at[t] = now
            open_t[t] += 1
        e = cnt[1]
        cnt[1] += 1
        e_rank[e] = rank
        e_next[e] = p_head[p]
        p_head[p] = e
        ge = e_grad[e]
        gi = grads[i]
        for j in range(dim):
            ge[j] = gi[j]
        p_arrived[p] += 1
        if p_arrived[p] == p_expected[p]:
            n = p_arrived[p]
            if n > ids.shape[0]:
                ids = np.empty(2 * n, np.int64)
                rk = np.empty(2 * n, np.int64)
            e = p_head[p]
            k = 0
            while e >= 0:  # insertion by rank (ranks of one (key, step) are distinct)
                r = nb.int64(e_rank[e])
                q = k
                while q > 0 and rk[q - 1] > r:
                    rk[q] = rk[q - 1]
                    ids[q] = ids[q - 1]
                    q -= 1
                rk[q] = r
                ids[q] = e
                k += 1
                e = e_next[e]
            for j in range(dim):
                acc[j] = np.float32(0.0)
            for k in range(n):
                src = e_grad[ids[k]]
                for j in range(dim):
                    acc[j] += src[j]
            apply_row_jit(rows[s], acc, kind, dim, hpt)
            applied += 1
            marks[s] -= 1
            cnt[2] -= 1
            open_t[t] -= 1
        if marks[s] == 0:
            clocks[s] += nb.uint64(1)
    return applied


@nb.njit(inline="always", nogil=True)
def _state_fits_jit(agg, n, dim, n_tables):
    """Whether ``agg`` has room for ``n`` more keys and entries of ``dim`` values, and ``n_tables`` tables."""
    buckets, p_key, e_rank, e_grad, cnt, open_t = agg[0], agg[1], agg[7], agg[9], agg[10], agg[11]
    need = cnt[0] + n
    return not (
        need > p_key.shape[0]
        or 2 * need > buckets.shape[0]
        or cnt[1] + n > e_rank.shape[0]
        or cnt[1] + n > e_grad.shape[0]
        or e_grad.shape[1] < dim
        or open_t.shape[0] < n_tables
    )


@nb.njit(inline="always", nogil=True)
def _inputs_jit(space, check_room, tables, keys, grads, contributors, bound):
    """A push's keys (:func:`flat_room_jit` of the gradients' dim) and its inputs (every
    ``contributors[i] <= bound``, every gradient finite): ``(code, i, largest contributors)``."""
    code, at = flat_room_jit(space, check_room, grads.shape[1], -1, tables, keys)
    if code != OK:
        return code, at, 0
    return grad_inputs_check_jit(grads, contributors, bound)


@nb.njit(inline="always", nogil=True)
def _rules_jit(space, tables, keys, contributors, rank, slots, stamp, lru, agg):
    """Slots found or inserted and rows stamped (keys unique), then the aggregation rules
    against the step's state: ``(code, i)``."""
    code, at = flat_slots_jit(space, tables, keys, slots, stamp, lru, True)
    if code != OK:
        return code, at
    return _aggregation_check_jit(tables, keys, contributors, rank, agg)


@nb.njit(cache=True, nogil=True)
def push_grad_check_jit(space, check_room, tables, keys, grads, contributors, rank, bound, slots, stamp, lru, agg):
    """Validate one contributor's gradients for one step without changing a row (NOTE [ps
    aggregation]): the keys (:func:`flat_room_jit`: SHORT with ``check_room``), the inputs,
    the slots (unseen keys inserted, rows stamped) and the rules against the step's state
    ``agg``. Returns ``(code, i, largest contributors)``; :func:`push_grad_apply_jit` then
    applies what it accepted, with its ``slots``."""
    code, at, cmax = _inputs_jit(space, check_room, tables, keys, grads, contributors, bound)
    if code == OK:
        code, at = _rules_jit(space, tables, keys, contributors, rank, slots, stamp, lru, agg)
    return code, at, cmax


@nb.njit(cache=True, nogil=True)
def push_grad_apply_jit(space, tables, keys, grads, contributors, rank, slots, agg, now):
    """Record and apply what :func:`push_grad_check_jit` accepted (``slots`` its slots; the
    state's room reserved, ``now`` the time an opened aggregation starts): the rows updated."""
    return _aggregation_apply_jit(space, tables, keys, grads, contributors, rank, slots, agg, now)


@nb.njit(cache=True, nogil=True)
def push_grad_jit(space, check_room, tables, keys, grads, contributors, rank, bound, slots, stamp, lru, agg, now):
    """One contributor's gradients (float32 [n, dim]) for one step (NOTE [ps aggregation]):
    checked as :func:`push_grad_check_jit`, after a check of the state's room before any
    change (NEED_STATE: the step has no state, or too small a one: make room, call again),
    then applied. Returns ``(code, i, rows updated)``.

    A key with ``contributors[i] == 1`` and no pending state is applied at once. Others are
    kept until ``contributors[i]`` ranks have arrived, then summed in increasing rank order
    and applied once with the optimizer of the key's table (``d[t, D_OPT]``, ``hp[t]``:
    :func:`~herald.ps.kernels.rows.apply_row_jit`); then the clock of every row without an
    open aggregation left ticks (NOTE [embedding clocks]).
    """
    code, at, cmax = _inputs_jit(space, check_room, tables, keys, grads, contributors, bound)
    if code != OK:
        return code, at, cmax
    if cmax > 1 and not _state_fits_jit(agg, keys.shape[0], grads.shape[1], space[0].shape[0]):
        return NEED_STATE, -1, cmax
    code, at = _rules_jit(space, tables, keys, contributors, rank, slots, stamp, lru, agg)
    if code != OK:
        return code, at, cmax
    return OK, -1, _aggregation_apply_jit(space, tables, keys, grads, contributors, rank, slots, agg, now)

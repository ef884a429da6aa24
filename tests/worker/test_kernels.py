"""The worker's numba kernels and grouping helpers equal the numpy code they replace."""

import numpy as np
import pytest

from herald.contracts.plan import KeySet
from herald.errors import ProtocolError
from herald.worker.kernels import bag_grads_jit, pooled_sum_jit, segment_unique_jit
from herald.worker.psio import positions, table_groups


def test_segment_unique_equals_np_unique_per_segment():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lens = rng.integers(0, 40, rng.integers(0, 5))
        segs = [rng.integers(0, int(rng.choice([3, 100, 2**64 - 1])), n, dtype=np.uint64) for n in lens]
        bounds = np.zeros(len(segs) + 1, np.int64)
        np.cumsum(lens, out=bounds[1:])
        values = np.concatenate(segs) if segs else np.zeros(0, np.uint64)
        uniq, inv, ub = np.empty_like(values), np.empty(values.shape[0], np.int64), np.empty(len(segs) + 1, np.int64)
        segment_unique_jit(values, bounds, uniq, inv, ub)
        for t, seg in enumerate(segs):
            u, i = np.unique(seg, return_inverse=True)
            assert np.array_equal(uniq[ub[t] : ub[t + 1]], u) and np.array_equal(inv[bounds[t] : bounds[t + 1]], i)


def test_table_masks_select_what_boolean_masks_select():
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 500):
        table = rng.integers(0, 26, n).astype(np.int32)
        got = [(t, idx.tolist()) for t, idx in table_groups(table)]
        assert got == [(int(t), np.flatnonzero(table == t).tolist()) for t in np.unique(table)]


def test_positions_finds_rows_and_rejects_unused_keys():
    uniq = np.array([3, 9, 2**63 + 1, 5], np.uint64)  # table 0: [3, 9, 2**63+1], table 1: [5], table 2: []
    bounds = np.array([0, 3, 4, 4], np.int64)
    keys = KeySet(np.array([1, 0, 0, 0], np.int32), np.array([5, 2**63 + 1, 3, 9], np.uint64))
    assert positions(uniq, bounds, keys).tolist() == [3, 2, 0, 1]
    for t, i in ((0, 4), (1, 3), (2, 3), (3, 3)):
        with pytest.raises(ProtocolError):
            positions(uniq, bounds, KeySet(np.array([t], np.int32), np.array([i], np.uint64)))


# ------------------------------------------------------------- NOTE [fused bag kernels]
def _random_bags(rng):
    """A random micro-batch layout over a 300-row float32 slot array (values from 1e-3 to 1e3)."""
    tables, batch, dim = int(rng.integers(1, 5)), int(rng.integers(1, 30)), int(rng.choice([1, 3, 16, 64]))
    rows = (rng.standard_normal((300, dim + int(rng.integers(0, 3)))) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
    inv, offs, slots, id_bounds = [], [], [], [0]
    for _ in range(tables):
        u = int(rng.integers(1, 8))
        lens = rng.integers(0, 6, batch)
        off = np.zeros(batch + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        values = np.arange(off[-1]) % u
        inv.append(rng.permutation(values).astype(rng.choice([np.int32, np.uint16])))
        offs.append(off)
        slots.append(rng.choice(300, u, replace=False))
        id_bounds.append(id_bounds[-1] + u)
    inverse_bounds = np.zeros(tables + 1, np.int64)
    np.cumsum([i.shape[0] for i in inv], out=inverse_bounds[1:])
    inverse = np.concatenate(inv).astype(inv[0].dtype) if inv else np.zeros(0, np.int32)
    return (
        rows,
        np.concatenate(slots).astype(np.int64),
        np.array(id_bounds, np.int64),
        inverse,
        inverse_bounds,
        np.stack(offs),
        dim,
    )


def _embedding_bag(rows, slots, id_bounds, inverse, inverse_bounds, offsets, dim):
    """The executor's path (herald/worker/executor.py ``_lookup``): gather, one embedding_bag."""
    import torch
    import torch.nn.functional as F

    t, b = offsets.shape[0], offsets.shape[1] - 1
    leaf = torch.from_numpy(rows[slots, :dim]).requires_grad_(True)
    inputs = inverse.astype(np.int64) + np.repeat(id_bounds[:-1], np.diff(inverse_bounds))
    starts = (offsets[:, :-1] + inverse_bounds[:-1, None]).reshape(-1)
    pooled = F.embedding_bag(torch.from_numpy(inputs), leaf, torch.from_numpy(starts), mode="sum")
    return pooled.view(t, b, dim).transpose(0, 1), leaf


def test_pooled_sum_is_bit_identical_to_embedding_bag():
    rng = np.random.default_rng(2)
    for _ in range(150):
        rows, slots, idb, inv, ib, off, dim = _random_bags(rng)
        out = np.full((off.shape[1] - 1, off.shape[0], dim), np.nan, np.float32)
        assert pooled_sum_jit(rows, slots, idb, inv, ib, off, out) == -1
        ref, _ = _embedding_bag(rows, slots, idb, inv, ib, off, dim)
        assert np.array_equal(out, ref.detach().numpy())


def test_bag_grads_equals_embedding_bag_backward():
    """Rows used once: bit-identical to torch's backward. Rows used more often: the same
    float32 terms, summed by torch in the order of an unstable sort of the values (any
    micro-batch of more than 16 values), here in (table, bag, position) order; so equal
    within the rounding of the sum."""
    import torch

    rng = np.random.default_rng(3)
    for _ in range(150):
        rows, slots, idb, inv, ib, off, dim = _random_bags(rng)
        pooled, leaf = _embedding_bag(rows, slots, idb, inv, ib, off, dim)
        go = (rng.standard_normal(pooled.shape) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
        pooled.backward(torch.from_numpy(go))
        divisor = np.float32(rng.choice([1, 2, 3]))
        ref = (leaf.grad / torch.tensor(divisor)).numpy()
        got = np.full((slots.shape[0], dim), np.nan, np.float32)
        bag_grads_jit(go, idb, inv, ib, off, divisor, got)
        uses = np.bincount(inv.astype(np.int64) + np.repeat(idb[:-1], np.diff(ib)), minlength=slots.shape[0])
        once = uses <= 1
        assert np.array_equal(got[once], ref[once])
        bound = uses[:, None] * np.finfo(np.float32).eps * np.abs(go).max(initial=0) * uses.max(initial=0)
        assert (np.abs(got - ref) <= bound).all()


def test_bag_grads_sums_in_table_bag_position_order():
    """The order NOTE [fused bag kernels] promises, for rows used many times."""
    rng = np.random.default_rng(4)
    go = (rng.standard_normal((40, 1, 4)) * 10.0 ** rng.integers(-4, 4, (40, 1, 1))).astype(np.float32)
    off = np.arange(41, dtype=np.int64)[None]
    got = np.empty((1, 4), np.float32)
    bag_grads_jit(
        go, np.array([0, 1], np.int64), np.zeros(40, np.int32), np.array([0, 40], np.int64), off, np.float32(1), got
    )
    want = np.zeros(4, np.float32)
    for b in range(40):
        want = want + go[b, 0]
    assert np.array_equal(got[0], want)


def test_pooled_sum_reports_the_first_table_out_of_range():
    rows = np.ones((10, 2), np.float32)
    idb, ib = np.array([0, 2, 3], np.int64), np.array([0, 2, 3], np.int64)
    off = np.array([[0, 1, 2], [0, 1, 1]], np.int64)
    out = np.empty((2, 2, 2), np.float32)
    good = (np.array([1, 2, 3], np.int64), np.array([0, 1, 0], np.int32))
    assert pooled_sum_jit(rows, good[0], idb, good[1], ib, off, out) == -1
    assert np.array_equal(out[:, 0], np.ones((2, 2), np.float32)) and np.array_equal(out[:, 1], [[1, 1], [0, 0]])
    assert pooled_sum_jit(rows, good[0], idb, np.array([0, 1, 1], np.int32), ib, off, out) == 1  # value beyond table 1
    assert pooled_sum_jit(rows, np.array([1, 10, 3], np.int64), idb, good[1], ib, off, out) == 0  # slot beyond rows
    assert pooled_sum_jit(rows, good[0], idb, good[1], ib, np.array([[0, 2, 1], [0, 1, 1]], np.int64), out) == 0
    assert pooled_sum_jit(rows, good[0], idb, good[1], ib, np.array([[0, 1, 2], [0, 1, 2]], np.int64), out) == 1

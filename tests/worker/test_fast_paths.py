"""The worker's per-step fast paths compute what the paths they replace did:
bag pooling by index_select/index_add (herald/worker/executor.py ``pool_bags``) against
``F.embedding_bag``, DLRM's pair selection against advanced indexing, the one-reduction
finite check against the element-wise one, and the fused dense optimizers against the
default ones."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from herald.worker.divergence import all_finite
from herald.worker.models import DLRM
from herald.worker.rows import pool_bags
from herald.worker.trainer import build_dense_optimizer


def _bags(rng: np.random.Generator, tables: int, batch: int, max_len: int, rows: int):
    """Flat micro-batch arrays: inputs int64 [N], offsets int64 [T, b + 1], inverse_bounds int64 [T + 1]."""
    lengths = rng.integers(0, max_len + 1, (tables, batch)) if max_len != 1 else np.ones((tables, batch), np.int64)
    offsets = np.zeros((tables, batch + 1), np.int64)
    np.cumsum(lengths, axis=1, out=offsets[:, 1:])
    inverse_bounds = np.zeros(tables + 1, np.int64)
    np.cumsum(offsets[:, -1], out=inverse_bounds[1:])
    inputs = rng.integers(0, rows, int(inverse_bounds[-1])).astype(np.int64)
    return inputs, offsets, inverse_bounds


def _embedding_bag(rows: torch.Tensor, inputs, offsets, inverse_bounds) -> torch.Tensor:
    starts = (offsets[:, :-1] + inverse_bounds[:-1, None]).reshape(-1)
    return F.embedding_bag(torch.from_numpy(inputs), rows, torch.from_numpy(starts), mode="sum")


@pytest.mark.parametrize("max_len", [1, 0, 2, 5])  # one-hot, all bags empty, some empty, multi-hot
def test_pool_bags_equals_embedding_bag(max_len):
    rng = np.random.default_rng(max_len)
    inputs, offsets, inverse_bounds = _bags(rng, tables=5, batch=33, max_len=max_len, rows=40)
    base = torch.from_numpy(rng.standard_normal((40, 8)).astype(np.float32))
    upstream = torch.from_numpy(rng.standard_normal((5 * 33, 8)).astype(np.float32))
    ours, ref = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    pooled = pool_bags(ours, inputs, offsets, inverse_bounds, torch.device("cpu"))
    expected = _embedding_bag(ref, inputs, offsets, inverse_bounds)
    assert pooled.shape == expected.shape == (5 * 33, 8)
    assert torch.equal(pooled, expected)  # values added in bag order: the same bits
    pooled.backward(upstream)
    expected.backward(upstream)
    if max_len == 0:
        assert ours.grad is None or not ours.grad.any()
        return
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-6, atol=1e-6)  # summation order may differ
    seq = np.zeros((40, 8), np.float32)  # each row's gradients added in value order
    bag_of_value = np.repeat(np.arange(5 * 33), np.diff(offsets, axis=1).reshape(-1))
    for v, row in enumerate(inputs):
        seq[row] += upstream.numpy()[bag_of_value[v]]
    np.testing.assert_array_equal(ours.grad.numpy(), seq)


def test_dlrm_pair_selection_equals_advanced_indexing():
    torch.manual_seed(0)
    model = DLRM(dense_dim=3, num_tables=4, embedding_dim=6)
    dense, emb = torch.randn(7, 3), torch.randn(7, 4, 6, requires_grad=True)
    z = torch.cat([model.bottom(dense).unsqueeze(1), emb], dim=1)
    inter = torch.bmm(z, z.transpose(1, 2))
    expected = model.top(torch.cat([model.bottom(dense), inter[:, model._pairs[0], model._pairs[1]]], dim=1))
    got = model(dense, emb)
    assert torch.equal(got, expected.squeeze(1))
    (g_ours,) = torch.autograd.grad(got.sum(), emb)
    (g_ref,) = torch.autograd.grad(expected.sum(), emb)
    assert torch.equal(g_ours, g_ref)
    assert "_pair_index" not in model.state_dict()  # not a parameter, not saved


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_finds_any_non_finite_element(bad):
    tensors = [torch.zeros(5, 3), torch.ones(4)]
    assert all_finite(tensors)
    tensors[1][2] = bad
    assert not all_finite(tensors)


def test_all_finite_is_not_fooled_by_an_overflowing_sum():
    big = torch.full((4,), 3e38)  # finite values whose sum overflows float32
    assert all_finite([big, torch.zeros(2)])


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_fused_dense_optimizer_steps_like_the_default(name):
    torch.manual_seed(1)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    fused = build_dense_optimizer(a.parameters(), name, 0.01)
    plain = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[name](
        b.parameters(), lr=0.01
    )
    assert fused.defaults.get("fused") is True
    x = torch.randn(16, 5)
    for _ in range(5):
        for model, opt in ((a, fused), (b, plain)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_table_runs_and_groups_select_what_masks_select():
    from herald.worker.psio import table_groups, table_runs

    table = np.array([3, 1, 3, 0, 1, 3], np.int32)
    order, runs = table_runs(table)
    assert [t for t, _, _ in runs] == [0, 1, 3]
    for t, a, b in runs:
        np.testing.assert_array_equal(order[a:b], np.flatnonzero(table == t))
    assert [(t, m.tolist()) for t, m in table_groups(table)] == [(0, [3]), (1, [1, 4]), (3, [0, 2, 5])]
    assert table_runs(np.zeros(0, np.int32))[1] == []


class _FakePS:
    """Records push_rows_flat_async arguments; pulls answer row = id in every column."""

    def __init__(self):
        self.pushed = None

    def push_rows_flat_async(self, tables, keys, rows):
        self.pushed = (tables, keys, rows)
        return "handle"

    def pull_flat_async(self, tables, keys):
        class H:
            def wait(self_inner):
                return np.repeat(keys.astype(np.float32)[:, None], 3, axis=1)

        return H()


def test_psio_push_and_pull_keep_key_order_across_tables():
    """One flat request over every table: the (table, id) pairs and their rows go out in
    the KeySet's order, and the pulled rows come back in it."""
    from herald.contracts.plan import KeySet
    from herald.worker import psio

    keys = KeySet(np.array([2, 0, 2, 1], np.int32), np.array([20, 5, 21, 7], np.uint64))
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    ps = _FakePS()
    assert psio.push_rows_async(ps, keys, rows) == "handle"
    tables, ids, pushed = ps.pushed
    np.testing.assert_array_equal(tables, [2, 0, 2, 1])
    np.testing.assert_array_equal(ids, [20, 5, 21, 7])
    np.testing.assert_array_equal(pushed, rows)
    got = psio.pull_keys(ps, keys, 3)
    np.testing.assert_array_equal(got[:, 0], [20, 5, 21, 7])


def test_member_is_exact_per_table():
    from herald.contracts.plan import KeySet
    from herald.worker.psio import member

    of = KeySet(np.array([0, 1], np.int32), np.array([5, 2**63 + 1], np.uint64))
    keys = KeySet(np.array([0, 1, 1, 0], np.int32), np.array([5, 5, 2**63 + 1, 2**63 + 1], np.uint64))
    assert member(keys, of).tolist() == [True, False, True, False]


def test_member_equals_a_set_of_pairs_sorted_or_not():
    """The binary search over (table, id) pairs (sorted first when they are not) answers what
    a Python set of the pairs does: repeated pairs, ids >= 2**63, empty sides."""
    from herald.contracts.plan import KeySet
    from herald.worker.psio import member

    rng = np.random.default_rng(7)
    for trial in range(200):
        n, m = (int(x) for x in rng.integers(0, 300, 2))
        pool = rng.integers(0, 2**64 if trial % 2 else 40, size=50, dtype=np.uint64)
        keys = KeySet(rng.integers(0, 4, n).astype(np.int32), rng.choice(pool, n))
        of = KeySet(rng.integers(0, 4, m).astype(np.int32), rng.choice(pool, m))
        if trial % 3 == 0:  # the plan's KeySets come sorted: the path without a sort
            order = np.lexsort((of.ids, of.table))
            of = KeySet(of.table[order], of.ids[order])
        pairs = set(zip(of.table.tolist(), of.ids.tolist()))
        want = [(t, i) in pairs for t, i in zip(keys.table.tolist(), keys.ids.tolist())]
        assert member(keys, of).tolist() == want


def _executor(world_size: int):
    """A PlanExecutor over a host cache and a fake PS (no sockets)."""
    from herald.phases import PhaseTimer
    from herald.worker.cache import EmbeddingCache
    from herald.worker.early_pulls import EarlyPulls
    from herald.worker.executor import PlanExecutor

    ex = PlanExecutor.__new__(PlanExecutor)
    ex.rank, ex.world_size, ex.dim = 0, world_size, 2
    ex.cache, ex.ps, ex.timer = EmbeddingCache(8, 3), _FakePS(), PhaseTimer()
    ex.bytes_pushed, ex._writes = 0, []
    ex.early = EarlyPulls(ex.cache, world_size, ex._fetch)
    return ex


def _keys(pairs):
    from herald.contracts.plan import KeySet

    return KeySet(np.array([t for t, _ in pairs], np.int32), np.array([i for _, i in pairs], np.uint64))


class _Step:
    """What ``EarlyPulls.own_write_backs`` reads of a micro-batch: step, plan.pull, pull_early."""

    def __init__(self, step, pull, early):
        from herald.contracts.plan import CachePlan

        self.step, self.pull_early = step, np.array(early, bool)
        self.plan = dataclasses.replace(CachePlan.empty(), pull=pull)


@pytest.mark.parametrize("world_size", [1, 2])
def test_own_write_backs_of_the_step_before_are_pulled_early(world_size):
    """NOTE [own write-backs]: a "wait" pull of a key this worker wrote back at step t and
    no longer holds may leave early for t + 1; one it still holds, or (with several
    workers) one it did not write back, still waits; nothing is taken across steps."""
    from herald.contracts.plan import CachePlan

    ex = _executor(world_size)
    held = _keys([(0, 1), (0, 2), (1, 3), (1, 4)])
    ex.cache.put(held, np.zeros((4, 3), np.float32))
    evict = _keys([(0, 1), (1, 3)])
    ex.evict(dataclasses.replace(CachePlan.empty(), evict=evict, write_back=np.array([True, True])), step=5)
    assert ex.ps.pushed is not None and ex.early._written_back[0] == 5
    pull = _keys([(0, 1), (0, 2), (1, 3), (2, 9), (1, 7)])
    own = ex.early.own_write_backs(_Step(6, pull, [False, False, True, False, False]))
    # (0,1): written back, not held -> early; (0,2): held -> waits; (1,3): already early;
    # (2,9), (1,7): not held, never written back: only a lone worker knows nobody else touched them
    lone = world_size == 1
    assert own.tolist() == [True, False, False, lone, lone]
    assert ex.early.own_write_backs(_Step(7, pull, [False] * 5)) is None  # not the step after the write-back
    ex.evict(CachePlan.empty(), step=6)  # a step without write-backs
    assert ex.early.own_write_backs(_Step(7, pull, [False] * 5)) is None

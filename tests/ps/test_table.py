"""Shard storage: open-addressing map, growth, write-back, exact aggregation (no sockets)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import ProtocolError
from herald.ps import apply_gradients, init_rows
from herald.ps.table import EmbeddingTable

ADAM = TableConfig("t", 8, OptimizerConfig("adam", lr=0.01), init="zeros")


def test_map_grows_and_finds_every_key():
    t = TableConfig("t", 4)
    table = EmbeddingTable(t, 2, seed=5, capacity_rows=16)
    rng = np.random.default_rng(1)
    keys = np.unique(rng.integers(0, 2**64 - 1, 50_000, dtype=np.uint64, endpoint=True))
    keys = np.concatenate([keys, np.array([0, 2**64 - 1], np.uint64)])
    for chunk in np.array_split(keys, 7):
        table.pull(chunk)
    assert table.n_rows == np.unique(keys).size
    rows, pending = table.pull(keys[::-1])
    assert pending == 0
    assert np.array_equal(rows, init_rows(t, 2, keys[::-1], 5))
    assert table.buckets.shape[0] >= 2 * table.n_rows  # load <= 1/2


def test_pull_allows_duplicates_push_rows_rejects_them():
    table = EmbeddingTable(ADAM, 0, 0)
    keys = np.array([3, 3, 4], np.uint64)
    rows, _ = table.pull(keys)
    assert np.array_equal(rows[0], rows[1])
    new = np.arange(3 * ADAM.row_width, dtype=np.float32).reshape(3, -1)
    with pytest.raises(ProtocolError, match="twice"):
        table.push_rows(keys, new)
    table.push_rows(np.array([3, 4], np.uint64), new[:2])
    assert np.array_equal(table.pull(np.array([4, 3], np.uint64))[0], new[1::-1])


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_aggregation_is_exact_in_any_arrival_order(order):
    table = EmbeddingTable(ADAM, 0, 0)
    keys = np.arange(40, dtype=np.uint64)
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal((40, 8)).astype(np.float32) * 10.0**r for r in range(3)]
    contrib = np.full(40, 3, np.uint16)
    for i, r in enumerate(order):
        applied = table.push_grad(keys, grads[r], contrib, step=5, rank=r)
        assert applied == (40 if i == 2 else 0)
        assert table.pull(keys[:2])[1] == (0 if i == 2 else 2)  # pending pulls are counted
    assert table.open_aggregations == 0
    expected = init_rows(ADAM, 0, keys, 0)
    total = np.zeros((40, 8), np.float32)
    for r in range(3):  # rank order
        total += grads[r]
    apply_gradients(expected, total, ADAM)
    assert np.array_equal(table.pull(keys)[0], expected)  # bit-identical


def test_aggregation_rejects_bad_pushes_without_changes():
    table = EmbeddingTable(ADAM, 0, 0)
    keys = np.arange(5, dtype=np.uint64)
    g = np.ones((5, 8), np.float32)
    table.push_grad(keys, g, np.full(5, 2, np.uint16), step=1, rank=0)
    before = table.pull(keys)[0]
    with pytest.raises(ProtocolError, match="already contributed"):
        table.push_grad(keys, g, np.full(5, 2, np.uint16), step=1, rank=0)
    with pytest.raises(ProtocolError, match="differ"):
        table.push_grad(keys, g, np.full(5, 3, np.uint16), step=1, rank=1)
    with pytest.raises(ProtocolError, match=">= 1"):
        table.push_grad(keys, g, np.zeros(5, np.uint16), step=2, rank=1)
    with pytest.raises(ProtocolError, match="twice"):
        table.push_grad(np.array([7, 7], np.uint64), g[:2], np.ones(2, np.uint16), step=2, rank=1)
    assert np.array_equal(table.pull(keys)[0], before)
    assert table.push_grad(keys, g, np.full(5, 2, np.uint16), step=1, rank=3) == 5
    with pytest.raises(ProtocolError, match="all its"):
        table.push_grad(keys, g, np.full(5, 2, np.uint16), step=1, rank=4)  # late contribution
    # a completed step still takes new keys
    assert table.push_grad(keys + 10, g, np.ones(5, np.uint16), step=1, rank=4) == 5
    assert table.push_grad(keys + 20, g, np.full(5, 2, np.uint16), step=1, rank=4) == 0
    assert table.push_grad(keys + 20, g, np.full(5, 2, np.uint16), step=1, rank=5) == 5
    assert table.open_aggregations == 0
    for step in range(2, 8):  # old completed steps are forgotten
        table.push_grad(keys, g, np.ones(5, np.uint16), step=step, rank=0)
        table.push_grad(keys + 100, g, np.full(5, 2, np.uint16), step=step, rank=0)
        table.push_grad(keys + 100, g, np.full(5, 2, np.uint16), step=step, rank=1)
    assert len(table.pending) <= 4


def test_mixed_single_and_shared_keys_and_growth_of_pending_state():
    t = TableConfig("t", 4, OptimizerConfig("sgd", lr=1.0), init="zeros")
    table = EmbeddingTable(t, 0, 0, capacity_rows=16)
    keys = np.arange(5000, dtype=np.uint64)
    contrib = np.where(keys % 2 == 0, 2, 1).astype(np.uint16)
    g = np.ones((5000, 4), np.float32)
    assert table.push_grad(keys, g, contrib, step=0, rank=1) == 2500
    assert table.push_grad(keys[::2].copy(), g[::2].copy(), contrib[::2].copy(), step=0, rank=0) == 2500
    rows = table.pull(keys)[0]
    assert np.all(rows[::2] == -2.0) and np.all(rows[1::2] == -1.0)


_KEY = st.one_of(st.integers(0, 40), st.sampled_from([2**64 - 1, 2**63, 2**32, 2**32 - 1]), st.integers(0, 2**64 - 1))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(_KEY, min_size=0, max_size=30, unique=True), min_size=1, max_size=12))
def test_map_agrees_with_a_dict_model(batches):
    """Writes then reads through the open-addressing map equal a Python dict's."""
    t = TableConfig("t", 2, init="zeros")
    table = EmbeddingTable(t, 0, 0, capacity_rows=16)
    model: dict[int, float] = {}
    for i, batch in enumerate(batches):
        keys = np.array(batch, np.uint64)
        table.push_rows(keys, np.full((keys.size, 2), float(i), np.float32))
        model.update({k: float(i) for k in batch})
        probe = np.array(list(model) + [12345678901], np.uint64)
        rows, _ = table.pull(probe)
        assert rows[:-1, 0].tolist() == list(model.values()) and rows[-1, 0] == 0.0
        model[12345678901] = 0.0  # the pull stored the unseen key
    assert table.n_rows == len(model)


def test_wrong_shapes_never_reach_the_kernels():
    table = EmbeddingTable(ADAM, 0, 0)
    keys = np.arange(4, dtype=np.uint64)
    with pytest.raises(ProtocolError):
        table.push_rows(keys, np.zeros((4, ADAM.row_width - 1), np.float32))
    with pytest.raises(ProtocolError):
        table.push_grad(keys, np.zeros((3, 8), np.float32), np.ones(4, np.uint16), 0, 0)
    with pytest.raises(ProtocolError):
        table.push_grad(keys, np.zeros((4, 8), np.float32), np.ones(4, np.int32), 0, 0)
    with pytest.raises(ProtocolError):
        table.pull(keys.astype(np.int64))


def test_a_steps_state_tuple_holds_its_current_arrays_in_the_kernels_order():
    """The kernels' ``agg`` tuple (herald/ps/kernels/aggregate.py) is rebuilt whenever a
    step's state replaces an array, in the order of STATE_FIELDS."""
    from herald.ps.aggregate import STATE_FIELDS, PendingStep

    state = PendingStep(4, 2, 8)
    for n in (4, 100, 1000):
        state.reserve(n, 8, 3)
        assert len(state.state) == len(STATE_FIELDS)
        assert all(a is getattr(state, name) for a, name in zip(state.state, STATE_FIELDS))
    state.free_gradients()
    assert state.state[STATE_FIELDS.index("e_grad")] is state.e_grad and state.e_grad.shape[0] == 0

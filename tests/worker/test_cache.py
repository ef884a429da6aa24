import random

import numpy as np
import pytest

from herald.contracts.plan import KeySet
from herald.errors import ProtocolError
from herald.worker.cache import EmbeddingCache


def _ks(keys):
    return KeySet(np.array([k[0] for k in keys], np.int32), np.array([k[1] for k in keys], np.uint64))


@pytest.mark.parametrize("seed", range(4))
def test_cache_matches_dict_under_random_plans(seed):
    """Random evict/put sequences near full capacity (stresses backward-shift deletion)."""
    rng = random.Random(seed)
    cap = 64
    cache, ref = EmbeddingCache(cap, 2), {}
    universe = [(t, i + (2**63 + 7 if i % 3 == 0 else 0)) for t in range(3) for i in range(60)]
    for _ in range(400):
        victims = rng.sample(sorted(ref), k=min(len(ref), rng.randrange(0, 12)))
        wb = np.array([rng.random() < 0.5 for _ in victims], bool)
        out = cache.evict(_ks(victims), wb)
        assert np.array_equal(out, np.array([ref[k] for k, w in zip(victims, wb) if w], np.float32).reshape(-1, 2))
        for k in victims:
            del ref[k]
        room = cap - len(ref)
        fresh = rng.sample([k for k in universe if k not in ref], k=rng.randrange(0, room + 1))
        again = rng.sample(sorted(ref), k=min(len(ref), 3))
        keys = fresh + again
        rows = np.array([[rng.random(), rng.random()] for _ in keys], np.float32).reshape(-1, 2)
        cache.put(_ks(keys), rows)
        ref.update({k: r for k, r in zip(keys, rows)})
        assert cache.keys() == set(ref) and len(cache) == len(ref)
    got = cache.rows[cache.slots(_ks(sorted(ref)))]
    assert np.array_equal(got, np.array([ref[k] for k in sorted(ref)], np.float32))


def test_cache_rejects_plans_that_break_it():
    cache = EmbeddingCache(2, 1)
    cache.put(_ks([(0, 1), (0, 2)]), np.zeros((2, 1), np.float32))
    with pytest.raises(ProtocolError, match="free slots"):
        cache.put(_ks([(0, 3)]), np.zeros((1, 1), np.float32))
    with pytest.raises(ProtocolError, match="snapshot disagree"):
        cache.slots(_ks([(1, 1)]))


# ------------------------------------------------ lookup_pooled and apply_gradients
def _layout(rng, tables, batch, cached):
    """A micro-batch over ``cached`` (list per table of uint64 ids in the cache): its keys
    (distinct, sorted per table) and :class:`BagLayout`."""
    from herald.worker.cache import BagLayout

    uniq, inv, offs = [], [], []
    for t in range(tables):
        off = np.zeros(batch + 1, np.int64)
        np.cumsum(rng.integers(0, 5, batch), out=off[1:])
        vals = rng.choice(cached[t], off[-1])
        u, i = np.unique(vals, return_inverse=True)
        uniq.append(u), inv.append(i.astype(np.int32)), offs.append(off)
    id_bounds = np.zeros(tables + 1, np.int64)
    np.cumsum([u.shape[0] for u in uniq], out=id_bounds[1:])
    inverse_bounds = np.zeros(tables + 1, np.int64)
    np.cumsum([i.shape[0] for i in inv], out=inverse_bounds[1:])
    keys = KeySet(np.repeat(np.arange(tables, dtype=np.int32), np.diff(id_bounds)), np.concatenate(uniq))
    return keys, BagLayout(id_bounds, np.concatenate(inv), inverse_bounds, np.stack(offs))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_lookup_pooled_step_equals_the_gather_embedding_bag_step(optimizer):
    """Pooled embeddings bit-identical; row gradients bit-identical for rows used once and
    within the rounding of a float32 sum otherwise (NOTE [fused bag kernels]); the update
    is the PS's (herald.ps.apply_gradients) bit for bit."""
    import torch
    import torch.nn.functional as F

    from herald.contracts.tables import OptimizerConfig, TableConfig
    from herald.ps import apply_gradients

    rng = np.random.default_rng(7)
    tcfg = TableConfig("t", 8, OptimizerConfig(optimizer, lr=0.05, initial_accumulator=0.1))
    tables, per = 3, 40
    cached = [np.unique(rng.integers(0, 2**64 - 1, per, dtype=np.uint64)) for _ in range(tables)]
    all_keys = KeySet(
        np.repeat(np.arange(tables, dtype=np.int32), [c.shape[0] for c in cached]), np.concatenate(cached)
    )
    cache = EmbeddingCache(len(all_keys) + 5, tcfg.row_width)
    cache.put(all_keys, rng.uniform(0.01, 0.5, (len(all_keys), tcfg.row_width)).astype(np.float32))
    for _ in range(5):
        keys, bags = _layout(rng, tables, 16, cached)
        slots = cache.slots(keys)
        leaf = torch.from_numpy(cache.read(slots)[:, : tcfg.dim]).requires_grad_(True)
        inputs = bags.inverse.astype(np.int64) + np.repeat(bags.id_bounds[:-1], np.diff(bags.inverse_bounds))
        starts = (bags.offsets[:, :-1] + bags.inverse_bounds[:-1, None]).reshape(-1)
        ref = F.embedding_bag(torch.from_numpy(inputs), leaf, torch.from_numpy(starts), mode="sum")
        ref = ref.view(tables, 16, tcfg.dim).transpose(0, 1)
        pooled, grads = cache.lookup_pooled(slots, bags, tcfg.dim, divisor=2.0)
        assert pooled.shape == (16, tables, tcfg.dim) and np.array_equal(pooled.detach().numpy(), ref.detach().numpy())
        go = torch.from_numpy(rng.standard_normal((16, tables, tcfg.dim)).astype(np.float32))
        (pooled * go).sum().backward()
        ref.backward(go)
        want = (leaf.grad / torch.tensor(2.0)).numpy()
        once = np.bincount(inputs, minlength=len(keys)) <= 1
        assert np.array_equal(grads.rows[once], want[once])
        np.testing.assert_allclose(grads.rows, want, rtol=1e-5, atol=1e-6)
        before = cache.read(slots).copy()
        cache.apply_gradients(slots, torch.from_numpy(grads.rows), np.arange(len(keys)), tcfg)
        assert np.array_equal(cache.read(slots), apply_gradients(before, grads.rows, tcfg))


def test_lookup_pooled_and_apply_gradients_reject_what_does_not_fit():
    from herald.contracts.tables import TableConfig
    from herald.errors import ConfigError
    from herald.worker.cache import BagLayout

    cache = EmbeddingCache(4, 3)
    idb, inv, ib, off = (
        np.array([0, 2], np.int64),
        np.array([0, 1, 1], np.int32),
        np.array([0, 3], np.int64),
        np.array([[0, 1, 3]], np.int64),
    )
    slots = np.array([0, 3], np.int64)
    pooled, _ = cache.lookup_pooled(slots, BagLayout(idb, inv, ib, off), 3)
    assert pooled.shape == (2, 1, 3)
    bad = [
        (np.array([0, 4], np.int64), BagLayout(idb, inv, ib, off), 3),  # slot beyond the cache
        (slots, BagLayout(idb, np.array([0, 2, 1], np.int32), ib, off), 3),  # value beyond the table
        (slots, BagLayout(idb, inv, ib, np.array([[0, 2, 1]], np.int64)), 3),  # offsets decrease
        (slots, BagLayout(idb, inv, ib, np.array([[0, 1, 2]], np.int64)), 3),  # offsets miss a value
        (slots, BagLayout(idb, inv.astype(np.int64), ib, off), 3),  # inverse dtype
        (slots.astype(np.int32), BagLayout(idb, inv, ib, off), 3),  # slots dtype
        (slots, BagLayout(idb, inv, ib, off), 4),
    ]  # dim beyond the row
    for s, layout, dim in bad:
        with pytest.raises(ProtocolError, match="BagLayout.of"):
            cache.lookup_pooled(s, layout, dim)
    table = TableConfig("t", 3)
    with pytest.raises(ConfigError, match="grads must be float32"):
        cache.apply_gradients(slots, np.zeros((2, 2), np.float32), np.arange(2), table)
    with pytest.raises(ProtocolError, match="outside"):
        cache.apply_gradients(np.array([0, 4]), np.zeros((2, 3), np.float32), np.arange(2), table)
    with pytest.raises(ProtocolError, match="outside"):
        cache.apply_gradients(slots, np.zeros((2, 3), np.float32), np.array([0, 2]), table)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_apply_gradients_is_the_ps_update_bit_for_bit(optimizer, weight_decay):
    """The cache's prefetching, inlined loop (herald.worker.kernels.apply_rows_at_jit) gives
    the PS's rows (herald.ps.apply_gradients) exactly, over several steps."""
    import torch

    from herald.contracts.tables import OptimizerConfig, TableConfig
    from herald.ps import apply_gradients

    rng = np.random.default_rng(11)
    for dim in (1, 5, 16, 64):
        tcfg = TableConfig(
            "t", dim, OptimizerConfig(optimizer, lr=0.03, weight_decay=weight_decay, initial_accumulator=0.1)
        )
        cache = EmbeddingCache(300, tcfg.row_width)
        cache.rows[:] = rng.uniform(0.0, 0.5, cache.rows.shape).astype(np.float32)
        slots = rng.choice(300, 120, replace=False).astype(np.int64)
        for _ in range(3):
            grads = (rng.standard_normal((150, dim)) * 10.0 ** rng.integers(-4, 2, (150, 1))).astype(np.float32)
            grad_rows = rng.integers(0, 150, 120)
            want = apply_gradients(cache.rows[slots].copy(), grads[grad_rows], tcfg)
            cache.apply_gradients(slots, torch.from_numpy(grads), grad_rows, tcfg)
            assert np.array_equal(cache.rows[slots], want)


def test_slots_found_stay_the_keys_until_a_key_leaves():
    """PlanExecutor.update_local reuses the slots its lookup found (StepRows.cache_slots)
    while the cache's ``removals`` is unchanged: inserts take free slots and overwrites keep
    theirs, so those slots are still the keys'; an eviction or a clear counts a removal."""
    import torch

    from herald.worker.rows import StepRows

    cache = EmbeddingCache(16, 2)
    a = _ks([(0, 1), (1, 2), (0, 3)])
    cache.put(a, np.ones((3, 2), np.float32))
    found = StepRows(torch.zeros(3, 2), a.ids, np.array([0, 2, 3]), cache.slots(a), cache.removals)
    cache.put(_ks([(2, 9), (0, 1)]), np.zeros((2, 2), np.float32))  # an insert and an overwrite
    assert np.array_equal(found.cache_slots(cache, np.array([2, 0])), cache.slots(a)[[2, 0]])
    cache.evict(_ks([(2, 9)]), np.zeros(1, bool))
    assert found.cache_slots(cache, np.array([0])) is None
    again = StepRows(torch.zeros(3, 2), a.ids, np.array([0, 2, 3]), cache.slots(a), cache.removals)
    cache.clear()
    assert again.cache_slots(cache, np.array([0])) is None
    assert StepRows(torch.zeros(1, 2), a.ids[:1], np.array([0, 1])).cache_slots(cache, np.array([0])) is None

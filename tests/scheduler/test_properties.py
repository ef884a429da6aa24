"""Protocol properties: allocation, plan pushes, PS freshness, capacity, 64-bit ids."""

from __future__ import annotations

import numpy as np
import pytest

from herald.contracts.vocab import SCHEDULES
from herald.errors import ConfigError, DataError
from herald.scheduler import Scheduler, SchedulerConfig

from .executor import execute
from .helpers import keylist, random_batches, run_scheduler
from .reference import sample_keys

SCHEDS = [s for s in sorted(SCHEDULES) if s != "optimal"]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("schedule", SCHEDS)
def test_plans_execute_consistently(schedule, policy):
    W, Bw, T, cap = 4, 3, 3, 20
    batches = random_batches(7, 12, W * Bw, T, vocab=25, max_len=2)
    cfg = SchedulerConfig(
        num_workers=W, batch_size_per_worker=Bw, schedule=schedule, cache_policy=policy, cache_capacity_rows=cap, seed=3
    )
    plans, sched = run_scheduler(batches, cfg, T)
    cache, ps, latest = execute(batches, plans, cap, W)
    # worker caches equal the snapshots by construction
    snaps = sched.snapshots
    for w in range(W):
        slots = snaps.cached_slots(w)
        snap_keys = set(zip(snaps.slot_tab[slots].tolist(), snaps.slot_ids[slots].tolist()))
        assert snap_keys == set(cache[w])
        assert len(snap_keys) <= sched.capacity_rows
    # final write-back leaves the PS with the final model
    for w, ks in enumerate(sched.flush()):
        for k in keylist(ks):
            assert cache[w][k] == latest[k]
            ps[k] = latest[k]
    assert all(ps[k] == v for k, v in latest.items())


@pytest.mark.parametrize("schedule", SCHEDS)
def test_allocation_partitions_equally(schedule):
    W, Bw = 5, 4
    batches = random_batches(3, 6, W * Bw, 2, vocab=30)
    cfg = SchedulerConfig(num_workers=W, batch_size_per_worker=Bw, schedule=schedule, cache_capacity_rows=64)
    plans, _ = run_scheduler(batches, cfg, 2)
    for p in plans:
        assert [len(a) for a in p.assignment] == [Bw] * W
        assert all(a.dtype == np.int64 for a in p.assignment)
        assert sorted(np.concatenate(p.assignment).tolist()) == list(range(W * Bw))
        assert all(np.all(np.diff(a) > 0) for a in p.assignment)


@pytest.mark.parametrize("schedule", ["plan", "herald", "costaware"])
def test_plan_push_only_for_keys_used_by_another_worker_next_step(schedule):
    W, Bw, T = 4, 3, 2
    batches = random_batches(11, 10, W * Bw, T, vocab=15)
    cfg = SchedulerConfig(num_workers=W, batch_size_per_worker=Bw, schedule=schedule, cache_capacity_rows=30)
    plans, _ = run_scheduler(batches, cfg, T)
    pushed = 0
    for t, p in enumerate(plans):
        for w, cp in enumerate(p.plans):
            if t + 1 == len(plans):
                assert len(cp.plan_push) == 0, "the last step has no plan pushes"
                continue
            nxt = plans[t + 1]
            others = set()
            for v in range(W):
                if v != w:
                    for i in nxt.assignment[v]:
                        others.update(sample_keys(batches[t + 1], int(i)))
            assert set(keylist(cp.plan_push)) <= others
            pushed += len(cp.plan_push)
    assert pushed > 0


def test_full_sync_pushes_every_key():
    W, Bw, T = 3, 2, 2
    batches = random_batches(5, 5, W * Bw, T, vocab=10)
    cfg = SchedulerConfig(num_workers=W, batch_size_per_worker=Bw, schedule="vanilla", cache_capacity_rows=20)
    plans, sched = run_scheduler(batches, cfg, T)
    for b, p in zip(batches, plans):
        for w, cp in enumerate(p.plans):
            ks = {k for i in p.assignment[w] for k in sample_keys(b, int(i))}
            assert set(keylist(cp.grad_push)) == ks
            assert len(cp.plan_push) == 0
    assert all(len(f) == 0 for f in sched.flush())


def test_ids_above_2_63_survive():
    big = np.array([2**64 - 1, 2**63, 2**63 + 12345, 7], np.uint64)
    from herald.loader.batch import SampleBatch

    b = SampleBatch.from_single_hot(np.zeros(4, np.float32), np.zeros((4, 0), np.float32), big.reshape(4, 1))
    cfg = SchedulerConfig(num_workers=2, batch_size_per_worker=2, schedule="herald", cache_capacity_rows=4)
    plans, sched = run_scheduler([b, b], cfg, 1)
    got = set()
    for cp in plans[0].plans:
        assert cp.pull.ids.dtype == np.uint64
        got |= set(cp.pull.ids.tolist())
    assert got == set(big.tolist())
    assert set(sched.snapshots.slot_ids[:4].tolist()) == set(big.tolist())


def test_capacity_overflow_names_the_fix():
    batches = random_batches(1, 2, 4, 3, vocab=50, max_len=3)
    cfg = SchedulerConfig(num_workers=2, batch_size_per_worker=2, cache_capacity_rows=2)
    with pytest.raises(ConfigError, match="bigger cache"):
        run_scheduler(batches, cfg, 3)


def test_capacity_from_ratio_and_errors():
    cfg = SchedulerConfig(num_workers=2, batch_size_per_worker=2, cache_ratio=0.1)
    assert Scheduler(cfg, 1, distinct_keys=1001).capacity_rows == 101
    with pytest.raises(ConfigError, match="distinct_keys"):
        Scheduler(cfg, 1)
    with pytest.raises(ConfigError, match="schedule"):
        SchedulerConfig(schedule="nope")
    with pytest.raises(ConfigError):
        SchedulerConfig(num_workers=65)
    with pytest.raises(ConfigError):
        SchedulerConfig(schedule="optimal", batch_size_per_worker=2)
    s = Scheduler(SchedulerConfig(num_workers=2, batch_size_per_worker=2, cache_capacity_rows=8), 1)
    with pytest.raises(DataError, match="samples"):
        s.submit(random_batches(0, 1, 3, 1)[0])


def test_key_state_growth_keeps_everything():
    """Slots and snapshot state survive regrowth (1,024 initial slots, ~6,000 keys)."""
    W, Bw, T = 2, 50, 2
    rng = np.random.default_rng(0)
    from herald.loader.batch import SampleBatch

    batches = []
    for _ in range(30):
        ids = rng.integers(0, 3000, size=(W * Bw, T)).astype(np.uint64) | np.uint64(2**63)
        batches.append(
            SampleBatch.from_single_hot(np.zeros(W * Bw, np.float32), np.zeros((W * Bw, 0), np.float32), ids)
        )
    runs = []
    for dk in (None, 10_000):
        cfg = SchedulerConfig(num_workers=W, batch_size_per_worker=Bw, schedule="herald", cache_capacity_rows=300)
        plans, sched = run_scheduler(batches, cfg, T, distinct_keys=dk)
        runs.append((plans, sched))
    (pa, sa), (pb, sb) = runs
    assert sa.snapshots.slot_ids.shape[0] < sb.snapshots.slot_ids.shape[0]  # a grew, b did not
    for x, y in zip(pa, pb):
        np.testing.assert_array_equal(x.counts, y.counts)
        for cx, cy in zip(x.plans, y.plans):
            assert keylist(cx.pull) == keylist(cy.pull) and keylist(cx.evict) == keylist(cy.evict)
    execute(batches, pa, 300, W)


def test_simulate_and_bytes():
    from herald.scheduler.simulate import simulate, to_bytes

    W, Bw, T = 3, 4, 2
    batches = random_batches(8, 6, W * Bw, T, vocab=20)
    cfg = SchedulerConfig(num_workers=W, batch_size_per_worker=Bw, schedule="costaware", cache_capacity_rows=30)
    r = simulate(batches, cfg, T)
    plans, _ = run_scheduler(batches, cfg, T)
    np.testing.assert_array_equal(r.counts, np.stack([p.counts for p in plans]))
    assert r.transmissions == int(r.counts[:, :, 1:].sum()) and r.submit_ms.shape == (6,)
    b = to_bytes(r.counts, 16, "float16")
    assert b.dtype == np.int64 and np.all(b[..., 0] == 0)
    np.testing.assert_array_equal(b[..., 1:], r.counts[..., 1:] * 32)

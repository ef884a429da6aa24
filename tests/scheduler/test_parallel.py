"""The parallel scheduler (Herald §4.4, "Multi-threading"): with threads > 1 the plans are
those of one thread, bit for bit; the lock-free allocation is valid, deterministic and
close to the serial one in transmissions."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from herald.bench.scheduler import load_batches
from herald.contracts.vocab import SCHEDULES
from herald.errors import ConfigError
from herald.loader.splits import count_distinct_keys
from herald.scheduler import SchedulerConfig
from herald.scheduler import parallel_kernels as PK
from herald.scheduler.simulate import simulate

from .executor import execute
from .helpers import random_batches, run_scheduler

SCHEDS = [s for s in sorted(SCHEDULES) if s != "optimal"]
THREADS = 2  # what numba's pool has on a 2-core machine (the chunked kernels are also tested with 3 below)


def _same_plans(a, b):
    assert len(a) == len(b)
    for p, q in zip(a, b):
        assert p.step == q.step
        assert np.array_equal(p.counts, q.counts)
        assert all(np.array_equal(x, y) for x, y in zip(p.assignment, q.assignment))
        for x, y in zip(p.plans, q.plans):
            for name in ("evict", "pull", "grad_push", "update_local", "plan_push"):
                kx, ky = getattr(x, name), getattr(y, name)
                assert np.array_equal(kx.table, ky.table) and np.array_equal(kx.ids, ky.ids), name
            assert np.array_equal(x.write_back, y.write_back)
            assert np.array_equal(x.contributors, y.contributors)


def _run_both(batches, T, threads=THREADS, distinct=None, **kw):
    plans = {}
    for n in (1, threads):
        cfg = SchedulerConfig(threads=n, **kw)
        plans[n], sched = run_scheduler(batches, cfg, T, distinct_keys=distinct)
        plans[n] = (plans[n], [ks.ids.tolist() for ks in sched.flush()], sched)
    return plans[1], plans[threads]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("schedule", SCHEDS)
def test_threads_give_the_plans_of_one_thread(schedule, policy):
    # multi-hot with repeated keys in a sample (the dedup paths), a small cache (evictions,
    # write-backs, plan pushes) and 5 workers (uneven split over the threads)
    W, Bw, T, cap = 5, 6, 3, 40
    batches = random_batches(21, 14, W * Bw, T, vocab=40, max_len=3)
    one, many = _run_both(
        batches,
        T,
        num_workers=W,
        batch_size_per_worker=Bw,
        schedule=schedule,
        cache_policy=policy,
        cache_capacity_rows=cap,
        seed=5,
    )
    _same_plans(one[0], many[0])
    assert one[1] == many[1]  # flush: the same dirty keys per worker
    execute(batches, many[0], cap, W)  # and they execute consistently


@pytest.mark.parametrize("schedule", ["herald", "costaware"])
def test_threads_with_adaptive_laia_give_the_plans_of_one_thread(schedule):
    # the table profiler counts every key occurrence (atomic adds on several threads)
    W, Bw, T = 4, 8, 4
    batches = random_batches(3, 20, W * Bw, T, vocab=60, max_len=2)
    one, many = _run_both(
        batches,
        T,
        num_workers=W,
        batch_size_per_worker=Bw,
        schedule=schedule,
        cache_capacity_rows=60,
        adaptive_num_tables=2,
        profile_interval_steps=3,
    )
    _same_plans(one[0], many[0])
    assert np.array_equal(
        one[2].snapshots.freq[: one[2].snapshots.num_keys], many[2].snapshots.freq[: many[2].snapshots.num_keys]
    )


def test_threads_on_the_criteo_sample_with_a_growing_key_map(data_dir):
    # no distinct_keys: the key state starts small and grows while the parallel lookup
    # inserts the batch's new keys (slots must be numbered as by the serial lookup)
    batches, tables, _ = load_batches(str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv"), 512)
    one, many = _run_both(
        batches[:6], len(tables), num_workers=8, batch_size_per_worker=64, schedule="herald", cache_capacity_rows=2000
    )
    _same_plans(one[0], many[0])
    n = one[2].snapshots.num_keys
    assert n == many[2].snapshots.num_keys > 1 << 10
    assert np.array_equal(one[2].snapshots.slot_ids[:n], many[2].snapshots.slot_ids[:n])


@pytest.mark.parametrize("nchunks", [1, 2, 3, 8])
def test_chunked_kernels_equal_the_serial_ones(nchunks):
    # the prange kernels split their loops into nchunks parts whatever numba's pool size
    from herald.scheduler import kernels as K

    rng = np.random.default_rng(nchunks)
    B, W, Bw = 48, 6, 8
    lens = rng.integers(0, 4, B)
    samp_off = np.zeros(B + 1, np.int64)
    np.cumsum(lens, out=samp_off[1:])
    nnz = int(samp_off[-1])
    samp_slot = rng.integers(0, 30, nnz).astype(np.int32)
    samp_tab = np.concatenate([np.sort(rng.integers(0, 3, n)) for n in lens]).astype(np.int16)
    valid = rng.integers(0, 2**W, 30).astype(np.uint64)
    table_on = np.array([True, False, True])
    mark = np.zeros(30, np.int32)
    want = np.empty(B, np.int32)
    K.laia_alloc_jit(
        samp_off,
        samp_slot,
        samp_tab,
        table_on,
        valid,
        mark,
        np.zeros(1, np.int64),
        W,
        Bw,
        np.array([7], np.uint64),
        want,
    )
    score = np.empty((B, W))
    PK.laia_scores_par_jit(samp_off, samp_slot, samp_tab, table_on, valid, nchunks, score)
    got = np.empty(B, np.int32)
    r = np.array([7], np.uint64)
    PK.laia_pick_jit(score, Bw, r, got, 0, B)
    assert got.tolist() == want.tolist()
    lock_free = np.empty(B, np.int32)
    r2 = np.array([7], np.uint64)
    PK.laia_pick_lockfree_par_jit(score, Bw, nchunks, r2, lock_free)
    assert r2[0] == r[0]  # B draws either way
    assert np.bincount(lock_free, minlength=W).tolist() == [Bw] * W
    if nchunks == 1:
        assert lock_free.tolist() == want.tolist()


def test_lock_free_allocation_is_valid_deterministic_and_close_on_criteo(data_dir):
    batches, tables, _ = load_batches(str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv"), 1024)
    distinct = count_distinct_keys(batches)
    kw = {"num_workers": 8, "batch_size_per_worker": 128, "schedule": "herald"}
    serial = simulate(batches, SchedulerConfig(**kw), len(tables), distinct)
    runs = [
        simulate(batches, SchedulerConfig(threads=THREADS, lock_free_allocation=True, **kw), len(tables), distinct)
        for _ in range(2)
    ]
    assert np.array_equal(runs[0].counts, runs[1].counts)  # same input, same output
    # Herald §4.4 trades allocation quality for parallelism: measured +0.87% here
    # (docs/scheduler.md); the target is within 1% of the single-threaded allocation
    assert abs(runs[0].transmissions / serial.transmissions - 1) < 0.01
    plans, _ = run_scheduler(
        batches, SchedulerConfig(threads=THREADS, lock_free_allocation=True, **kw), len(tables), distinct_keys=distinct
    )
    for p in plans:
        assert sorted(np.concatenate(p.assignment).tolist()) == list(range(1024))
        assert [len(a) for a in p.assignment] == [128] * 8


def test_threads_settings_are_checked():
    pool = numba.config.NUMBA_NUM_THREADS
    with pytest.raises(ConfigError, match="NUMBA_NUM_THREADS"):
        run_scheduler([], SchedulerConfig(threads=pool + 1, cache_capacity_rows=10), 2)
    with pytest.raises(ConfigError, match="lock_free_allocation applies to LAIA"):
        SchedulerConfig(schedule="costaware", threads=2, lock_free_allocation=True)
    with pytest.raises(ConfigError, match="threads must be an int"):
        SchedulerConfig(threads=0)

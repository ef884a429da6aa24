"""Exact accounting and exact CachePlans against the pure-Python reference."""

from __future__ import annotations

import numpy as np
import pytest

from herald.contracts.plan import CAUSES
from herald.contracts.vocab import SCHEDULES
from herald.scheduler import SchedulerConfig
from herald.scheduler.config import POLICIES

from .helpers import keylist, random_batches, run_scheduler
from .reference import RefScheduler


def _case(seed):
    rng = np.random.default_rng(1000 + seed)
    W = int(rng.integers(2, 5))
    Bw = int(rng.integers(1, 4))
    T = int(rng.integers(1, 4))
    max_len = 2
    cap = Bw * max_len * T + int(rng.integers(0, 4))
    vocab = int(rng.integers(6, 30))
    steps = int(rng.integers(3, 9))
    return W, Bw, T, max_len, cap, vocab, steps


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("seed", range(6))
def test_matches_reference(schedule, policy, seed):
    W, Bw, T, max_len, cap, vocab, steps = _case(seed)
    if schedule == "optimal":
        Bw, cap = 1, max_len * T + seed % 3
    batches = random_batches(seed, steps, W * Bw, T, vocab=vocab, max_len=max_len)
    cfg = SchedulerConfig(
        num_workers=W,
        batch_size_per_worker=Bw,
        schedule=schedule,
        cache_policy=policy,
        cache_capacity_rows=cap,
        seed=seed,
    )
    plans, sched = run_scheduler(batches, cfg, T)
    alloc, full_sync = POLICIES[schedule]
    ref = RefScheduler(W, Bw, cap, policy, full_sync, alloc if alloc in ("random", "laia") else "external", seed)
    for b, p in zip(batches, plans):
        worker_of = np.empty(len(b), np.int64)
        for w, idx in enumerate(p.assignment):
            worker_of[idx] = w
        ref.submit(b, external=worker_of.tolist())
    ref.finish()
    assert len(ref.done) == len(plans) == steps
    for p, r in zip(plans, ref.done):
        worker_of = np.empty(W * Bw, np.int64)
        for w, idx in enumerate(p.assignment):
            worker_of[idx] = w
        assert worker_of.tolist() == list(r["worker_of"]), f"step {p.step}: allocation differs"
        expect = np.array([[r["counts"][w][c] for c in CAUSES] for w in range(W)])
        np.testing.assert_array_equal(p.counts, expect, err_msg=f"step {p.step} counts")
        for w, cp in enumerate(p.plans):
            assert keylist(cp.evict) == r["evict"][w]
            assert cp.write_back.tolist() == r["write_back"][w]
            assert keylist(cp.pull) == r["pull"][w]
            assert keylist(cp.grad_push) == r["grad_push"][w]
            assert cp.contributors.tolist() == r["contributors"][w]
            assert keylist(cp.update_local) == r["update_local"][w]
            assert keylist(cp.plan_push) == r["plan_push"][w]
            assert cp.contributors.dtype == np.uint16 and cp.write_back.dtype == np.bool_
    np.testing.assert_array_equal(sched.totals(), sum(p.counts for p in plans))
    flush = sched.flush()
    dirty = ref.dirty()
    for w in range(W):
        assert flush[w].as_set() == dirty[w]
    if full_sync:
        assert all(len(f) == 0 for f in flush)

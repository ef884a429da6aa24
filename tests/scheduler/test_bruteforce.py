"""The brute-force scheduler is step-optimal (checked against the reference on every permutation)."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest

from herald.scheduler import SchedulerConfig

from .helpers import random_batches, run_scheduler
from .reference import RefScheduler


def _step_cost(ref, batch, worker_of):
    r = copy.deepcopy(ref)
    before = sum(sum(c[k] for k in c if k != "hit") for rec in r.done for c in rec["counts"])
    r.submit(batch, external=worker_of)
    r.finish()
    after = sum(sum(c[k] for k in c if k != "hit") for rec in r.done for c in rec["counts"])
    # finish() closes the new step without plan pushes: cost = previous plan pushes + this step
    return after - before


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("seed", range(3))
def test_optimal_is_step_optimal(policy, seed):
    W, T, cap = 4, 2, 4 + seed
    batches = random_batches(seed, 7, W, T, vocab=8, max_len=2)
    cfg = SchedulerConfig(
        num_workers=W, batch_size_per_worker=1, schedule="optimal", cache_policy=policy, cache_capacity_rows=cap
    )
    plans, _ = run_scheduler(batches, cfg, T)
    ref = RefScheduler(W, 1, cap, policy, False, "external", 0)
    for b, p in zip(batches, plans):
        chosen = np.empty(W, np.int64)
        for w, idx in enumerate(p.assignment):
            chosen[idx] = w
        costs = [_step_cost(ref, b, list(perm)) for perm in itertools.permutations(range(W))]
        assert _step_cost(ref, b, chosen.tolist()) == min(costs)
        ref.submit(b, external=chosen.tolist())


def test_quality_ratio_bounds():
    from herald.scheduler.simulate import quality_ratios

    batches = random_batches(4, 20, 8, 2, vocab=20, max_len=1, single_hot=True)
    q = quality_ratios(batches, num_workers=8, num_tables=2, cache_capacity_rows=6, schedules=("herald", "costaware"))
    assert set(q) == {"herald", "costaware"}
    assert all(0 < v <= 1.5 for v in q.values())

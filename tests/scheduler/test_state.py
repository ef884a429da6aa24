"""Scheduler.state_dict / load_state_dict (NOTE [scheduler state]): valid at a
checkpoint barrier only; a restored scheduler schedules exactly like the fresh one
the dispatcher starts after a barrier."""

from __future__ import annotations

import json

import numpy as np
import pytest

from herald.contracts.plan import CAUSES
from herald.errors import ConfigError, DataError, HeraldError
from herald.scheduler import Scheduler, SchedulerConfig

from .helpers import random_batches

W, BW, T = 3, 8, 4
CFG = SchedulerConfig(num_workers=W, batch_size_per_worker=BW, schedule="herald", cache_capacity_rows=40, seed=5)


def _roundtrip(state):
    return json.loads(json.dumps(state))


def _plans(sched, batches):
    out = [sched.submit(b) for b in batches]
    out.append(sched.finish())
    return [p for p in out if p is not None]


def test_state_at_barrier_restores_the_fresh_scheduler():
    batches = random_batches(11, 10, W * BW, T, vocab=60)
    first = Scheduler(CFG, T)
    _plans(first, batches[:4])
    first.flush()
    state = _roundtrip(first.state_dict())
    assert state["next_step"] == 4 and np.array_equal(state["totals"], first.totals())

    restored = Scheduler(CFG, T)
    restored.load_state_dict(state)
    fresh = Scheduler(CFG, T)  # what the dispatcher makes after the barrier
    got, want = _plans(restored, batches[4:]), _plans(fresh, batches[4:])
    assert [p.step for p in got] == list(range(4, 10))
    for a, b in zip(got, want):
        assert all(np.array_equal(x, y) for x, y in zip(a.assignment, b.assignment))
        assert np.array_equal(a.counts, b.counts)
    assert np.array_equal(restored.totals(), first.totals() + fresh.totals())


def test_state_is_refused_mid_run():
    batches = random_batches(2, 3, W * BW, T)
    s = Scheduler(CFG, T)
    assert s.state_dict()["next_step"] == 0  # fresh: valid
    s.submit(batches[0])
    with pytest.raises(HeraldError, match="checkpoint barrier"):
        s.state_dict()
    s.finish()
    with pytest.raises(HeraldError):  # finished, not flushed
        s.state_dict()
    s.flush()
    assert s.state_dict()["next_step"] == 1
    with pytest.raises(HeraldError, match="fresh scheduler"):
        s.load_state_dict(Scheduler(CFG, T).state_dict())


def test_malformed_and_mismatched_states():
    good = Scheduler(CFG, T).state_dict()
    cases = [
        (None, DataError),
        ({**good, "format": "dispatcher"}, DataError),
        ({**good, "next_step": -1}, DataError),
        ({**good, "next_step": "3"}, DataError),
        ({**good, "totals": [[0] * len(CAUSES)]}, DataError),
        ({**good, "totals": [[0.5] * len(CAUSES)] * W}, DataError),
        ({**good, "totals": [[-1] * len(CAUSES)] * W}, DataError),
        ({**good, "config": {"seed": 5}}, DataError),
        ({**good, "config": {**good["config"], "seed": 6}}, ConfigError),
        ({**good, "num_tables": T + 1}, ConfigError),
        ({**good, "capacity_rows": 41}, ConfigError),
    ]
    for state, err in cases:
        with pytest.raises(err):
            Scheduler(CFG, T).load_state_dict(state)
    with pytest.raises(ConfigError, match="seed=6"):
        Scheduler(CFG, T).load_state_dict({**good, "config": {**good["config"], "seed": 6}})

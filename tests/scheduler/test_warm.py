"""Scheduler.warm_state / load_warm_state (herald/scheduler/warm.py, NOTE [warm resume] in
herald/dispatch/warm.py): a scheduler stopped between two checkpoint barriers and
restored from its warm state schedules every later step exactly as the uninterrupted
one, the stopped step's plan pushes included."""

from __future__ import annotations

import io

import numpy as np
import pytest

from herald.errors import ConfigError, DataError, HeraldError
from herald.scheduler import Scheduler, SchedulerConfig

from .helpers import keylist, random_batches

W, BW, T = 3, 8, 4


def _cfg(**kw) -> SchedulerConfig:
    return SchedulerConfig(num_workers=W, batch_size_per_worker=BW, cache_capacity_rows=40, seed=5, **kw)


def _npz_roundtrip(arrays: dict) -> dict:
    """The arrays as a checkpoint file holds them (herald/dispatch/warm.py writes .npz)."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def _same_plan(a, b) -> None:
    assert all(np.array_equal(x, y) for x, y in zip(a.assignment, b.assignment))
    assert np.array_equal(a.counts, b.counts)
    for pa, pb in zip(a.plans, b.plans):
        for field in ("evict", "pull", "grad_push", "update_local", "plan_push"):
            assert keylist(getattr(pa, field)) == keylist(getattr(pb, field)), field
        assert np.array_equal(pa.write_back, pb.write_back)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"cache_policy": "lfu"},
        {"schedule": "costaware"},
        {"schedule": "vanilla"},
        {"adaptive_num_tables": 2, "profile_interval_steps": 3},
    ],
    ids=["herald-lru", "herald-lfu", "costaware", "vanilla", "adaptive"],
)
def test_a_warm_restored_scheduler_goes_on_as_the_uninterrupted_one(kw):
    cfg, stop = _cfg(**kw), 7
    batches = random_batches(3, 16, W * BW, T, vocab=90)
    whole = Scheduler(cfg, T)
    want = [p for p in (whole.submit(b) for b in batches) if p is not None] + [whole.finish()]

    stopped = Scheduler(cfg, T)
    for b in batches[:stop]:
        stopped.submit(b)
    meta, arrays = stopped.warm_state()  # before finish: the stopped job's last step is pending
    stopped.finish()
    stopped.flush()  # the final barrier's write-backs do not touch the saved state

    resumed = Scheduler(cfg, T)
    resumed.load_warm_state(meta, _npz_roundtrip(arrays))
    first = resumed.submit(batches[stop])
    assert first.step == stop - 1  # the stopped step again, now with its plan pushes
    _same_plan(first, want[stop - 1])
    got = [p for p in (resumed.submit(b) for b in batches[stop + 1 :]) if p is not None] + [resumed.finish()]
    assert [p.step for p in got] == list(range(stop, 16))
    for a, b in zip(got, want[stop:]):
        _same_plan(a, b)
    assert np.array_equal(resumed.totals(), whole.totals())
    if kw.get("adaptive_num_tables"):
        assert np.array_equal(resumed.table_doi, whole.table_doi)


def test_warm_state_needs_a_pending_step_and_a_fresh_scheduler():
    batches = random_batches(2, 3, W * BW, T)
    s = Scheduler(_cfg(), T)
    with pytest.raises(HeraldError, match="before finish"):
        s.warm_state()
    s.submit(batches[0])
    meta, arrays = s.warm_state()
    s.finish()
    with pytest.raises(HeraldError, match="before finish"):
        s.warm_state()
    with pytest.raises(HeraldError, match="fresh scheduler"):
        s.load_warm_state(meta, arrays)


def test_malformed_and_mismatched_warm_states():
    s = Scheduler(_cfg(), T)
    s.submit(random_batches(4, 1, W * BW, T)[0])
    meta, arrays = s.warm_state()
    with pytest.raises(ConfigError, match="capacity_rows=40"):  # another cache size: the caller resumes cold
        Scheduler(
            SchedulerConfig(num_workers=W, batch_size_per_worker=BW, cache_capacity_rows=41, seed=5), T
        ).load_warm_state(meta, arrays)
    with pytest.raises(ConfigError):
        Scheduler(_cfg(cache_policy="lfu"), T).load_warm_state(meta, arrays)
    bad = [
        (None, arrays),
        ({**meta, "format": "scheduler"}, arrays),
        ({**meta, "pending_step": -1}, arrays),
        (meta, {k: v for k, v in arrays.items() if k != "pending.order"}),
        (meta, {k: v for k, v in arrays.items() if k != "snap.rec"}),
        (meta, {**arrays, "snap.size": np.zeros(W + 1, np.int64)}),
        (meta, {**arrays, "alloc.rng": np.zeros(2, np.uint64)}),
    ]
    for m, a in bad:
        with pytest.raises(DataError):
            Scheduler(_cfg(), T).load_warm_state(m, a)

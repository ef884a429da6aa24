"""Adaptive LAIA's budget controller (Herald §4.3): k follows a fixed or an ``auto``
budget (a fraction of the measured step period), is never lowered when even k = 1
cannot fit, and its history is reported."""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest

from herald.errors import ConfigError
from herald.scheduler import SchedulerConfig
from herald.scheduler.budget import BudgetController

from .helpers import random_batches, run_scheduler

MS = 1e-3


def _step(ctl, now_ms, fixed_ms, per_table_ms):
    """One simulated submit starting at ``now_ms`` that takes fixed + k x per_table."""
    k = ctl.k
    alloc = k * per_table_ms * MS
    return ctl.observe(k, alloc, alloc + fixed_ms * MS, now_ms * MS)


def test_fixed_budget_gives_the_k_that_fits():
    ctl = BudgetController(26, 1.05, warmup_steps=2)
    for i in range(6):
        _step(ctl, 10.0 * i, fixed_ms=0.5, per_table_ms=0.1)
    assert ctl.k == 5  # (1.05 - 0.5) / 0.1 = 5.5
    assert ctl.stats()["mode"] == "fixed" and ctl.stats()["budget_ms"] == pytest.approx(1.05)
    assert ctl.budget_unreachable == 0 and ctl.notice is None


def test_auto_budget_follows_the_measured_period(capsys):
    T = 26
    ctl = BudgetController(T, "auto", fraction=0.5, window=4, warmup_steps=2)
    now = 0.0

    def run(steps, period_ms):
        nonlocal now
        for _ in range(steps):
            now += period_ms
            _step(ctl, now, fixed_ms=1.0, per_table_ms=0.45)

    run(2, 1.0)  # warm-up: short periods (pipeline filling) are ignored
    assert ctl.k == T and ctl.budget_s is None
    run(8, 100.0)  # 50 ms budget: every table fits
    assert ctl.k == T and abs(ctl.budget_s - 0.050) < 1e-12
    run(8, 10.0)  # 5 ms: (5 - 1) / 0.45 = 8.9: 8 tables
    assert ctl.k == 8 and abs(ctl.stats()["budget_ms"] - 5.0) < 1e-9
    run(8, 4.0)  # 2 ms: (2 - 1) / 0.45: 2 tables
    assert ctl.k == 2
    run(8, 30.0)  # the step got slower again: k goes back up
    assert ctl.k == T
    stats = ctl.stats()
    assert stats["mode"] == "auto" and stats["fraction"] == 0.5 and stats["period_ms_median"] == pytest.approx(30.0)
    assert stats["k"] == {"first": T, "min": 2, "median": T, "max": T, "final": T}
    ks = [k for _, k in stats["series"]]  # k at every change (the medians move through a few values)
    assert stats["series"][0] == [0, T] and 8 in ks and 2 in ks and ks[-1] == T
    assert all(a != b for a, b in itertools.pairwise(ks)) and stats["steps"] == 34
    assert stats["budget_unreachable"] == 0 and "herald scheduler" not in capsys.readouterr().err


def test_unreachable_budget_keeps_k_and_is_counted(capsys):
    T = 26
    ctl = BudgetController(T, "auto", fraction=0.5, window=1, warmup_steps=0)
    now = 0.0
    for _ in range(6):  # 4 ms period: 2 ms budget, k = (2 - 1) / 0.3 = 3.3
        now += 4.0
        _step(ctl, now, fixed_ms=1.0, per_table_ms=0.3)
    assert ctl.k == 3
    for _ in range(10):  # 1 ms period: 0.5 ms budget < 1 + 0.3 ms for k = 1
        now += 1.0
        _step(ctl, now, fixed_ms=1.0, per_table_ms=0.3)
    assert ctl.k == 3  # not lowered: it would cost transmissions and still miss
    assert ctl.budget_unreachable == 10
    err = capsys.readouterr().err
    assert err.count("herald scheduler: scheduling budget") == 1  # one notice
    assert ctl.stats()["notice"] and ctl.stats()["budget_unreachable"] == ctl.budget_unreachable


def test_controller_settings_are_checked():
    with pytest.raises(ConfigError, match="'auto' or a number"):
        BudgetController(3, "fast")
    with pytest.raises(ConfigError, match="fraction"):
        BudgetController(3, "auto", fraction=0.0)
    with pytest.raises(ConfigError, match="scheduling_budget_ms"):
        SchedulerConfig(scheduling_budget_ms="soon")
    with pytest.raises(ConfigError, match="auto_budget_fraction"):
        SchedulerConfig(scheduling_budget_ms="auto", auto_budget_fraction=1.5)


def test_scheduler_with_auto_budget_when_scheduling_is_the_bottleneck(monkeypatch):
    # submitted back to back, the period is the scheduling time itself: no k can fit half
    # of it, so k stays at every table and the plans are static LAIA's. The scheduler's
    # clock is a counter (each reading 1 ms after the last), so the test does not depend on
    # this machine's load: a submit reads it 4 times (start, allocation start and end,
    # end), so allocation 1 ms of a 3 ms submit, a 4 ms period, a 2 ms budget, and k = 1
    # would still take 2 + 1/3 ms
    ticks = itertools.count()
    monkeypatch.setattr(
        "herald.scheduler.scheduler.time", types.SimpleNamespace(perf_counter=lambda: next(ticks) / 1e3)
    )
    W, Bw, T = 4, 4, 3
    batches = random_batches(2, 30, W * Bw, T, vocab=30, max_len=1, single_hot=True)
    static, _ = run_scheduler(
        batches, SchedulerConfig(num_workers=W, batch_size_per_worker=Bw, cache_capacity_rows=40), T
    )
    cfg = SchedulerConfig(
        num_workers=W,
        batch_size_per_worker=Bw,
        cache_capacity_rows=40,
        scheduling_budget_ms="auto",
        profile_interval_steps=4,
    )
    plans, sched = run_scheduler(batches, cfg, T)
    stats = sched.stats()["adaptive"]
    assert stats["budget_unreachable"] > 0 and stats["k"]["min"] == T == sched.num_scored_tables
    assert all(np.array_equal(p.counts, q.counts) for p, q in zip(plans, static))


def test_a_shared_controller_carries_k_over_to_the_next_scheduler():
    W, Bw, T = 2, 4, 3
    batches = random_batches(4, 12, W * Bw, T, vocab=20, max_len=1, single_hot=True)
    cfg = SchedulerConfig(num_workers=W, batch_size_per_worker=Bw, cache_capacity_rows=30, scheduling_budget_ms=1e6)
    ctl = BudgetController(T, 1e6)
    ctl.k = 2  # as if an earlier scheduler of the job had chosen it
    _, first = run_scheduler(batches[:6], cfg, T, budget=ctl)
    assert first.stats()["adaptive"]["k"]["first"] == 2
    _, second = run_scheduler(batches[6:], cfg, T, budget=ctl)
    assert ctl.steps == 12 and second.stats()["adaptive"]["k"]["final"] == T
    with pytest.raises(ConfigError, match="shared BudgetController"):
        run_scheduler(
            [], SchedulerConfig(num_workers=W, batch_size_per_worker=Bw, cache_capacity_rows=30), T, budget=ctl
        )

"""The report's per-request and per-sample costs from fake step records: PS requests per
worker per shard per step, and the job's CPU time per trained sample."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from herald.dispatch.records import StepRecord
from herald.job.report import cpu_time, ps_requests, startup_line
from herald.job.report.breakdown import format_breakdown, phase_breakdown
from herald.job.runner import Served, StartupClock


def record(step: int, requests: int) -> StepRecord:
    return StepRecord(
        step,
        0.5,
        np.zeros((2, 6), np.int64),
        0,
        0,
        0.0,
        np.zeros(0, np.float32),
        np.zeros(0, np.float32),
        ps_requests=requests,
    )


def test_ps_requests_per_worker_per_shard_per_step():
    # 2 workers x 3 shards x 4 steps = 24 worker-shard-steps; 10 + 20 + 30 + 36 = 96 requests
    got = ps_requests([record(s, n) for s, n in enumerate((10, 20, 30, 36))], workers=2, shards=3)
    assert got == {"ps_requests": 96, "ps_requests_per_worker_per_shard_per_step": 4.0}
    one = ps_requests([record(0, 7)], workers=1, shards=1)
    assert one["ps_requests_per_worker_per_shard_per_step"] == 7.0


def test_ps_requests_without_steps_or_counts_is_zero():
    assert ps_requests([], workers=2, shards=2) == {"ps_requests": 0, "ps_requests_per_worker_per_shard_per_step": 0.0}
    assert ps_requests([record(0, 0)] * 5, workers=2, shards=2)["ps_requests_per_worker_per_shard_per_step"] == 0.0


def test_step_record_sums_the_acks_ps_requests_and_counts_a_missing_one_as_zero():
    acks = [
        ({"step": 3, "loss": 0.5, "ps_requests": 5}, []),
        ({"step": 3, "loss": 0.7, "ps_requests": 2}, []),
        ({"step": 3, "loss": 0.6}, []),
    ]
    rec = StepRecord.from_acks(3, acks, np.zeros((3, 6), np.int64), 1.0, {})
    assert rec.ps_requests == 7
    assert StepRecord.from_acks(3, acks[2:], np.zeros((1, 6), np.int64), 1.0, {}).ps_requests == 0


def test_cpu_time_per_trained_sample_in_microseconds():
    got = cpu_time(2.5, 10_000, "local processes (dispatcher)")
    assert {k: got[k] for k in ("cpu_seconds", "cpu_us_per_sample", "cpu_scope")} == {
        "cpu_seconds": 2.5,
        "cpu_us_per_sample": 250.0,
        "cpu_scope": "local processes (dispatcher)",
    }
    assert math.isnan(got["steady_cpu_us_per_sample"])  # not measured
    assert math.isnan(cpu_time(1.0, 0, "x")["cpu_us_per_sample"])
    # NOTE [steady cpu]: the CPU from the first step on, over the samples after it
    assert cpu_time(2.5, 10_000, "x", 1.8, 9_000)["steady_cpu_us_per_sample"] == 200.0
    assert math.isnan(cpu_time(2.5, 10_000, "x", 1.8, 0)["steady_cpu_us_per_sample"])


def test_startup_clock_marks_milestones_from_the_process_start_and_the_line_lists_them():
    assert StartupClock().marks == {}  # in a longer-lived process: from the job's start, no "imported"
    clock = StartupClock(time.perf_counter() - 0.5)
    clock.mark("data_ready")
    rec = record(0, 1)
    rec.acked_at = clock.origin + clock.marks["data_ready"] + 2.0
    served = Served([[rec]], [], 0, {}, None, hellos_at=clock.origin + clock.marks["data_ready"] + 1.0)
    got = clock.milestones(served)
    assert list(got) == ["imported", "data_ready", "workers_ready", "first_step"]
    assert 0.5 <= got["imported"] <= got["data_ready"] < got["workers_ready"] < got["first_step"]
    assert got["first_step"] - got["workers_ready"] == pytest.approx(1.0, abs=2e-3)
    line = startup_line({"imported": 0.6, "ps_ready": 1.1, "first_step": 3.84})
    assert (
        line == "start-up (seconds after herald train started): imported 0.6 s, PS ready 1.1 s, first step acked 3.8 s"
    )
    assert startup_line({}).endswith("not measured")


def test_busy_shares_divide_whole_job_seconds_by_the_whole_job():
    # the dispatcher's stages and the shards' busy seconds are counted over the whole job
    # (start-up and first step in); the worker phases are per step over the steady window
    recs = [record(s, 1) for s in range(4)]
    for r in recs:
        r.phases_ms = {"forward": 2.0, "backward": 3.0}
    b = phase_breakdown(
        recs, 0.02, {"schedule": 3.0, "build": 1.0}, [{"shard": 0, "busy_s": {"step": 2.0}}], job_s=10.0
    )
    assert b["wall_ms_per_step"] == 5.0 and b["worker_step_ms"] == 5.0
    assert b["dispatcher_busy"] == {"schedule": 0.3, "build": 0.1}
    assert b["ps_busy"] == [{"shard": 0, "busy": 0.2, "by_op": {"step": 0.2}}]
    assert any("busy 40% of the job's time" in line for line in format_breakdown(b))
    # without the job's seconds (an older caller) the steady seconds divide them
    assert phase_breakdown(recs, 0.02, {"schedule": 0.01})["dispatcher_busy"] == {"schedule": 0.5}


def test_a_shards_step_barrier_gets_a_report_line():
    # NOTE [step barrier timing]: the spread of the ranks' messages, the release, and
    # which rank came last how often (a straggler shows as one rank far above 1/N)
    barrier = {
        "released": 400,
        "spread_ms_mean": 2.5,
        "spread_ms_max": 31.0,
        "release_ms_mean": 0.4,
        "last_rank": {"0": 100, "1": 300},
    }
    shards = [
        {"shard": 0, "busy_s": {"step": 2.0}, "step_barrier": barrier},
        {"shard": 1, "busy_s": {"pull": 1.0}, "step_barrier": {"released": 0}},
    ]
    b = phase_breakdown([record(0, 1)], 0.02, None, shards)
    assert b["ps_busy"][0]["step_barrier"] == barrier and "step_barrier" not in b["ps_busy"][1]
    (line,) = [x for x in format_breakdown(b) if "step barrier" in x]
    assert line.strip() == (
        "step barrier over 400 steps: the ranks' messages came 2.50 ms apart (first to last, "
        "mean; max 31.0 ms), then the release took 0.40 ms; last to come: rank 1 75%, rank 0 25%"
    )

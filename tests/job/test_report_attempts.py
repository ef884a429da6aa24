"""The report of a job that failed over: every attempt counted, the steps trained again
named (herald/job/report/attempts.py, NOTE [ps failover])."""

from __future__ import annotations

import pytest

from herald.job.report.attempts import Attempt, attempts_block, format_lines, retrained_steps


def test_retrained_steps_are_the_runs_of_steps_of_more_than_one_attempt():
    assert retrained_steps([range(0, 13), range(9, 24)]) == [[9, 12]]
    assert retrained_steps([range(0, 8), range(8, 24)]) == []  # failed right at a checkpoint
    assert retrained_steps([range(0, 13), range(9, 20), range(16, 24)]) == [[9, 12], [16, 19]]
    assert retrained_steps([[0, 1, 2, 5, 6], [1, 2, 6]]) == [[1, 2], [6, 6]]
    assert retrained_steps([range(0, 10)]) == [] and retrained_steps([]) == []


def test_every_attempt_is_counted_in_steps_samples_and_time():
    last = {"steps": 15, "samples": 15 * 64, "train_seconds": 3.0}
    block = attempts_block(last, list(range(9, 24)), [Attempt(tuple(range(13)), 5.0)], global_batch=64)
    assert block["steps"] == 28 and block["samples"] == 28 * 64
    assert block["train_seconds"] == 8.0 and block["wall_samples_per_second"] == pytest.approx(28 * 64 / 8.0)
    assert block["attempts"] == [
        {"steps": 13, "first_step": 0, "last_step": 12, "samples": 13 * 64, "train_seconds": 5.0},
        {"steps": 15, "first_step": 9, "last_step": 23, "samples": 15 * 64, "train_seconds": 3.0},
    ]
    assert block["retrained_steps"] == [[9, 12]]
    assert format_lines(block) == [
        "2 attempts (failover), every one counted in steps and samples: steps 0-12, "
        "steps 9-23; steps trained again: 9-12 (4 steps)"
    ]


def test_one_attempt_changes_nothing_and_prints_no_line():
    last = {"steps": 3, "samples": 192, "train_seconds": 2.0, "wall_samples_per_second": 96.0}
    block = attempts_block(last, [0, 1, 2], [], global_batch=64)
    assert {k: block[k] for k in last} == last
    assert block["retrained_steps"] == [] and len(block["attempts"]) == 1 and format_lines(block) == []

"""The report as named blocks (NOTE [report blocks] in herald/job/report/blocks.py) from fake
step records: the consistency registry has exactly the modes, every report.json key comes
from one block in the registry's order, report.txt can be made again from report.json, and
the figures that several blocks share (this attempt's samples, a group's workers) agree."""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest

from herald.contracts.train import TrainConfig
from herald.contracts.vocab import CONSISTENCY_MODES
from herald.dispatch.records import StepRecord
from herald.errors import ConfigError
from herald.job.report import (
    BLOCKS,
    CONSISTENCY_BLOCKS,
    TEXT_ORDER,
    Attempt,
    CpuTime,
    GroupStreams,
    ReportInputs,
    build,
    consistency_block,
    format_text,
)
from herald.job.report.blocks import plotted


def record(step: int, acked_at: float, **kw) -> StepRecord:
    counts = np.arange(12, dtype=np.int64).reshape(2, 6) + step
    labels, probs = np.array([0, 1, 0, 1], np.float32), np.array([0.2, 0.7, 0.4, 0.6], np.float32)
    return StepRecord(step, 0.5, counts, 100, 200, 1.0, labels, probs, acked_at=acked_at, ps_requests=4, **kw)


def inputs(tmp_path, **kw) -> ReportInputs:
    cfg = kw.pop("cfg", None) or TrainConfig.from_flags(workers=2, batch_size=4, run_dir=str(tmp_path))
    settings = dict(
        records=[record(s, 10.0 + s) for s in range(4)],
        train_s=5.0,
        metrics={},
        batches_info={"dropped_samples": 0},
        split_info={"total_rows": 40, "train_rows": 36, "eval_rows": 4},
        capacity_rows=16,
        cpu=CpuTime(2.0, "local processes (dispatcher)", 1.0),
    )
    settings.update(kw)
    return ReportInputs(cfg, **settings)


def test_the_report_has_a_consistency_block_for_exactly_the_modes():
    assert set(CONSISTENCY_BLOCKS) == set(CONSISTENCY_MODES)
    for mode in CONSISTENCY_MODES:
        assert consistency_block(TrainConfig.from_flags(workers=2, consistency=mode), [])["mode"] == mode


def test_a_mode_without_a_block_is_named_with_the_known_ones():
    cfg = types.SimpleNamespace(consistency="lazy")
    with pytest.raises(ConfigError, match="--consistency lazy: the report has no consistency block .*known: bsp"):
        consistency_block(cfg, [])


def test_every_key_comes_from_one_block_in_the_registrys_order(tmp_path):
    inp = inputs(tmp_path)
    rep = build(inp)
    from_blocks = [key for block in BLOCKS for key in block.fields(inp)]
    assert list(rep) == from_blocks and len(set(from_blocks)) == len(from_blocks)
    assert "group_streams" not in rep  # one dispatcher: the block gives nothing
    names = [b.name for b in BLOCKS]
    assert len(set(names)) == len(names) and set(TEXT_ORDER) <= set(names)
    assert len(set(TEXT_ORDER)) == len(TEXT_ORDER)
    assert [b.name for b in plotted()] == ["throughput", "lag", "transmissions", "phases"]
    assert [b.name for b in plotted(rep)] == ["throughput", "transmissions", "phases"]  # a file: no lag
    with_lag = build(inputs(tmp_path, lag={"records": {"final": {}, "final_total": 0, "peak": 0}}))
    assert "lag" in with_lag and "lag" in [b.name for b in plotted(with_lag)]


def test_the_text_is_made_again_from_the_json(tmp_path):
    rep = build(inputs(tmp_path, interrupted={"signal": "SIGINT", "at_step": 4, "checkpoint": None}))
    again = json.loads(json.dumps(rep, default=float))
    assert format_text(again) == format_text(rep)
    lines = format_text(rep).splitlines()
    assert lines[0] == "interrupted at step 4 by SIGINT (4 steps trained; no checkpoint)"
    assert lines[1].startswith("schedule herald  workers 2  batch 4  cache 16 rows/worker")
    assert lines[2].startswith("steps 4  samples 32  time 5.0 s (start-up 2.0 s)  throughput 8 samples/s")


def test_earlier_attempts_count_in_the_totals_and_this_attempt_in_the_cpu_per_sample(tmp_path):
    rep = build(inputs(tmp_path, earlier=[Attempt((0, 1, 2), 3.0)]))
    assert rep["steps"] == 7 and rep["samples"] == 7 * 8 and rep["train_seconds"] == 8.0
    assert rep["wall_samples_per_second"] == pytest.approx(56 / 8.0)
    assert rep["samples_per_second"] == pytest.approx(3 * 8 / 3.0)  # this attempt's steady span
    assert rep["retrained_steps"] == [[0, 2]] and len(rep["attempts"]) == 2
    assert rep["cpu_us_per_sample"] == pytest.approx(1e6 * 2.0 / 32)  # this attempt's 32 samples
    assert rep["steady_cpu_us_per_sample"] == pytest.approx(1e6 * 1.0 / 24)


def test_one_dispatcher_per_group_counts_a_groups_samples_and_workers(tmp_path):
    cfg = TrainConfig.from_flags(workers=4, batch_size=4, run_dir=str(tmp_path), consistency="hybrid", groups=2)
    summary = {"groups": [], "samples": 0, "wall_seconds": 5.0}
    rep = build(inputs(tmp_path, cfg=cfg, groups=GroupStreams(batch_rows=8, workers=2, summary=summary)))
    assert rep["samples"] == 4 * 8 and rep["group_streams"] == summary
    assert rep["samples_per_second"] == pytest.approx(3 * 8 / 3.0)
    assert rep["ps_requests_per_worker_per_shard_per_step"] == pytest.approx(16 / (4 * 2 * 1))
    assert "the job's last 10 acks, whichever group's" in format_text(rep)


def test_no_steps_no_throughput_and_no_cpu_block_without_a_measure(tmp_path):
    rep = build(inputs(tmp_path, records=[], cpu=None))
    assert rep["steps"] == 0 and math.isnan(rep["samples_per_second"]) and rep["startup_seconds"] == 5.0
    assert "cpu_seconds" not in rep and not any(line.startswith("CPU time") for line in format_text(rep).splitlines())

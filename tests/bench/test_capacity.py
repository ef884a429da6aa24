"""``measure_capacity`` / ``herald bench dispatcher``: a real dispatcher against fake
workers in a child process (a small, fast configuration)."""

from __future__ import annotations

import json

import pytest

from herald.bench.capacity import measure_capacity
from herald.cli import main
from herald.errors import ConfigError
from herald.loader import open_source
from herald.loader.source import MemorySource


def test_measure_capacity_reports_samples_per_second_and_stages():
    res = measure_capacity(workers=2, batch_size=16, rows=2_000, steps=6, warmup_steps=3)
    assert res["samples_per_s"] > 0 and res["steps"] == 6 and res["global_batch"] == 32
    assert {"read", "schedule", "build", "send"} <= set(res["phases"])
    assert all(v >= 0 for v in res["phases"].values())


def test_bench_dispatcher_command_writes_json(tmp_path, capsys):
    out = tmp_path / "cap.json"
    assert (
        main(
            [
                "bench",
                "dispatcher",
                "--workers",
                "2",
                "--batch-size",
                "8",
                "--rows",
                "1000",
                "--steps",
                "4",
                "--warmup-steps",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "samples/s" in capsys.readouterr().out
    assert json.loads(out.read_text())["samples_per_s"] > 0


def test_bad_settings_raise_before_any_work():
    with pytest.raises(ConfigError, match="peers_nice"):
        measure_capacity(peers_nice=40)
    with pytest.raises(ConfigError, match="warmup_steps"):
        measure_capacity(warmup_steps=0)


def test_memory_source_reads_views_and_resumes():
    src = open_source("synthetic://criteo?rows=100&seed=1")
    batch = src.read(100)
    mem = MemorySource(batch)
    first = mem.read(30)
    state = mem.state_dict()
    rest = mem.read(1000)
    assert len(first) == 30 and len(rest) == 70 and mem.read(5) is None
    again = MemorySource(batch)
    again.load_state_dict(state)
    assert again.read(1000).equals(rest)

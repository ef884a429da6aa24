"""``herald bench consistency`` without training: the straggler's sleep per mode (``--straggler
own|bsp``, ``--slow-ms``), the ratios to bsp and the JSON (run_train replaced by a fake)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from herald.bench import consistency
from herald.bench.options import add_consistency_arguments
from herald.errors import ConfigError

#: samples/s of the fake runs without a straggler (2 workers x 128 samples per step)
SPEED = {"bsp": 2560.0, "hybrid": 5120.0, "gba iota=4": 10240.0}  # 100, 50, 25 ms per step


def _args(tmp_path, *extra):
    p = argparse.ArgumentParser()
    add_consistency_arguments(p)
    return p.parse_args(
        [
            "--modes",
            "bsp,hybrid,gba iota=4",
            "--run-dir",
            str(tmp_path / "runs"),
            "--out",
            str(tmp_path / "out.json"),
            *extra,
        ]
    )


@pytest.fixture
def fake_train(monkeypatch):
    """Replace run_train: a report whose samples/s is SPEED[mode], halved under a straggler."""
    seen = []

    def run_train(cfg, progress=False):
        label = {"bsp": "bsp", "hybrid": "hybrid", "gba": "gba iota=4"}[cfg.consistency]
        seen.append((label, cfg.slow_worker))
        sps = SPEED[label] / (2 if cfg.slow_worker else 1)
        return {
            "metrics": {"auc": 0.7, "logloss": 0.5},
            "samples_per_second": sps,
            "steps": 10,
            "consistency": {
                "stale_reads": 0,
                "rereads": 0,
                "max_staleness_observed": 0,
                "mean_staleness": 0.0,
                "dropped_or_decayed": 0,
            },
            "transmissions": {"total": 1, "update_pull": 1},
            "wire_bytes": {"pulled": 1, "pushed": 1},
        }

    monkeypatch.setattr("herald.bench.consistency.run_train", run_train)
    return seen


def test_own_straggler_sleeps_each_modes_own_step_time(tmp_path, fake_train):
    results = consistency.run(_args(tmp_path))
    slowed = {label: slow for label, slow in fake_train if slow}
    assert slowed == {"bsp": "1:100", "hybrid": "1:50", "gba iota=4": "1:25"}
    assert [label for label, slow in fake_train if not slow] == ["bsp", "hybrid", "gba iota=4"]  # measured first
    assert results["hybrid + slow 1:50"]["slow_ms"] == 50 and results["hybrid"]["slow_ms"] is None
    # vs bsp: no-straggler rows against bsp, straggler rows against bsp + straggler
    assert results["hybrid"]["vs_bsp"] == pytest.approx(2.0)
    assert results["gba iota=4 + slow 1:25"]["vs_bsp"] == pytest.approx(4.0)
    assert results["bsp + slow 1:100"]["vs_bsp"] == pytest.approx(1.0)
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["straggler"] == "own" and saved["slow_ms"] == {"bsp": 100, "hybrid": 50, "gba iota=4": 25}
    assert saved["results"]["hybrid + slow 1:50"]["vs_bsp"] == pytest.approx(2.0)


def test_bsp_straggler_sleeps_bsps_step_time_in_every_mode(tmp_path, fake_train):
    consistency.run(_args(tmp_path, "--straggler", "bsp"))
    assert {slow for _, slow in fake_train if slow} == {"1:100"}
    assert json.loads((tmp_path / "out.json").read_text())["straggler"] == "bsp"


def test_slow_ms_overrides_both(tmp_path, fake_train):
    for straggler in ("own", "bsp"):
        fake_train.clear()
        consistency.run(_args(tmp_path, "--straggler", straggler, "--slow-ms", "7", "--slow-rank", "0"))
        assert {slow for _, slow in fake_train if slow} == {"0:7"}
        assert json.loads((tmp_path / "out.json").read_text())["straggler"] == "slow-ms"


def test_ratios_without_a_bsp_row_are_nan():
    rows = {"hybrid": {"mode": "hybrid", "straggler": False, "samples_per_second": 10.0}}
    consistency.add_ratios(rows)
    assert math.isnan(rows["hybrid"]["vs_bsp"])


def test_modes_are_checked(tmp_path, fake_train):
    args = _args(tmp_path)
    args.modes = "hybrid"
    with pytest.raises(ConfigError, match="no bsp"):
        consistency.run(args)
    assert fake_train == []

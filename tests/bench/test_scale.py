"""``herald bench scale`` end to end on a tiny stream: the JSON it writes, and a baseline that trains."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest

from herald.bench import common, scale, torchrec_baseline

pytestmark = pytest.mark.integration

SOURCE = "synthetic://criteo?rows=20000&seed=1"


def test_worker_counts_are_powers_of_two_up_to_the_maximum():
    assert scale.worker_counts(1) == [1]
    assert scale.worker_counts(4) == [1, 2, 4]
    assert scale.worker_counts(6) == [1, 2, 4, 6]


def test_the_step_barrier_is_averaged_over_shards_and_the_median_taken_over_repeats():
    b = [{"spread_ms_mean": 1.0, "release_ms_mean": 0.2}, {"spread_ms_mean": 3.0, "release_ms_mean": 0.4}]
    c = [{"spread_ms_mean": 5.0, "release_ms_mean": 0.1}]
    assert scale.barrier_summary([b, c, b]) == {"spread_ms": 2.0, "release_ms": 0.3}
    assert scale.barrier_summary([[], []]) is None


def test_ratios_to_plain_torch_pair_each_repeat_with_its_own_plain_run(monkeypatch):
    # a noisy machine: the second repeat runs everything faster; each ratio is to the plain
    # run of its own repeat (1.5 and 1.1 -> median 1.3), not median over median (185 / 150)
    plain = iter(
        [
            {"samples_per_s": 100.0, "cpu_us_per_sample": 10.0, "timed_steps": 5},
            {"samples_per_s": 200.0, "cpu_us_per_sample": 20.0, "timed_steps": 5},
        ]
    )
    herald = iter([(150.0, 30.0, 25.0), (220.0, 50.0, 36.0)])
    monkeypatch.setattr(scale, "train_plain_torch", lambda data, seed: next(plain))

    def run_herald(*args, **kwargs):
        sps, cpu, steady = next(herald)
        return {
            "samples_per_s": sps,
            "cpu_us_per_sample": cpu,
            "steady_cpu_us_per_sample": steady,
            "phases_ms": {},
            "wall_ms_per_step": 1.0,
            "wall_samples_per_s": sps,
            "startup_s": 1.0,
            "step_barrier": [],
        }

    monkeypatch.setattr(scale, "run_herald", run_herald)
    args = argparse.Namespace(max_workers=1, schedules=["herald"], repeats=2, seed=0, batch_size=4, pin_cores=False)
    got_plain, (run,) = scale._runs("synthetic://criteo?rows=10", args, common.PlainBatches([], [1], 1, 0.0, 0.0), None)
    assert got_plain["samples_per_s"] == 150.0 and got_plain["repeats_samples_per_s"] == [100.0, 200.0]
    assert run["ratio_vs_plain_torch"] == pytest.approx(1.3)
    assert run["cpu_ratio_vs_plain_torch"] == pytest.approx(2.75) and run["step_barrier"] is None
    assert run["steady_cpu_ratio_vs_plain_torch"] == pytest.approx((2.5 + 1.8) / 2)


def test_the_plain_torch_baseline_trains():
    losses = common.plain_torch_losses(SOURCE, steps=60)
    assert len(losses) == 60
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.02, losses


def test_bench_scale_writes_every_run(tmp_path):
    out = tmp_path / "scale.json"
    assert (
        scale.main(
            [
                "--rows",
                "20000",
                "--max-workers",
                "2",
                "--schedules",
                "herald",
                "--capacity-seconds",
                "1",
                "--torchrec-workers",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    got = json.loads(out.read_text())
    assert got["plain_torch"]["samples_per_s"] > 0
    assert got["plain_torch"]["cpu_us_per_sample"] > 0
    assert [(r["workers"], r["schedule"]) for r in got["runs"]] == [(1, "herald"), (2, "herald")]
    for r in got["runs"]:
        assert r["samples_per_s"] > 0
        assert isinstance(r["phases_ms"], dict)
        assert r["ratio_vs_plain_torch"] > 0 and r["scaling_factor"] > 0
        assert r["cpu_us_per_sample"] > 0  # every process of the job, the reaped children included
        assert 0 < r["steady_cpu_us_per_sample"] < r["cpu_us_per_sample"]  # start-up and evaluation out
        # one repeat: the ratios are to the plain run of that repeat
        assert r["ratio_vs_plain_torch"] == pytest.approx(r["samples_per_s"] / got["plain_torch"]["samples_per_s"])
        assert r["cpu_ratio_vs_plain_torch"] == pytest.approx(
            r["cpu_us_per_sample"] / got["plain_torch"]["cpu_us_per_sample"]
        )
        assert r["step_barrier"]["spread_ms"] >= 0 and r["step_barrier"]["release_ms"] > 0  # bsp: step messages
    assert got["runs"][0]["scaling_factor"] == pytest.approx(1.0)
    trec = got["torchrec"]  # the TorchRec baseline, same batches, same run
    if torchrec_baseline.torchrec_import_error() and os.environ.get("CI") != "true":
        assert trec == {"error": "torchrec not installed: make torchrec"}
        assert all(r["ratio_vs_torchrec"] is None for r in got["runs"])
        assert got["torchrec_runs"] == [{"error": "torchrec not installed: make torchrec"}]
    else:
        assert "error" not in trec, trec
        assert trec["samples_per_s"] > 0 and trec["timed_steps"] == got["plain_torch"]["timed_steps"]
        assert (
            trec["cuda"] == "no CUDA device"
            or trec["cuda"] == "fbgemm-gpu CUDA build not installed"
            or trec["cuda"]["samples_per_s"] > 0
        )
        for r in got["runs"]:
            assert r["ratio_vs_torchrec"] == pytest.approx(r["samples_per_s"] / trec["samples_per_s"])
        # TorchRec at 2 gloo workers, the same rows and batch per process (herald.bench.torchrec_dist)
        (at2,) = got["torchrec_runs"]
        assert at2["workers"] == 2 and at2["samples_per_s"] > 0 and at2["cpu_us_per_sample"] > 0, at2
        assert at2["mode"] in ("dmp", "ddp") and (at2["mode"] == "dmp") == (at2["dmp_error"] is None)
        two = got["runs"][1]
        assert two["ratio_vs_torchrec_same_workers"] == pytest.approx(two["samples_per_s"] / at2["samples_per_s"])
        assert got["runs"][0]["ratio_vs_torchrec_same_workers"] is None  # no TorchRec run at 1 worker here
    cap = got["dispatcher_capacity_samples_per_s"]
    assert cap is None or cap > 0

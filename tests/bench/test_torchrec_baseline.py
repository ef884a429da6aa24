"""The TorchRec baseline of the benches (herald.bench.torchrec_baseline): it trains, it trains the plain
baseline's model, and the benches say so when torchrec is missing."""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import pytest
import torch

from herald.bench import common, network, scale, torchrec_baseline
from herald.errors import ConfigError

SOURCE = "synthetic://criteo?rows=20000&seed=1"


@pytest.fixture(scope="module")
def data():
    missing = torchrec_baseline.torchrec_import_error()
    if missing:  # CI installs torchrec (.ci/run): there a missing one is a failure, not a skip
        if os.environ.get("CI") == "true":
            pytest.fail(missing)
        pytest.skip(missing)
    return common.load_plain_batches(SOURCE, 128, max_steps=40)


def test_a_tiny_run_trains(data):
    got = torchrec_baseline.train_torchrec(data, warmup_steps=5)
    losses = got["losses"]
    assert got["samples_per_s"] > 0 and got["timed_steps"] == len(data.batches) - 5 == 35
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.02, losses


def test_it_trains_the_plain_baselines_model(data):
    """Same init, same element-wise Adagrad and Adam: the losses agree to float rounding."""
    short = common.PlainBatches(data.batches[:20], data.table_rows, data.dense_dim, 0.0, 0.0)
    plain = common.train_plain_torch(short, warmup_steps=5)["losses"]
    trec = torchrec_baseline.train_torchrec(short, warmup_steps=5)["losses"]
    np.testing.assert_allclose(trec, plain, rtol=0, atol=1e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_the_other_fused_optimizers_train(data, optimizer):
    losses = torchrec_baseline.train_torchrec(data, warmup_steps=5, optimizer=optimizer)["losses"]
    assert np.mean(losses[-10:]) < np.mean(losses[:10]), losses


def test_the_entry_says_why_cuda_did_not_run(data, monkeypatch):
    kw = {"embedding_dim": 16, "seed": 0, "optimizer": "adagrad"}
    assert torchrec_baseline._cuda_entry(data, kw, 1, gpu=False) == "not run (--no-gpu)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torchrec_baseline, "fbgemm_cuda_build", lambda: False)
    assert torchrec_baseline._cuda_entry(data, kw, 1, gpu=True) == "fbgemm-gpu CUDA build not installed"


def test_adam_and_unknown_optimizers_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="only on CUDA.*--no-torchrec"):
        torchrec_baseline.check_optimizer("adam", "cpu")
    with pytest.raises(ConfigError, match="got 'lamb'.*--no-torchrec"):
        torchrec_baseline.check_optimizer("lamb", "cuda")
    torchrec_baseline.check_optimizer("adam", "cuda")
    torchrec_baseline.check_bench_optimizer("adam", no_torchrec=True)


def test_without_torchrec_the_benches_say_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchrec", None)  # `import torchrec` now raises ModuleNotFoundError
    assert torchrec_baseline.torchrec_import_error() == "torchrec not installed: make torchrec"
    empty = common.PlainBatches([], [1], 1, 0.0, 0.0)
    entry = torchrec_baseline.torchrec_baseline(empty)
    assert entry == {"error": "torchrec not installed: make torchrec"}
    with pytest.raises(ConfigError, match="make torchrec"):
        torchrec_baseline.train_torchrec(empty)
    torchrec_baseline.check_bench_optimizer("adam", no_torchrec=False)  # nothing to check without torchrec
    results = {
        "plain_torch": {"samples_per_s": 1000.0, "cpu_us_per_sample": 40.0},
        "torchrec": entry,
        "cores": 2,
        "batch_size": 256,
        "repeats": 1,
        "dispatcher_capacity_samples_per_s": None,
        "runs": [
            {
                "workers": 1,
                "schedule": "herald",
                "samples_per_s": 500.0,
                "ratio_vs_plain_torch": 0.5,
                "ratio_vs_torchrec": None,
                "scaling_factor": 1.0,
                "wall_ms_per_step": 2.0,
                "cpu_us_per_sample": 80.0,
                "cpu_ratio_vs_plain_torch": 2.0,
                "steady_cpu_us_per_sample": 60.0,
                "steady_cpu_ratio_vs_plain_torch": 1.5,
                "phases_ms": {},
            }
        ],
    }
    capsys.readouterr()
    scale.print_table(results)
    out = capsys.readouterr().out
    assert "| 1 | TorchRec | TorchRec: torchrec not installed: make torchrec |" in out, out
    assert "| 1 | herald | 500 | 0.50x | - |" in out and "| 80.0 (2.00x); steady 60.0 (1.50x) |" in out, out
    assert "| 1 | plain PyTorch | 1,000 | 1.00x | - | - | 256.00 | 40.0 | - |" in out, out


def test_the_network_table_gives_the_ratio_to_torchrec():
    row = {
        "schedule": "vanilla",
        "dim": 64,
        "samples_per_s": 900.0,
        "bytes": 2**20,
        "auc": 0.5,
        "allreduce_bytes": 0,
        "by_cause": dict.fromkeys(["miss_pull", "update_pull", "evict_push", "grad_push", "plan_push"], 0),
        "phases_ms": {},
    }
    trec = {"64": {"samples_per_s": 3000.0, "cuda": "no CUDA device"}}
    network._compare([row], trec)
    assert row["vs_torchrec"] == pytest.approx(0.3) and row["speedup_vs_vanilla"] == 1.0
    result = {
        "runs": [row],
        "bed": {"worker_hosts": 2, "rate": "1gbit", "delay_ms": 0.0},
        "job": {"batch_size": 256},
        "torchrec": trec,
    }
    table = network.format_table(result)
    assert (
        "| 0.30x |" in table
        and "dim 64: TorchRec (1 process, 1 thread): CPU 3,000 samples/s; CUDA: no CUDA device" in table
    ), table
    result["torchrec"] = {"error": "torchrec not installed: make torchrec"}
    assert "TorchRec: torchrec not installed: make torchrec" in network.format_table(result)


def test_the_network_bench_runs_torchrec_at_each_dim(data):
    args = argparse.Namespace(batch_size=256, eval_fraction=0.1, dim=[8], optimizer="sgd")
    got = network.torchrec_per_dim("synthetic://criteo?rows=5000&seed=1", args)
    assert list(got) == ["8"] and got["8"]["samples_per_s"] > 0 and got["8"]["embedding_dim"] == 8

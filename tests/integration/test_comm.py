"""Wire compression and training groups through ``herald train`` (real PS shards,
dispatcher and worker processes): docs/compression.md."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from herald.contracts.train import TrainConfig
from herald.job.launcher import run_train

pytestmark = pytest.mark.integration


def _cfg(tmp_path, data_dir, **kw):
    base = {
        "source": str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv"),
        "schedule": "herald",
        "workers": 2,
        "batch_size": 16,
        "cache_rows": 400,
        "embedding_dim": 8,
        "optimizer": "adagrad",
        "lr": 0.05,
        "dense_optimizer": "sgd",
        "dense_lr": 0.05,
        "model": "dlrm",
        "steps": 30,
        "eval_fraction": 0.1,
        "seed": 3,
        "run_dir": str(tmp_path),
        "timeout_ms": 60_000,
    }
    return TrainConfig.from_flags(**{**base, **kw})


def test_int8_wire_trains_and_reports_bytes(tmp_path, data_dir):
    rep = run_train(_cfg(tmp_path, data_dir, wire_dtype="int8", dense_comm="bf16"), progress=False)
    comp = rep["compression"]
    assert rep["steps"] == 30 and comp["wire_dtype"] == "int8" and comp["dense_comm"] == "bf16"
    assert comp["ratio"] == pytest.approx(32 / 12)  # dim 8: 32 bytes -> 8 + a 4-byte scale
    assert comp["fp32_bytes"] == rep["transmissions"]["embedding_bytes"]
    assert 0.4 < rep["metrics"]["auc"] <= 1.0 and np.isfinite(rep["metrics"]["logloss"])
    text = (tmp_path / "report.txt").read_text()
    assert "wire compression int8" in text and "dense all-reduce payload bf16" in text


def test_four_workers_in_two_groups_train(tmp_path, data_dir):
    rep = run_train(
        _cfg(tmp_path, data_dir, workers=4, groups=2, average_every=3, easgd_alpha=0.5, batch_size=8), progress=False
    )
    assert rep["steps"] == 30
    grp = rep["groups"]
    assert [s["group"] for s in grp["leaders"]] == [0, 1]
    assert all(s["rounds"] == 10 and s["corrections"] >= 1 and s["lag_steps_max"] >= 1 for s in grp["leaders"])
    dense = [torch.load(tmp_path / f"dense-rank{r}.pt", weights_only=True) for r in range(4)]
    same = [all(torch.equal(a[k], b[k]) for k in a) for a, b in ((dense[0], dense[1]), (dense[2], dense[3]))]
    assert same == [True, True], "the ranks of a group must hold one replica"
    assert "EASGD rounds" in (tmp_path / "report.txt").read_text()
    assert np.isfinite(rep["metrics"]["auc"])


@pytest.mark.parametrize("wire", ["fp16", "bf16", "int8"])
def test_client_compresses_across_shards_and_split_requests(wire):
    """Two real shards, requests split by max_keys_per_request: a compressed client sees
    the rows an fp32 client sees within the format's bound, optimizer state exact."""
    from herald.contracts.tables import OptimizerConfig, TableConfig
    from herald.ps import LocalShards, PSClient, compress

    tables = [TableConfig("a", 6, OptimizerConfig(name="adagrad", lr=0.1)), TableConfig("b", 6)]
    keys = np.arange(3000, dtype=np.uint64) * 7919
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((keys.shape[0], 6)).astype(np.float32)
    with (
        LocalShards(num_shards=2, tables=tables, seed=1) as sh,
        PSClient(sh.addresses, tables, timeout_ms=20_000, wire_dtype=wire) as lossy,
        PSClient(sh.addresses, tables, timeout_ms=20_000) as exact,
    ):
        lossy.max_keys_per_request = 700  # several requests per shard
        lossy.push_grad_async({"a": (keys, grads, np.ones(keys.shape[0], np.uint16))}, step=0, rank=0).wait()
        rows = lossy.pull_async({"a": keys, "b": keys[:10]}).wait()
        want = exact.pull_async({"a": keys, "b": keys[:10]}).wait()
        assert np.array_equal(rows["a"][:, 6:], want["a"][:, 6:])
        amax = np.abs(want["a"][:, :6]).max(axis=1, keepdims=True)
        assert (np.abs(rows["a"][:, :6] - want["a"][:, :6]) <= amax / 127).all()
        assert rows["b"].shape == want["b"].shape == (10, 6)
        # a compressed write-back: the decoded embedding and the exact state are stored
        new = want["a"].copy()
        new[:, :6] += 1.0
        lossy.push_rows_async({"a": (keys, new)}).wait()
        back = exact.pull("a", keys)
        assert np.array_equal(back[:, 6:], new[:, 6:])
        assert np.array_equal(back[:, :6], compress.decode(*compress.encode(new[:, :6], wire), wire))

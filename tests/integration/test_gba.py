"""GBA end to end (NOTE [gba tokens] in herald/ps/gba.py; GBA §4.1): real PS
shard processes, a real dispatcher handing out micro-batches on demand and real worker
processes, on loopback, the Criteo sample."""

from __future__ import annotations

import numpy as np
import pytest

from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.job.launcher import run_train
from herald.ps import PSClient
from tests.integration.test_train_exact import (
    BATCH,
    LR,
    STEPS,
    _reference,
    assert_matches_reference,
)

pytestmark = pytest.mark.integration


def _cfg(tmp_path, data_dir, name, steps=STEPS, **settings):
    base = dict(
        source=str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv"),
        schedule="herald",
        workers=2,
        batch_size=BATCH,
        cache_rows=260,
        embedding_dim=4,
        optimizer="adagrad",
        lr=LR["adagrad"],
        dense_optimizer="sgd",
        dense_lr=0.05,
        model="dlrm",
        steps=steps,
        eval_fraction=0.0,
        seed=3,
        run_dir=str(tmp_path / name),
        timeout_ms=60_000,
        consistency="gba",
    )
    base.update(settings)
    return TrainConfig.from_flags(**base)


def _gba_stats(addresses, job, seen):
    with PSClient(addresses, tables=list(job.tables), timeout_ms=10_000) as client:
        seen["gba"] = [s["gba"] for s in client.stats()]


@pytest.mark.parametrize("ps_shards,m,slow", [(1, 2, None), (2, 2, None), (1, 4, "1:40")])
def test_gba_threshold_zero_equals_single_process(tmp_path, data_dir, ps_shards, m, slow):
    """iota = 0: exactly BSP (the single-process reference), with M = workers, and with M = 4
    micro-batches of G / 4 samples on 2 workers (the same global batch) and a straggler."""
    cfg = _cfg(tmp_path, data_dir, "exact", ps_shards=ps_shards, gba_buffer=m, slow_worker=slow)
    source, seen = cfg.source, {}

    def grab(addresses, job):
        tables = list(job.tables)
        ref_model, ref_rows = _reference(job, source, 2 * BATCH)
        seen["ref_model"] = ref_model
        by_table: dict[int, list[int]] = {}
        for t, k in ref_rows:
            by_table.setdefault(t, []).append(k)
        with PSClient(addresses, tables=tables, timeout_ms=10_000) as client:
            got = client.pull_async({t: np.array(ks, np.uint64) for t, ks in by_table.items()}).wait()
            seen["gba"] = [s["gba"] for s in client.stats()]
        dim = tables[0].dim
        pairs = [(got[t][i], ref_rows[(t, k)]) for t, ks in by_table.items() for i, k in enumerate(ks)]
        seen["diff"] = max(float(np.abs(a[:dim] - b[:dim]).max()) for a, b in pairs)
        seen["state_rel"] = max(
            float((np.abs(a[dim:] - b[dim:]) / np.maximum(1.0, np.abs(b[dim:]))).max()) for a, b in pairs
        )

    rep = run_train(cfg, progress=False, on_finish=grab)
    assert rep["steps"] == STEPS
    for shard in seen["gba"]:  # every shard: exactly M contributions per applied global step, none stale
        assert shard["global_step"] == STEPS and shard["contributions"] == m * STEPS
        assert shard["dropped"] == 0 and shard["staleness_max"] == 0 and shard["pending"] == 0
        assert all(n == m and d == 0 for _, n, d in shard["history"])
    c = rep["consistency"]
    assert c["mode"] == "gba" and c["settings"] == {
        "gba_buffer": m,
        "gba_threshold": 0,
        **({"slow_worker": slow} if slow else {}),
    }
    assert c["dropped_or_decayed"] == 0 and c["max_staleness_observed"] == 0
    assert_matches_reference(seen, tmp_path / "exact", 2)


def test_gba_drops_stale_gradients_of_a_straggler(tmp_path, data_dir):
    """One worker slowed: the fast one takes more tokens; the straggler's gradients that are
    more than iota global steps stale are dropped and counted, the others kept."""
    seen: dict = {}
    rep = run_train(
        _cfg(tmp_path, data_dir, "slow", steps=40, gba_threshold=1, slow_worker="1:150"),
        progress=False,
        on_finish=lambda a, j: _gba_stats(a, j, seen),
    )
    assert rep["steps"] == 40
    shard = seen["gba"][0]
    assert shard["global_step"] == 40 and shard["contributions"] == 80 and shard["pending"] == 0
    assert all(n == 2 for _, n, _ in shard["history"])  # exactly M per applied global step
    assert shard["dropped"] > 0 and shard["staleness_max"] > 1
    c = rep["consistency"]
    assert c["dropped_or_decayed"] == shard["dropped"] and c["max_staleness_observed"] == shard["staleness_max"]
    assert c["settings"] == {"gba_buffer": 2, "gba_threshold": 1, "slow_worker": "1:150"}
    assert "consistency gba" in (tmp_path / "slow" / "report.txt").read_text()


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(gba_buffer=3), "must divide the global batch"),
        (dict(gba_threshold=-1), "--gba-threshold"),
        (dict(replicate_below=100), "--replicate-below"),
        (dict(consistency="bsp", gba_threshold=2), "no meaning for --consistency bsp"),
    ],
)
def test_gba_settings_errors_name_the_flag(tmp_path, data_dir, settings, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, data_dir, "bad", **settings)

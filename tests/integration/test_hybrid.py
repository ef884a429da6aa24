"""Persia hybrid training end to end (NOTE [hybrid training] in herald/dispatch/hybrid.py):
real PS shards, dispatcher and workers on loopback, the Criteo sample."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from test_train_exact import BATCH, LR, STEPS, _reference, assert_matches_reference

from herald.contracts.train import TrainConfig
from herald.job.launcher import run_train
from herald.ps import PSClient

pytestmark = pytest.mark.integration

CRITEO = ("criteo", "criteo_kaggle_sample_train.tsv")


def _config(tmp_path, data_dir, name, steps, batch, **settings) -> TrainConfig:
    return TrainConfig.from_flags(
        source=str(data_dir.joinpath(*CRITEO)),
        schedule="herald",
        workers=2,
        batch_size=batch,
        cache_rows=1500,
        embedding_dim=4,
        optimizer="adagrad",
        lr=0.01,
        dense_optimizer="sgd",
        dense_lr=0.05,
        model="dlrm",
        steps=steps,
        eval_fraction=0.0,
        seed=3,
        run_dir=str(tmp_path / name),
        timeout_ms=60_000,
        consistency="hybrid",
        **settings,
    )


def test_hybrid_trains_with_staleness_within_the_credit_window(tmp_path, data_dir):
    """Embeddings read without waiting for earlier updates (staleness > 0 happens), never more
    than W - 1 steps behind (W: the credit window); the loss is finite and goes down (the last
    10 steps' mean below the job's mean and below an untrained model's 0.693); every step's
    gradients reach the PS; nothing expires without --hybrid-expiry."""
    window = 3
    rep = run_train(_config(tmp_path, data_dir, "hybrid", 100, 32, max_inflight_steps=window), progress=False)
    c = rep["consistency"]
    assert rep["steps"] == 100
    assert c["mode"] == "hybrid" and c["settings"]["max_inflight_steps"] == window
    assert len(c["per_step_staleness"]) == 100
    assert 1 <= c["max_staleness_observed"] <= window - 1, "reads waited for every earlier update (or exceeded W - 1)"
    assert 0 < c["mean_staleness"] <= window - 1
    assert c["dropped_or_decayed"] == 0
    assert c["gradient_rows_pushed"] > 0 and c["reads"] > 0
    whole = rep["progressive_validation"]["logloss"]
    assert math.isfinite(rep["final_loss"]) and rep["final_loss"] < min(whole, 0.6), (rep["final_loss"], whole)
    saved = json.loads((tmp_path / "hybrid" / "report.json").read_text())["consistency"]
    assert saved["per_step_staleness"] == c["per_step_staleness"]
    assert "consistency hybrid" in (tmp_path / "hybrid" / "report.txt").read_text()


def test_hybrid_expiry_drops_late_gradients_and_counts_them(tmp_path, data_dir):
    """A straggler's gradients arrive after the dispatcher handed out later steps; with
    --hybrid-expiry 0 they expire: dropped and counted, never applied; training goes on,
    through checkpoint barriers (every queued push applied before the PS checkpoint)."""
    rep = run_train(
        _config(
            tmp_path,
            data_dir,
            "expiry",
            30,
            16,
            max_inflight_steps=3,
            hybrid_expiry=0,
            slow_worker="1:40",
            checkpoint_every=10,
        ),
        progress=False,
    )
    c = rep["consistency"]
    assert rep["steps"] == 30
    assert c["settings"]["hybrid_expiry"] == 0
    assert c["dropped_or_decayed"] > 0, "no gradient expired"
    assert c["dropped_or_decayed"] % 16 == 0, "whole micro-batches expire (one ack each)"
    assert c["dropped_or_decayed"] < 30 * 2 * 16
    assert math.isfinite(rep["final_loss"])
    assert len(list((tmp_path / "expiry" / "checkpoints").iterdir())) >= 1


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_hybrid_with_window_one_equals_single_process(tmp_path, data_dir, optimizer):
    """--max-inflight-steps 1: step t is handed out once step t - 1's update is applied, so
    every read is latest and hybrid equals BSP and the single-process reference within the
    exactness tolerances (NOTE [hybrid training], last paragraph)."""
    source = str(data_dir.joinpath(*CRITEO))
    cfg = TrainConfig.from_flags(
        source=source,
        schedule="herald",
        workers=2,
        batch_size=BATCH,
        cache_rows=260,
        embedding_dim=4,
        optimizer=optimizer,
        lr=LR[optimizer],
        dense_optimizer="sgd",
        dense_lr=0.05,
        model="dlrm",
        steps=STEPS,
        eval_fraction=0.0,
        seed=3,
        run_dir=str(tmp_path),
        timeout_ms=60_000,
        consistency="hybrid",
        max_inflight_steps=1,
    )
    seen: dict = {}

    def grab(addresses, job):
        tables = list(job.tables)
        ref_model, ref_rows = _reference(job, source, 2 * BATCH)
        seen["ref_model"] = ref_model
        by_table: dict[int, list[int]] = {}
        for t, k in ref_rows:
            by_table.setdefault(t, []).append(k)
        with PSClient(addresses, tables=tables, timeout_ms=10_000) as client:
            got = client.pull_async({t: np.array(ks, np.uint64) for t, ks in by_table.items()}).wait()
        dim = tables[0].dim
        pairs = [(got[t][i], ref_rows[(t, k)]) for t, ks in by_table.items() for i, k in enumerate(ks)]
        seen["diff"] = max(float(np.abs(a[:dim] - b[:dim]).max()) for a, b in pairs)
        seen["state_rel"] = max(
            (
                float((np.abs(a[dim:] - b[dim:]) / np.maximum(1.0, np.abs(b[dim:]))).max())
                for a, b in pairs
                if a.shape[0] > dim
            ),
            default=0.0,
        )

    rep = run_train(cfg, progress=False, on_finish=grab)
    assert rep["steps"] == STEPS
    c = rep["consistency"]
    assert c["max_staleness_observed"] == 0 and c["dropped_or_decayed"] == 0
    assert_matches_reference(seen, tmp_path, 2)

"""``herald train --model din`` (herald/worker/din.py) trained exactly: on MovieLens without a
table file, din turns on the side features and lays them out itself (NOTE [din layout] in
herald/contracts/train.py: the history a sequence of the last L movies reading item's table,
genres mean-pooled), the workers feed it FeatureEmbeddings (padded sequences), and 2 workers
under bsp equal the single-process reference (Herald §3.3), which builds the same features for
the whole global batch (herald.worker.pooling.features_from_rows). Then the held-out
evaluation reads the same features.

Real PS shards, dispatcher and workers (as tests/integration/test_train_features.py); a
small cache forces evictions and update pulls.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from herald.contracts.train import TrainConfig
from herald.job.launcher import run_train
from herald.job.reference import train_reference
from herald.loader import GlobalBatcher, open_source
from herald.loader.splits import RowRange
from tests.integration.test_train_exact import assert_matches_reference, ps_against_reference

pytestmark = pytest.mark.integration

STEPS = 25
BATCH = 8
HISTORY = 12


def test_din_on_movielens_equals_single_process(tmp_path, data_dir):
    source = str(data_dir / "movielens" / "ml-latest-small" / "ratings.csv")
    workers = 2
    cfg = TrainConfig.from_flags(
        source=source,
        source_options=(("history", HISTORY),),
        schedule="herald",
        workers=workers,
        batch_size=BATCH,
        cache_rows=150,
        embedding_dim=4,
        optimizer="sgd",
        lr=0.1,
        dense_optimizer="sgd",
        dense_lr=0.05,
        model="din",
        steps=STEPS,
        eval_fraction=0.0,
        seed=5,
        run_dir=str(tmp_path / "run"),
        timeout_ms=60_000,
        consistency="bsp",
    )
    seen: dict = {}

    def grab(addresses, job):
        seen["job"] = job
        src = RowRange(open_source(source, side_features=True, history_length=HISTORY), 0, STEPS * workers * BATCH)
        with GlobalBatcher(src, workers * BATCH, drop_last=True) as batcher:
            batches = list(itertools.islice(batcher, STEPS))
        seen["long_histories"] = sum(int((np.diff(b.offsets[3]) == HISTORY).sum()) for b in batches)
        seen["ref_model"], ref_rows = train_reference(job, batches)
        seen.update(ps_against_reference(addresses, job, ref_rows))

    rep = run_train(cfg, progress=False, on_finish=grab)
    job = seen["job"]
    assert rep["steps"] == STEPS and job.model == "din"
    assert [t.name for t in job.tables] == ["user", "item", "genres"]
    assert [(f.name, f.table, f.pooling, f.max_length) for f in job.features] == [
        ("user", "user", "sum", 0),
        ("item", "item", "sum", 0),
        ("genres", "genres", "mean", 0),
        ("history", "item", "none", HISTORY),
    ]
    assert seen["long_histories"] > 0, "no history reached its length: the truncation is not exercised"
    tx = rep["transmissions"]
    assert tx["evict_push"] + tx["update_pull"] > 0, "the cache was never under pressure"
    assert_matches_reference(seen, tmp_path / "run", workers)


def test_din_evaluates_the_held_out_split(tmp_path, data_dir):
    """The evaluation builds DIN's features (padded sequences) from the PS rows."""
    cfg = TrainConfig.from_flags(
        source=str(data_dir / "movielens" / "ml-latest-small" / "ratings.csv"),
        workers=2,
        batch_size=32,
        embedding_dim=8,
        model="din",
        steps=10,
        eval_fraction=0.01,
        run_dir=str(tmp_path / "run"),
        timeout_ms=60_000,
    )
    rep = run_train(cfg, progress=False)
    ev = rep["metrics"]
    assert ev["eval_rows"] > 500 and 0.0 < ev["auc"] < 1.0 and ev["dense_replicas_equal"]

"""Declared tables and features trained exactly (NOTE [tables and features] in
herald/contracts/features.py; Herald §3.3's BSP exactness): on MovieLens with its side
features, the user's history reads the movie table that the rated item reads (one key
space), genres and history are mean-pooled bags, and the job equals one process.

Real PS shards, dispatcher and workers (as tests/integration/test_train_exact.py); a
small cache forces evictions and update pulls, so shared keys travel the whole plan.
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
from herald.ps import PSClient
from tests.integration.test_train_exact import assert_matches_reference

pytestmark = pytest.mark.integration

STEPS = 30
BATCH = 8
TABLES = """
[tables.movies]
lr = 0.2
[features.item]
table = "movies"
[features.history]
table = "movies"
pooling = "mean"
[tables.genres]
init = "normal"
init_scale = 0.1
[features.genres]
table = "genres"
pooling = "mean"
"""


@pytest.mark.parametrize("workers,consistency,replicate_below", [(2, "bsp", 0), (2, "bounded", 0), (2, "bsp", 25)])
def test_shared_table_and_mean_bags_equal_single_process(tmp_path, data_dir, workers, consistency, replicate_below):
    source = str(data_dir / "movielens" / "ml-latest-small" / "ratings.csv")
    tables_file = tmp_path / "tables.toml"
    tables_file.write_text(TABLES)
    cfg = TrainConfig.from_flags(
        source=source,
        source_options=(("side_features", True), ("history_length", 12)),
        tables=str(tables_file),
        schedule="herald",
        workers=workers,
        batch_size=BATCH,
        cache_rows=150,
        embedding_dim=4,
        optimizer="sgd",
        lr=0.1,
        dense_optimizer="sgd",
        dense_lr=0.05,
        model="dlrm",
        steps=STEPS,
        eval_fraction=0.0,
        seed=5,
        run_dir=str(tmp_path / "run"),
        timeout_ms=60_000,
        consistency=consistency,
        replicate_below=replicate_below,
    )
    seen: dict = {}

    def grab(addresses, job):
        seen["job"] = job
        src = RowRange(open_source(source, side_features=True, history_length=12), 0, STEPS * workers * BATCH)
        with GlobalBatcher(src, workers * BATCH, drop_last=True) as batcher:
            batches = list(itertools.islice(batcher, STEPS))
        seen["ref_model"], ref_rows = train_reference(job, batches)
        seen["ref_keys"] = {t for t, _ in ref_rows}
        by_table: dict[int, list[int]] = {}
        for t, k in ref_rows:
            by_table.setdefault(t, []).append(k)
        with PSClient(addresses, tables=list(job.tables), timeout_ms=10_000) as client:
            got = client.pull_async({t: np.array(ks, np.uint64) for t, ks in by_table.items()}).wait()
        dim = job.tables[0].dim
        pairs = [(got[t][i], ref_rows[(t, k)]) for t, ks in by_table.items() for i, k in enumerate(ks)]
        seen["diff"] = max(float(np.abs(a[:dim] - b[:dim]).max()) for a, b in pairs)
        seen["state_rel"] = 0.0

    rep = run_train(cfg, progress=False, on_finish=grab)
    job = seen["job"]
    assert rep["steps"] == STEPS
    # user keeps its own table; item and history share "movies"; genres its own
    assert [t.name for t in job.tables] == ["user", "movies", "genres"]
    assert [f.name for f in job.features] == ["user", "item", "genres", "history"]
    assert job.feature_tables == (0, 1, 2, 1) and [f.pooling for f in job.features] == ["sum", "sum", "mean", "mean"]
    assert job.tables[1].optimizer.lr == 0.2 and job.tables[2].init == "normal"
    assert seen["ref_keys"] == {0, 1, 2}
    tx = rep["transmissions"]
    assert tx["evict_push"] + tx["update_pull"] > 0, "the cache was never under pressure"
    assert bool(rep["replicated_tables"]) == bool(replicate_below)
    assert_matches_reference(seen, tmp_path / "run", workers)

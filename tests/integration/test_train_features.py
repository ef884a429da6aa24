"""Declared tables and features trained exactly (NOTE [tables and features] in
herald/contracts/features.py; Herald §3.3's BSP exactness): on MovieLens with its side
features, the user's history reads the movie table that the rated item reads (one key
space), genres and history are mean-pooled bags, and the job equals one process.

Real PS shards, dispatcher and workers (as tests/integration/test_train_exact.py); a
small cache forces evictions and update pulls, so shared keys travel the whole plan.
"""

from __future__ import annotations

import itertools

import pytest

from herald.contracts.train import TrainConfig
from herald.job.launcher import run_train
from herald.job.reference import train_reference
from herald.loader import GlobalBatcher, open_source
from herald.loader.splits import RowRange
from tests.integration.test_train_exact import assert_matches_reference, ps_against_reference

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


# Tables of three widths and two row layouts (NOTE [mixed widths] in herald/ps/router.py):
# user 4 (sgd), movies 16 (shared by item and history), genres 8 (adagrad: a wider row).
MIXED = """
[tables.user]
dim = 4
optimizer = "sgd"
[tables.movies]
dim = 16
[features.user]
table = "user"
[features.item]
table = "movies"
[features.history]
table = "movies"
pooling = "mean"
[tables.genres]
dim = 8
optimizer = "adagrad"
lr = 0.05
[features.genres]
table = "genres"
pooling = "mean"
"""


@pytest.mark.parametrize(
    "workers,consistency,replicate_below,layout",
    # one width under DLRM; three widths (with the shared table and mean bags) under bsp, bounded
    # and with replicated tables
    [(2, "bsp", 0, "shared"), (2, "bsp", 0, "mixed"), (2, "bounded", 0, "mixed"), (2, "bsp", 25, "mixed")],
)  # fmt: skip
def test_shared_table_and_mean_bags_equal_single_process(
    tmp_path, data_dir, workers, consistency, replicate_below, layout, cache_device="auto"
):
    source = str(data_dir / "movielens" / "ml-latest-small" / "ratings.csv")
    tables_file = tmp_path / "tables.toml"
    tables_file.write_text(TABLES if layout == "shared" else MIXED)
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
        model="dlrm" if layout == "shared" else "dcn",
        steps=STEPS,
        eval_fraction=0.0,
        seed=5,
        run_dir=str(tmp_path / "run"),
        timeout_ms=60_000,
        consistency=consistency,
        replicate_below=replicate_below,
        cache_device=cache_device,
    )
    seen: dict = {}

    def grab(addresses, job):
        seen["job"] = job
        src = RowRange(open_source(source, side_features=True, history_length=12), 0, STEPS * workers * BATCH)
        with GlobalBatcher(src, workers * BATCH, drop_last=True) as batcher:
            batches = list(itertools.islice(batcher, STEPS))
        seen["ref_model"], ref_rows = train_reference(job, batches)
        seen["ref_keys"] = {t for t, _ in ref_rows}
        seen.update(ps_against_reference(addresses, job, ref_rows))

    rep = run_train(cfg, progress=False, on_finish=grab)
    job = seen["job"]
    assert rep["steps"] == STEPS
    # user keeps its own table; item and history share "movies"; genres its own
    assert [t.name for t in job.tables] == ["user", "movies", "genres"]
    assert [f.name for f in job.features] == ["user", "item", "genres", "history"]
    assert job.feature_tables == (0, 1, 2, 1) and [f.pooling for f in job.features] == ["sum", "sum", "mean", "mean"]
    if layout == "shared":
        assert job.tables[1].optimizer.lr == 0.2 and job.tables[2].init == "normal"
    else:
        assert [t.dim for t in job.tables] == [4, 16, 8] and job.mixed_widths
        assert job.feature_dims == (4, 16, 8, 16)
    assert seen["ref_keys"] == {0, 1, 2}
    tx = rep["transmissions"]
    assert tx["evict_push"] + tx["update_pull"] > 0, "the cache was never under pressure"
    assert bool(rep["replicated_tables"]) == bool(replicate_below)
    assert_matches_reference(seen, tmp_path / "run", workers)


def test_mixed_widths_in_the_torch_cache_equal_single_process(tmp_path, data_dir):
    """The device cache's torch optimizer (NOTE [device cache]) on rows padded to the widest table."""
    test_shared_table_and_mean_bags_equal_single_process(tmp_path, data_dir, 2, "bsp", 0, "mixed", cache_device="torch")
    assert "embedding cache DeviceCache" in (tmp_path / "run" / "worker-0.log").read_text()

"""``herald train --ps-max-rows`` (NOTE [bounded ps] in herald/ps/table.py) end to end:
training and the held-out evaluation under a bound small enough to evict in both, and
the report's counts of evicted rows read again (NOTE [evictions read again])."""

from __future__ import annotations

import numpy as np
import pytest

from herald.contracts.train import TrainConfig
from herald.job.launcher import run_train

pytestmark = pytest.mark.integration

MAX_ROWS = 200


def test_evaluation_splits_its_pulls_under_ps_max_rows_and_counts_rows_read_again(tmp_path, data_dir):
    """The held-out split (720 rows in one evaluation batch) holds far more distinct ids of
    some tables than a shard may hold: the evaluation's pulls are split so that none
    inserts more than ``--ps-max-rows`` keys of a table, and evicted rows read again are
    counted in training and in the evaluation."""
    cfg = TrainConfig.from_flags(
        source=str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv"),
        workers=2,
        batch_size=16,
        cache_rows=400,
        embedding_dim=4,
        steps=20,
        eval_fraction=0.1,
        seed=3,
        ps_shards=1,
        ps_max_rows=MAX_ROWS,
        run_dir=str(tmp_path),
        timeout_ms=60_000,
    )
    rep = run_train(cfg, progress=False)
    m = rep["metrics"]
    assert rep["steps"] == 20 and m["eval_rows"] == 720
    assert np.isfinite(m["logloss"]) and 0.0 <= m["auc"] <= 1.0
    # training evicts (640 samples, up to 640 ids a table) and the evaluation more (new ids)
    assert rep["ps_evicted_rows"] > 0 and m["ps_evicted_rows"] > 0
    # ids of the held-out split seen in training and evicted since are pulled again (re-initialised)
    assert m["ps_evicted_rows_read_again"] > 0
    assert 0 < rep["ps_evicted_rows_read_again"] <= rep["ps_evicted_rows"]
    text = (tmp_path / "report.txt").read_text()
    assert f"evaluation {m['ps_evicted_rows']:,} evicted, {m['ps_evicted_rows_read_again']:,} read again" in text, text

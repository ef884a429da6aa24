"""``herald train --schedule herald --scheduling-budget auto`` (adaptive LAIA, Herald
§4.3) with the parallel scheduler (§4.4): k over the job is in the report, and training
is exact (equal to one process; BSP exactness holds for any allocation, Herald §3.3).

Real PS shard processes, dispatcher and workers, as tests/integration/test_train_exact.py,
whose tolerances this uses."""

from __future__ import annotations

import itertools
import json

import numba
import numpy as np
import pytest
import torch

from herald.contracts.train import TrainConfig
from herald.job.launcher import run_train
from herald.job.reference import train_reference
from herald.loader import GlobalBatcher, open_source
from herald.loader.splits import RowRange
from herald.ps import PSClient

pytestmark = pytest.mark.integration

STEPS, BATCH, WORKERS = 40, 8, 2


def test_train_with_auto_budget_reports_k_and_equals_single_process(tmp_path, data_dir):
    source = str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv")
    threads = min(2, numba.config.NUMBA_NUM_THREADS)
    cfg = TrainConfig.from_flags(
        source=source,
        schedule="herald",
        scheduling_budget="auto",
        scheduler_threads=threads,
        workers=WORKERS,
        batch_size=BATCH,
        cache_rows=260,
        embedding_dim=4,
        optimizer="sgd",
        lr=0.1,
        dense_optimizer="sgd",
        dense_lr=0.05,
        model="dlrm",
        steps=STEPS,
        eval_fraction=0.0,
        seed=3,
        run_dir=str(tmp_path),
        timeout_ms=60_000,
    )
    seen: dict = {}

    def grab(addresses, job):
        src = RowRange(open_source(source), 0, STEPS * WORKERS * BATCH)
        with GlobalBatcher(src, WORKERS * BATCH, drop_last=True) as batcher:
            ref_model, ref_rows = train_reference(job, list(itertools.islice(batcher, STEPS)))
        by_table: dict[int, list[int]] = {}
        for t, k in ref_rows:
            by_table.setdefault(t, []).append(k)
        with PSClient(addresses, tables=list(job.tables), timeout_ms=10_000) as client:
            got = client.pull_async({t: np.array(ks, np.uint64) for t, ks in by_table.items()}).wait()
        seen["diff"] = max(
            float(np.abs(got[t][i][:4] - ref_rows[(t, k)][:4]).max())
            for t, ks in by_table.items()
            for i, k in enumerate(ks)
        )
        seen["ref_model"] = ref_model

    rep = run_train(cfg, progress=False, on_finish=grab)
    assert rep["steps"] == STEPS
    assert seen["diff"] < 1e-5, f"embeddings differ from the single-process reference by {seen['diff']}"
    dense, ref = torch.load(tmp_path / "dense-rank0.pt", weights_only=True), seen["ref_model"].state_dict()
    assert max(float((dense[k] - ref[k]).abs().max()) for k in ref) < 1e-5
    # k over the job, in the JSON report: one controller across the dispatcher's schedulers
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["scheduler"]["threads"] == threads
    ad = saved["scheduler"]["adaptive"]
    assert ad["mode"] == "auto" and ad["fraction"] == 0.5 and ad["num_tables"] == 26
    assert ad["steps"] == STEPS  # one submit per global batch
    assert set(ad["k"]) == {"first", "min", "median", "max", "final"} and ad["k"]["first"] == 26
    assert 1 <= ad["k"]["min"] <= ad["k"]["max"] <= 26 and ad["series"][0] == [0, 26]
    assert ad["period_ms_median"] > 0 and ad["budget_ms"] == pytest.approx(0.5 * ad["period_ms_median"])
    assert "adaptive LAIA (auto budget" in (tmp_path / "report.txt").read_text()

"""TorchRec at N CPU workers (herald.bench.torchrec_dist): DistributedModelParallel over
gloo at 2 processes, and the DDP fallback where TorchRec cannot shard."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from herald.bench import common, torchrec_baseline, torchrec_dist
from herald.errors import ConfigError

SOURCE = "synthetic://criteo?rows=12000&seed=1"


@pytest.fixture(scope="module")
def data():
    missing = torchrec_baseline.torchrec_import_error()
    if missing:  # CI installs torchrec (.ci/run): there a missing one is a failure, not a skip
        if os.environ.get("CI") == "true":
            pytest.fail(missing)
        pytest.skip(missing)
    return common.load_plain_batches(SOURCE, 128)


def test_two_workers_train_under_distributed_model_parallel(data):
    got = torchrec_dist.torchrec_at(data, 2, warmup_steps=3)
    assert got["workers"] == 2 and got["mode"] == "dmp" and got["dmp_error"] is None
    assert got["samples_per_s"] > 0 and got["cpu_us_per_sample"] > 0
    assert got["global_batch"] == 256 and got["timed_steps"] == len(data.batches) // 2 - 3
    assert sorted(got["sharding"]) == sorted(f"t{t}" for t in range(26))  # every table placed by the planner


def test_where_torchrec_cannot_shard_the_call_is_named_and_ddp_runs(data, monkeypatch, tmp_path):
    """One rank in this process: DistributedModelParallel made to raise; the entry names it
    and the collection trains replicated under DDP instead."""
    from torchrec.distributed import model_parallel

    def refuse(*args, **kwargs):
        raise RuntimeError("no sharder for this kernel on cpu")

    monkeypatch.setattr(model_parallel, "DistributedModelParallel", refuse)
    short = common.PlainBatches(data.batches[:6], data.table_rows, data.dense_dim, 0.0, 0.0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = {"seed": 0, "mode": "dmp", "warmup_steps": 2}
        got = torchrec_dist._train_rank(0, 1, short, cfg)
    finally:
        dist.destroy_process_group()
    assert got["mode"] == "ddp" and got["sharding"] is None
    assert got["dmp_error"].startswith("DistributedModelParallel(device=cpu): RuntimeError: no sharder")
    assert got["samples_per_s"] > 0 and got["timed_steps"] == 4


def test_too_few_batches_for_the_ranks_is_refused(data):
    short = common.PlainBatches(data.batches[:8], data.table_rows, data.dense_dim, 0.0, 0.0)
    with pytest.raises(ConfigError, match="raise --rows"):
        torchrec_dist.torchrec_at(short, 2, warmup_steps=4)
    with pytest.raises(ConfigError, match="mode must be one of"):
        torchrec_dist.torchrec_at(data, 2, mode="fsdp")

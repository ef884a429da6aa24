"""Settings that need the source's schema, and ``--device``, are refused when the job's
settings are checked: before any pass over the data and before any PS shard, dispatcher
or worker starts (issue 26, item 3; :meth:`TrainConfig.check_schema`,
:meth:`LocalWorkers.prepare`)."""

from __future__ import annotations

import time

import pytest

from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.job import parts
from herald.job.data import JobData
from herald.job.launcher import run_train
from herald.loader import splits
from herald.procs import Supervisor
from herald.worker import devices

CRITEO = "criteo/criteo_kaggle_sample_train.tsv"
MOVIELENS = "movielens/ml-latest-small/ratings.csv"


@pytest.fixture
def nothing_starts(monkeypatch):
    """Every call that would start a process of the job, or read the whole input (the row
    count, the distinct-key pre-pass), fails the test instead."""

    def forbidden(what):
        def call(*args, **kwargs):
            raise AssertionError(f"{what} was called: the refusal must come before it")

        return call

    for cls, name in (
        (parts.LocalPS, "open"),
        (parts.LocalWorkers, "open"),
        (parts.LocalWorkers, "start"),
        (Supervisor, "start"),
    ):
        monkeypatch.setattr(cls, name, forbidden(f"{cls.__name__}.{name}"))
    for name in ("open_train_eval", "distinct_keys_per_table"):
        monkeypatch.setattr(splits, name, forbidden(f"splits.{name}"))


def _refusal(cfg: TrainConfig) -> tuple[str, float]:
    """``(message, CPU seconds)`` of ``herald train``'s refusal of ``cfg``."""
    cpu0 = time.process_time()
    with pytest.raises(ConfigError) as info:
        run_train(cfg, progress=False)
    return str(info.value), time.process_time() - cpu0


def test_ncf_on_26_tables_is_refused_before_anything_starts(data_dir, tmp_path, nothing_starts):
    """The user's case: ``--model ncf`` on the Criteo sample used to be refused by every worker
    after ~20 s of start-up; now before any process starts, in well under a second of CPU."""
    cfg = TrainConfig.from_flags(source=str(data_dir / CRITEO), model="ncf", run_dir=str(tmp_path / "run"))
    message, cpu_s = _refusal(cfg)
    assert "--model ncf (NCF) needs exactly 2 tables (user, item), and the source has 26: C1, C2" in message
    assert "choose --model dlrm" in message
    assert cpu_s < 1.0, f"the refusal took {cpu_s:.3f} s of CPU"


def test_the_model_auto_picks_is_checked_against_the_embedding_dim(data_dir, tmp_path, nothing_starts):
    """``--model auto`` trains Wide&Deep on Criteo, which reads the scalar slice: dim 1 is
    refused naming both flags (TrainConfig alone cannot: auto depends on the source)."""
    cfg = TrainConfig.from_flags(source=str(data_dir / CRITEO), embedding_dim=1, run_dir=str(tmp_path / "run"))
    message, _ = _refusal(cfg)
    assert message.startswith("--model auto (here wdl) needs --embedding-dim >= 2")
    assert "set --embedding-dim 2 or more" in message


def test_job_data_refuses_before_its_passes_over_the_data(data_dir, nothing_starts):
    """``herald serve dispatcher`` and the test bed read through JobData too."""
    with pytest.raises(ConfigError, match="--model ncf .* source has 22"):
        JobData(TrainConfig.from_flags(source=str(data_dir / "avazu/avazu_sample_train.csv"), model="ncf"))


@pytest.mark.parametrize(
    "source,model,dim", [(MOVIELENS, "ncf", 1), (MOVIELENS, "auto", 16), (CRITEO, "auto", 2), (CRITEO, "dcn", 1)]
)
def test_models_the_source_can_feed_pass(data_dir, source, model, dim):
    path = str(data_dir / source)
    cfg = TrainConfig.from_flags(source=path, model=model, embedding_dim=dim)
    cfg.check_schema(splits.source_schema(path, {}), "movielens" if source == MOVIELENS else "criteo")


def test_device_cuda_without_a_gpu_is_refused_before_anything_starts(tmp_path, monkeypatch, nothing_starts):
    monkeypatch.setattr(devices, "visible_gpus", lambda: 0)
    message, cpu_s = _refusal(TrainConfig.from_flags(device="cuda", run_dir=str(tmp_path / "run")))
    assert message.startswith("--device cuda needs CUDA, but no GPU is visible")
    assert cpu_s < 1.0, f"the refusal took {cpu_s:.3f} s of CPU"


def test_device_beyond_the_visible_gpus_is_refused_before_anything_starts(tmp_path, monkeypatch, nothing_starts):
    monkeypatch.setattr(devices, "visible_gpus", lambda: 2)
    message, _ = _refusal(TrainConfig.from_flags(device="cuda:2", run_dir=str(tmp_path / "run")))
    assert message.startswith("--device cuda:2: only 2 GPU(s) are visible")


def test_the_device_check_asks_cuda_only_for_cuda(monkeypatch):
    def no_cuda_call():
        raise AssertionError("auto and cpu must not ask CUDA")

    monkeypatch.setattr(devices, "visible_gpus", no_cuda_call)
    for device in ("auto", "cpu"):
        parts.LocalWorkers().prepare(TrainConfig.from_flags(device=device, workers=4))
    devices.check_device("cuda", 4, cuda_count=2)  # 4 workers share 2 GPUs (gloo): trains
    devices.check_device("cuda:1", 4, cuda_count=2)

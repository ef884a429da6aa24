"""--consistency / --staleness / --slow-worker: parsing, relationships, and how they reach the JobSpec."""

import pytest

from herald.contracts.consistency import check_consistency, parse_slow_worker
from herald.contracts.job import JobSpec
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError


def test_slow_worker_parses_rank_and_ms():
    assert parse_slow_worker(None) == (-1, 0)
    assert parse_slow_worker("1:200") == (1, 200)
    assert parse_slow_worker(" 0 : 5 ", num_workers=1) == (0, 5)


@pytest.mark.parametrize(
    "text, words", [("1", "RANK:MS"), ("a:1", "RANK:MS"), ("1:0", "1.."), ("-1:3", "RANK:MS"), ("2:10", "ranks 0..1")]
)
def test_slow_worker_rejects_bad_values_naming_the_fix(text, words):
    with pytest.raises(ConfigError, match="--slow-worker") as info:
        parse_slow_worker(text, num_workers=2)
    assert words in str(info.value)


def test_staleness_belongs_to_bounded():
    check_consistency("bounded", 4)
    check_consistency("bsp", 0)
    with pytest.raises(ConfigError, match="choose bounded"):
        check_consistency("bsp", 2)
    with pytest.raises(ConfigError, match="--staleness must be"):
        check_consistency("bounded", -1)
    with pytest.raises(ConfigError, match="--consistency must be one of"):
        check_consistency("eventual", 0)


def test_train_config_checks_and_job_spec_carries_the_settings():
    with pytest.raises(ConfigError, match="--slow-worker rank 3"):
        TrainConfig(workers=2, slow_worker="3:10")
    with pytest.raises(ConfigError, match="--staleness"):
        TrainConfig(staleness=1)
    cfg = TrainConfig(workers=2, consistency="bounded", staleness=4, slow_worker="1:25")
    table = TableConfig(name="t0", dim=4, optimizer=OptimizerConfig(name="sgd", lr=0.1))
    job = JobSpec(
        tables=(table,),
        dense_dim=0,
        ps=("tcp://127.0.0.1:1",),
        consistency=cfg.consistency,
        staleness=cfg.staleness,
        **dict(zip(("slow_worker_rank", "slow_worker_ms"), parse_slow_worker(cfg.slow_worker))),
    )
    back = JobSpec.from_dict(job.to_dict())
    assert (back.consistency, back.staleness, back.slow_worker_rank, back.slow_worker_ms) == ("bounded", 4, 1, 25)

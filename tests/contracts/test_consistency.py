"""--consistency / --staleness / --slow-worker: parsing, relationships, and how they reach the JobSpec."""

import pytest

from herald.contracts.consistency import Straggler
from herald.contracts.job import JobSpec
from herald.contracts.modes import BoundedSettings
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError


def test_slow_worker_parses_rank_and_ms():
    assert Straggler.parse(None) == Straggler(-1, 0)
    assert Straggler.parse("1:200") == Straggler(1, 200)
    assert Straggler.parse(" 0 : 5 ", num_workers=1) == Straggler(0, 5)


@pytest.mark.parametrize(
    "text, words", [("1", "RANK:MS"), ("a:1", "RANK:MS"), ("1:0", "1.."), ("-1:3", "RANK:MS"), ("2:10", "ranks 0..1")]
)
def test_slow_worker_rejects_bad_values_naming_the_fix(text, words):
    with pytest.raises(ConfigError, match="--slow-worker") as info:
        Straggler.parse(text, num_workers=2)
    assert words in str(info.value)


def test_a_straggler_is_two_ints():
    for rank, ms in ((1.0, 5), (1, -1), (1, "5")):
        with pytest.raises(ConfigError, match="slow_worker_rank and slow_worker_ms must be ints"):
            Straggler(rank, ms)


def test_staleness_belongs_to_bounded():
    assert TrainConfig.from_flags(consistency="bounded", staleness=4).mode == BoundedSettings(4)
    assert TrainConfig.from_flags(consistency="bsp", staleness=0).consistency == "bsp"
    with pytest.raises(ConfigError, match="choose bounded"):
        TrainConfig.from_flags(consistency="bsp", staleness=2)
    with pytest.raises(ConfigError, match="--staleness must be"):
        TrainConfig.from_flags(consistency="bounded", staleness=-1)
    with pytest.raises(ConfigError, match="--staleness must be"):  # checked under any mode, as given
        TrainConfig.from_flags(consistency="bsp", staleness=0.0)
    with pytest.raises(ConfigError, match="--consistency must be one of"):
        TrainConfig.from_flags(consistency="eventual")
    with pytest.raises(ConfigError, match="--staleness must be"):
        BoundedSettings(staleness=1 << 21)


def test_train_config_checks_and_job_spec_carries_the_settings():
    with pytest.raises(ConfigError, match="--slow-worker rank 3"):
        TrainConfig.from_flags(workers=2, slow_worker="3:10")
    with pytest.raises(ConfigError, match="--staleness"):
        TrainConfig.from_flags(staleness=1)
    cfg = TrainConfig.from_flags(workers=2, consistency="bounded", staleness=4, slow_worker="1:25")
    table = TableConfig(name="t0", dim=4, optimizer=OptimizerConfig(name="sgd", lr=0.1))
    job = JobSpec(tables=(table,), dense_dim=0, ps=("tcp://127.0.0.1:1",), mode=cfg.mode, straggler=cfg.straggler)
    back = JobSpec.from_dict(job.to_dict())
    assert (back.consistency, back.mode.staleness, back.straggler.rank, back.straggler.ms) == ("bounded", 4, 1, 25)
    assert back == job

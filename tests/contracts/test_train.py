"""``herald train`` settings: every TrainConfig value checked on construction with the
flag's own name, before any process starts; internal configs' errors re-worded."""

import argparse

import pytest

from herald import cli
from herald.config import from_arguments
from herald.contracts.flags import flag_errors, in_flag_terms
from herald.contracts.train import TrainConfig
from herald.contracts.vocab import MAX_WORKERS, SCHEDULES
from herald.errors import ConfigError
from herald.job.cli import add_job_arguments
from herald.loader.batch import Schema


def _config(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    return from_arguments(TrainConfig, parser.parse_args(list(argv)))


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dense-lr", "nan"], "--dense-lr must be a finite number > 0, got nan"),
        (["--dense-lr", "-1"], "--dense-lr must be a finite number > 0, got -1.0"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
        (["--cache-ratio", "0"], "--cache-ratio must be a finite number in (0, 1], got 0.0"),
        (["--cache-ratio", "1.5"], "--cache-ratio must be a finite number in (0, 1], got 1.5"),
        (["--cache-ratio", "nan"], "--cache-ratio must be a finite number in (0, 1], got nan"),
        (["--eval-fraction", "nan"], "--eval-fraction must be a finite number in [0, 1), got nan"),
        (["--embedding-dim", "0"], "--embedding-dim must be an integer in 1..4096, got 0"),
        (["--embedding-dim", "100000"], "--embedding-dim must be an integer in 1..4096, got 100000"),
        (["--cache-rows", "0"], "--cache-rows must be an integer >= 1 (or unset), got 0"),
        (["--workers", "0"], "--workers must be an integer in 1..64, got 0"),
        (["--workers", "100"], "--workers must be an integer in 1..64, got 100"),
        (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
        (["--seed", "-1"], "--seed must be an integer in 0..9223372036854775807, got -1"),
        (["--timeout-ms", "5"], "--timeout-ms must be an integer in 100..86400000, got 5"),
        (["--ps-shards", "0"], "--ps-shards must be an integer in 1..64 (or unset), got 0"),
        (["--steps", "0"], "--steps must be an integer >= 1 (or unset), got 0"),
        (["--epochs", "0"], "--epochs must be an integer >= 1, got 0"),
        (["--checkpoint-every", "-1"], "--checkpoint-every must be an integer >= 0, got -1"),
        (["--eval-every", "0"], "--eval-every must be an integer >= 1, got 0"),
        (["--max-inflight-steps", "0"], "--max-inflight-steps must be an integer >= 1 (or unset), got 0"),
        (["--replicate-below", "-1"], "--replicate-below must be an integer >= 0, got -1"),
        (["--run-dir", ""], "--run-dir must be a folder path, got ''"),
        (["--source", ""], "--source must be a path or URL, got ''"),
        (["--schedule", "optimal"], "--schedule optimal (brute force) needs --batch-size 1 and --workers <= 8"),
        (["--ps-restarts", "1"], "without --checkpoint-every there is none: add --checkpoint-every STEPS"),
        (
            ["--worker-restarts", "2"],
            "--worker-restarts 2 rolls the job back to its latest checkpoint, and without "
            "--checkpoint-every there is none: add --checkpoint-every STEPS (and --run-dir) or "
            "leave --worker-restarts out",
        ),
        (["--worker-restarts", "-1"], "--worker-restarts must be an integer >= 0, got -1"),
    ],
)
def test_every_setting_is_checked_with_its_flag_name(argv, message):
    with pytest.raises(ConfigError) as info:
        _config(*argv)
    assert message in str(info.value)


def test_restarts_with_checkpoints_are_accepted():
    assert _config("--ps-restarts", "2", "--checkpoint-every", "10").recovery.ps_restarts == 2
    cfg = _config("--worker-restarts", "3", "--ps-restarts", "1", "--checkpoint-every", "10")
    assert (cfg.recovery.worker_restarts, cfg.recovery.ps_restarts) == (3, 1)
    assert (
        _config("--worker-restarts", "1", "--checkpoint-every", "5", "--consistency", "gba").recovery.worker_restarts
        == 1
    )


def test_programmatic_values_are_checked_too():
    with pytest.raises(ConfigError, match="--workers must be an integer"):
        TrainConfig.from_flags(workers=2.5)
    with pytest.raises(ConfigError, match="--dense-lr must be a finite number"):
        TrainConfig.from_flags(dense_lr="0.1")
    with pytest.raises(ConfigError, match="--resume is a switch"):
        TrainConfig.from_flags(resume="yes")
    with pytest.raises(ConfigError, match="--model must be one of auto, dlrm, ncf"):
        TrainConfig.from_flags(model="wide")
    assert TrainConfig().global_batch == 256  # the defaults are valid


def test_every_schedule_of_the_vocabulary_has_an_allocation_policy():
    from herald.scheduler import SchedulerConfig

    for name in SCHEDULES:
        workers, batch = (2, 1) if name == "optimal" else (MAX_WORKERS, 4)
        cfg = SchedulerConfig(num_workers=workers, batch_size_per_worker=batch, schedule=name)
        assert cfg.allocation in ("random", "laia", "costaware", "bruteforce")


def test_internal_config_errors_are_reworded_with_flags():
    from herald.contracts.tables import TableConfig
    from herald.dispatch.dispatcher import DispatcherConfig
    from herald.scheduler import SchedulerConfig

    cases = [
        (lambda: SchedulerConfig(cache_capacity_rows=0), "--cache-rows must be None or an int >= 1, got 0"),
        (lambda: SchedulerConfig(num_workers=2, batch_size_per_worker=0), "--batch-size must be an int >= 1"),
        (
            lambda: SchedulerConfig(schedule="optimal", num_workers=2, batch_size_per_worker=4),
            "--schedule 'optimal' (brute force) needs --batch-size 1 and --workers <= 8",
        ),
        (lambda: TableConfig(name="C1", dim=0), "--embedding-dim must be a positive int"),
        (lambda: DispatcherConfig(num_workers=1, peer_timeout_ms=0), "--timeout-ms must be > 0"),
    ]
    for build, message in cases:
        with pytest.raises(ConfigError) as info, flag_errors():
            build()
        assert message in str(info.value), str(info.value)
    assert in_flag_terms("timeout_ms must be > 0 and retries >= 0, got 0, 3") == "--timeout-ms must be > 0, got 0"


def test_tables_of_a_config_use_flag_names():
    cfg = TrainConfig.from_flags(embedding_dim=8, lr=0.5)
    tables = cfg.tables(Schema(("C1", "C2"), 0))
    assert [t.dim for t in tables] == [8, 8] and tables[0].optimizer.lr == 0.5


def test_cli_rejects_bad_value_at_once(capsys):
    assert cli.main(["train", "--dense-lr", "nan"]) == 2
    assert capsys.readouterr().err.strip() == "herald: error: --dense-lr must be a finite number > 0, got nan"

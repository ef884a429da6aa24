"""Nested settings with flat flags (herald/config.py, herald/contracts/settings.py): each group
validates itself naming its flag, a config round-trips through its flags (the command line,
the test bed's saved JSON, the report's config) and JobSpec's wire form."""

from __future__ import annotations

import dataclasses

import pytest

from herald.config import Nested, flags_of, from_flags, nested, options, setting
from herald.contracts.comm import CommSettings, GroupSettings
from herald.contracts.consistency import Straggler
from herald.contracts.job import JobSpec
from herald.contracts.modes import BoundedSettings, GbaSettings
from herald.contracts.settings import (
    CacheSettings,
    DenseSettings,
    EmbeddingSettings,
    LauncherSettings,
    RecoverySettings,
    SchedulingSettings,
    SecuritySettings,
)
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError

#: one setting of every group away from its default
CHANGED = dict(
    schedule="laia",
    scheduling_budget="auto",
    scheduler_threads=2,
    consistency="bounded",
    staleness=3,
    slow_worker="1:20",
    wire_dtype="fp16",
    dense_comm="bf16",
    groups=2,
    average_every=4,
    easgd_alpha=0.5,
    workers=4,
    cache_ratio=0.5,
    cache_rows=100,
    cache_policy="lfu",
    cache_device="cpu",
    embedding_dim=8,
    optimizer="adam",
    lr=0.01,
    dense_optimizer="sgd",
    dense_lr=0.1,
    ps_restarts=1,
    worker_restarts=2,
    checkpoint_every=5,
    keys_dir="keys",
    insecure=True,
    launcher="ray",
    ray_address="auto",
    storage_path="/mnt/shared",
)


def test_the_settings_nest_while_the_flags_stay_flat():
    assert len(dataclasses.fields(TrainConfig)) <= 33 and len(dataclasses.fields(JobSpec)) <= 23
    cfg = TrainConfig.from_flags(**{**CHANGED, "consistency": "bsp", "staleness": 0}).with_flags(
        consistency="bounded", staleness=3
    )
    assert cfg.scheduling == SchedulingSettings("laia", "auto", 2)
    assert cfg.cache == CacheSettings(0.5, 100, "lfu", "cpu")
    assert (cfg.embedding, cfg.dense) == (EmbeddingSettings(8, "adam", 0.01), DenseSettings("sgd", 0.1))
    assert (cfg.recovery, cfg.security) == (RecoverySettings(1, 2), SecuritySettings("keys", True))
    assert cfg.launcher == LauncherSettings("ray", "auto", "/mnt/shared")
    assert (cfg.comm, cfg.groups, cfg.mode) == (
        CommSettings("fp16", "bf16"),
        GroupSettings(2, 4, 0.5),
        BoundedSettings(3),
    )
    flags = cfg.flags()
    assert {k: flags[k] for k in CHANGED} == CHANGED
    assert set(flags) == {o.dest for o in options(TrainConfig)}
    assert TrainConfig.from_flags(flags) == cfg


def test_an_unknown_flag_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['cache_size'\] for herald train; known") as info:
        TrainConfig.from_flags(cache_size=3)
    assert "'cache_rows'" in str(info.value) and "'staleness'" in str(info.value)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: CacheSettings(rows=0), "--cache-rows must be an integer >= 1 (or unset), got 0"),
        (lambda: CacheSettings(ratio=2.0), "--cache-ratio must be a finite number in (0, 1], got 2.0"),
        (lambda: CacheSettings(device="gpu"), "--cache-device must be one of auto, cpu, torch, got 'gpu'"),
        (lambda: EmbeddingSettings(dim=0), "--embedding-dim must be an integer in 1..4096, got 0"),
        (lambda: EmbeddingSettings(optimizer="lamb"), "--optimizer must be one of sgd, adagrad"),
        (lambda: DenseSettings(lr=0), "--dense-lr must be a finite number > 0, got 0"),
        (lambda: SchedulingSettings(threads=0), "--scheduler-threads must be an integer in 1..256, got 0"),
        (lambda: SchedulingSettings("vanilla", budget=5.0), "use it with --schedule herald, laia or costaware"),
        (lambda: RecoverySettings(ps_restarts=-1), "--ps-restarts must be an integer >= 0, got -1"),
        (lambda: RecoverySettings(worker_restarts=1).check(0), "--worker-restarts 1 rolls the job back"),
        (lambda: SecuritySettings(keys_dir=""), "--keys must be a folder path, got ''"),
        (lambda: SecuritySettings(insecure=1), "--insecure is a switch (True/False), got 1"),
        (lambda: LauncherSettings(ray_address="auto"), "--ray-address is a setting of the Ray launcher"),
        (lambda: CommSettings(wire_dtype="fp8"), "--wire-dtype must be one of"),
        (lambda: GroupSettings(easgd_alpha=1.0), "--easgd-alpha must be a number in (0, 1)"),
        (lambda: GroupSettings(2).check(3), "--groups 2 must divide --workers 3"),
        (lambda: TrainConfig(cache=0.5), "cache must be a CacheSettings, got 0.5"),
    ],
)
def test_each_group_validates_itself_naming_the_flag(build, message):
    with pytest.raises(ConfigError) as info:
        build()
    assert message in str(info.value)


def test_the_job_spec_wire_form_carries_the_nested_settings():
    table = TableConfig(name="t0", dim=4, optimizer=OptimizerConfig(name="sgd", lr=0.1))
    job = JobSpec(
        tables=(table,),
        dense_dim=0,
        ps=("tcp://127.0.0.1:1",),
        mode=GbaSettings(2, 1),
        straggler=Straggler(1, 30),
        comm=CommSettings("int8", "fp16"),
        groups=GroupSettings(2, 3, 0.25),
        group_index=1,
    )
    wire = job.to_dict()
    assert wire["version"] == 4 and wire["comm"] == {"wire_dtype": "int8", "dense_comm": "fp16"}
    assert wire["groups"] == {"count": 2, "average_every": 3, "easgd_alpha": 0.25}
    assert JobSpec.from_dict(wire) == job
    with pytest.raises(ConfigError, match="job spec version 2 is not 4"):
        JobSpec.from_dict({**wire, "version": 2})
    with pytest.raises(ConfigError, match="unknown setting"):
        JobSpec.from_dict({**wire, "comm": {"wire": "int8"}})
    with pytest.raises(ConfigError, match="group_index must be -1 or a group below groups 2"):
        job.replace(group_index=2)


def test_the_test_beds_saved_config_round_trips(tmp_path):
    from herald.testbed.dispatcher import load_config, save_config

    cfg = TrainConfig.from_flags(
        **{k: v for k, v in CHANGED.items() if k not in ("launcher", "ray_address", "storage_path")},
        source_options=(("bad_records", "skip"),),
    )
    assert load_config(save_config(cfg, tmp_path / "job.json")) == cfg
    (tmp_path / "bad.json").write_text('{"cache_size": 3}')
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(tmp_path / "bad.json")


@dataclasses.dataclass(frozen=True)
class Inner:
    rows: int = setting(1, "rows")
    size: int = setting(2, "size", dest="inner_bytes")


@dataclasses.dataclass(frozen=True)
class Outer:
    top: int = setting(0, "top")
    inner: Inner = nested(Inner, prefix="inner_")


@dataclasses.dataclass(frozen=True)
class Twice:
    rows: int = setting(0, "rows")
    inner: Inner = nested(Inner)


def test_nested_options_take_a_prefix_or_their_own_name_and_must_be_unique():
    assert [o.dest for o in options(Outer)] == ["top", "inner_rows", "inner_bytes"]
    built = from_flags(Outer, {"inner_rows": 5, "inner_bytes": 7})
    assert built == Outer(0, Inner(5, 7)) and flags_of(built) == {"top": 0, "inner_rows": 5, "inner_bytes": 7}
    assert Nested(Inner, "inner_").flatten(Inner()) == {"inner_rows": 1, "inner_bytes": 2}
    with pytest.raises(ConfigError, match=r"options \['rows'\] defined twice"):
        options(Twice)

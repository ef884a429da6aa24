"""``herald produce`` against a real broker, and the Kafka settings' validation (no broker)."""

from __future__ import annotations

import argparse

import pytest

from herald.errors import ConfigError
from herald.loader.batch import SampleBatch
from herald.loader.kafka.source import KafkaSourceConfig, config_from_url
from herald.loader.produce import ProduceSettings, produce
from herald.loader.produce_cli import register
from herald.loader.registry import open_source

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def herald_produce(argv):
    """Run ``herald produce ARGV`` through this module's parser (as herald.cli does)."""
    parser = argparse.ArgumentParser(prog="herald")
    commands = parser.add_subparsers(dest="command")
    register(commands)
    args = parser.parse_args(["produce", *argv])
    return args.func(args)


def read_topic(bootstrap, topic, fmt, group="check"):
    url = f"kafka://{bootstrap}/{topic}?format={fmt}&group={group}&api_version=0.9&idle_timeout_ms=1000"
    with open_source(url) as src:
        return SampleBatch.concat(list(src)), src.stats


@pytest.mark.parametrize(
    "fmt,file",
    [
        ("tsv", "criteo/criteo_kaggle_sample_dev.tsv"),
        ("csv", "avazu/avazu_sample_train.csv"),  # has a header line
        ("arrow", "criteo/criteo_kaggle_sample_dev.tsv"),
    ],
)
def test_produce_cli_round_trip(kafka_broker, kafka_topic, data_dir, fmt, file, capsys):
    path = data_dir / file
    rc = herald_produce(
        [
            "--bootstrap",
            kafka_broker,
            "--topic",
            kafka_topic,
            "--format",
            fmt,
            "--rows-per-message",
            "100",
            "--limit",
            "250",
            "--no-progress",
            "--client-option",
            "api_version=0.9",
            str(path),
        ]
    )
    assert rc == 0
    assert "published 250 samples in " + ("3" if fmt == "arrow" else "250") + " messages" in capsys.readouterr().out
    got, stats = read_topic(kafka_broker, kafka_topic, fmt)
    with open_source(path) as src:
        assert got.equals(src.read(250))
    assert stats["skipped"] == {}


def test_produce_arrow_from_any_source_and_rate_limit(kafka_broker, kafka_topic):
    settings = ProduceSettings(
        kafka_broker,
        kafka_topic,
        "arrow",
        rows_per_message=64,
        rate_samples_per_s=2000,
        client_options={"api_version": (0, 9)},
    )
    stats = produce("synthetic://criteo?rows=500&seed=3", settings)
    assert stats["rows"] == 500 and stats["messages"] == 8
    assert stats["seconds"] >= 0.2  # 500 samples at 2,000/s, first message free
    got, _ = read_topic(kafka_broker, kafka_topic, "arrow")
    with open_source("synthetic://criteo?rows=500&seed=3") as src:
        assert got.equals(SampleBatch.concat(list(src)))


def test_produce_tsv_rejects_non_text_source(kafka_broker):
    settings = ProduceSettings(kafka_broker, "never-created", "tsv", client_options={"api_version": (0, 9)})
    with pytest.raises(ConfigError, match="--format arrow"):
        produce("synthetic://criteo?rows=10", settings)


# ------------------------------------------------------------ settings (no broker)
def test_config_rejects_unknown_and_reserved_client_options():
    with pytest.raises(ConfigError, match="unknown kafka-python consumer option"):
        KafkaSourceConfig("h:1", "t", "g", "tsv", client_options={"api_verison": (0, 9)})
    with pytest.raises(ConfigError, match="set by KafkaSource itself"):
        KafkaSourceConfig("h:1", "t", "g", "tsv", client_options={"enable_auto_commit": True})
    with pytest.raises(ConfigError, match="never guessed"):
        KafkaSourceConfig("h:1", "t", "g", "parquet")
    with pytest.raises(ConfigError, match="bad_records"):
        KafkaSourceConfig("h:1", "t", "g", "tsv", bad_records="ignore")
    with pytest.raises(ConfigError, match="partitions"):
        KafkaSourceConfig("h:1", "t", "g", "tsv", partitions=(0, 0))
    with pytest.raises(ConfigError, match="unknown kafka-python producer option"):
        ProduceSettings("h:1", "t", client_options={"lingerms": 5})


def test_config_from_url():
    cfg = config_from_url(
        "kafka://a:1,b:2/clicks?format=arrow&group=g&partitions=0,2&api_version=0.9"
        "&idle_timeout_ms=500&bad=skip&security_protocol=PLAINTEXT"
    )
    assert (cfg.bootstrap_servers, cfg.topic, cfg.group_id, cfg.format) == ("a:1,b:2", "clicks", "g", "arrow")
    assert cfg.partitions == (0, 2) and cfg.idle_timeout_ms == 500 and cfg.bad_records == "skip"
    assert dict(cfg.client_options) == {"api_version": (0, 9), "security_protocol": "PLAINTEXT"}
    with pytest.raises(ConfigError, match="unknown kafka option"):
        config_from_url("kafka://a:1/t?format=tsv&group=g&colour=red")
    with pytest.raises(ConfigError, match="format="):
        config_from_url("kafka://a:1/t?group=g")
    with pytest.raises(ConfigError, match="group"):
        config_from_url("kafka://a:1/t?format=tsv")


def test_unreachable_broker_raises_peer_timeout_naming_it():
    from herald.errors import PeerTimeout
    from herald.loader.kafka.source import KafkaSource

    with pytest.raises(PeerTimeout, match="127.0.0.1:1"):
        KafkaSource(KafkaSourceConfig("127.0.0.1:1", "t", "g", "tsv", connect_timeout_ms=500))
    with pytest.raises(PeerTimeout, match="127.0.0.1:1"):
        produce("synthetic://criteo?rows=10", ProduceSettings("127.0.0.1:1", "t"))

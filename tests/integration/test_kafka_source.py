"""KafkaSource against a real broker: exact round trips, bad records, commits and resume."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from herald.errors import DataError
from herald.loader.batch import SampleBatch
from herald.loader.kafka.source import KafkaSource, KafkaSourceConfig
from herald.loader.produce import arrow_messages
from herald.loader.registry import open_source

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def criteo_path(data_dir):
    return data_dir / "criteo" / "criteo_kaggle_sample_dev.tsv"


@pytest.fixture(scope="module")
def criteo_lines(criteo_path):
    return criteo_path.read_bytes().splitlines()


@pytest.fixture(scope="module")
def criteo_batch(criteo_path):
    with open_source(criteo_path) as src:
        return SampleBatch.concat(list(src))


def send_all(bootstrap, topic, payloads):
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=(0, 9), linger_ms=5, max_request_size=2_000_000)
    try:
        for p in payloads:
            producer.send(topic, p)
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=10)


def source(bootstrap, topic, fmt, group=None, **kw):
    # a group per topic by default: one group shared by the tests' topics rebalances whenever
    # any test's consumer joins or leaves, and a lingering member stalls the next assignment
    kw.setdefault("idle_timeout_ms", 1000)
    return KafkaSource(
        KafkaSourceConfig(bootstrap, topic, group or f"g-{topic}", fmt, client_options={"api_version": (0, 9)}, **kw)
    )


def read_all(src, max_rows=100):
    out = []
    while (b := src.read(max_rows)) is not None:
        out.append(b)
    return out


def take(src, n):
    """Exactly ``n`` rows (several reads if the records arrive over several polls)."""
    out, left = [], n
    while left:
        b = src.read(left)
        assert b is not None, f"end of data with {left} of {n} rows missing"
        out.append(b)
        left -= len(b)
    return SampleBatch.concat(out)


def arrow_payloads(batch, rows_per_message):
    return [
        p
        for s in range(0, len(batch), rows_per_message)
        for p, _ in arrow_messages(batch.slice(s, s + rows_per_message))
    ]


def test_tsv_round_trip_equals_file(kafka_broker, kafka_topic, criteo_lines, criteo_batch):
    send_all(kafka_broker, kafka_topic, criteo_lines)
    with source(kafka_broker, kafka_topic, "tsv") as src:
        got, offsets = [], []
        while (b := src.read(64)) is not None:
            got.append(b)
            parts, offs = src.last_read_records  # the record of every returned row
            assert len(offs) == len(b) and not parts.any()
            offsets.append(offs)
        assert all(len(b) <= 64 for b in got)
        assert SampleBatch.concat(got).equals(criteo_batch)
        assert np.array_equal(np.concatenate(offsets), np.arange(len(criteo_lines)))
        assert src.stats["rows"] == len(criteo_lines) and src.stats["skipped"] == {}
        assert src.state_dict()["positions"] == {"0": [len(criteo_lines), 0]}


def test_arrow_round_trip_across_message_boundaries(kafka_broker, kafka_topic, criteo_batch):
    send_all(kafka_broker, kafka_topic, arrow_payloads(criteo_batch, 50))
    with source(kafka_broker, kafka_topic, "arrow", partitions=(0,)) as src:
        assert src.schema == criteo_batch.schema
        got = read_all(src, max_rows=37)  # 37 does not divide 50: reads split messages
        assert SampleBatch.concat(got).equals(criteo_batch)
        assert src.last_read_position.offsets == {0: (9, 0)}


def test_bad_tsv_records_skipped_and_counted(kafka_broker, kafka_topic, criteo_lines, criteo_batch):
    good = criteo_lines[:30]
    bad = [b"not\ta\tcriteo\tline", b"", b"2" + good[0][1:], good[1] + b"\nextra"]
    send_all(kafka_broker, kafka_topic, good[:10] + bad[:2] + good[10:20] + bad[2:] + good[20:])
    with source(kafka_broker, kafka_topic, "tsv", bad_records="skip") as src:
        got = SampleBatch.concat(read_all(src, max_rows=7))
        assert got.equals(criteo_batch.slice(0, 30))
        assert src.stats["skipped"] == {"field_count": 2, "empty_line": 1, "bad_label": 1}
        assert src.state_dict()["positions"] == {"0": [34, 0]}


def test_bad_tsv_record_raises_under_strict_after_the_good_ones(kafka_broker, kafka_topic, criteo_lines, criteo_batch):
    send_all(kafka_broker, kafka_topic, criteo_lines[:5] + [b"garbage"] + criteo_lines[5:10])
    with source(kafka_broker, kafka_topic, "tsv") as src:
        assert take(src, 5).equals(criteo_batch.slice(0, 5))
        with pytest.raises(DataError) as err:
            src.read(100)
        assert err.value.position == 5 and err.value.reason == "field_count"
        assert src.state_dict()["positions"] == {"0": [5, 0]}  # the position stops at the bad record


def test_bad_arrow_messages_skipped_or_raised(kafka_broker, kafka_topic, criteo_batch):
    msgs = arrow_payloads(criteo_batch.slice(0, 60), 20)
    send_all(kafka_broker, kafka_topic, [msgs[0], msgs[1][: len(msgs[1]) // 2], b"\x00garbage", msgs[2]])
    with source(kafka_broker, kafka_topic, "arrow", group="skip", bad_records="skip") as src:
        got = SampleBatch.concat(read_all(src))
        expect = SampleBatch.concat([criteo_batch.slice(0, 20), criteo_batch.slice(40, 60)])
        assert got.equals(expect)
        assert src.stats["skipped"] == {"bad_arrow": 2}
    with source(kafka_broker, kafka_topic, "arrow", group="strict") as src:
        assert take(src, 20).equals(criteo_batch.slice(0, 20))
        with pytest.raises(DataError) as err:
            src.read(1000)
        assert err.value.position == 1 and err.value.reason == "bad_arrow"


def test_committed_offsets_resume_and_uncommitted_are_redelivered(
    kafka_broker, kafka_topic, criteo_lines, criteo_batch
):
    send_all(kafka_broker, kafka_topic, criteo_lines[:100])
    with source(kafka_broker, kafka_topic, "tsv", group="resume") as src:
        first = take(src, 30)
        assert first.equals(criteo_batch.slice(0, 30))
        src.commit(src.last_read_position)  # samples 0-29 trained
        take(src, 40)  # read but never committed
        assert src.committed().offsets == {0: (30, 0)}
    with source(kafka_broker, kafka_topic, "tsv", group="resume") as src:
        rest = SampleBatch.concat(read_all(src))
        assert rest.equals(criteo_batch.slice(30, 100))  # 30-69 come again, nothing before 30


def test_commit_inside_an_arrow_message_resumes_at_the_exact_sample(kafka_broker, kafka_topic, criteo_batch):
    send_all(kafka_broker, kafka_topic, arrow_payloads(criteo_batch.slice(0, 100), 40))
    with source(kafka_broker, kafka_topic, "arrow", group="mid") as src:
        take(src, 55)  # message 0 and 15 samples of message 1
        assert src.last_read_position.offsets == {0: (1, 15)}
        src.commit()
    with source(kafka_broker, kafka_topic, "arrow", group="mid") as src:
        assert SampleBatch.concat(read_all(src)).equals(criteo_batch.slice(55, 100))


def test_load_state_dict_resumes_exactly_in_another_group(kafka_broker, kafka_topic, criteo_batch):
    send_all(kafka_broker, kafka_topic, arrow_payloads(criteo_batch, 64))
    with source(kafka_broker, kafka_topic, "arrow", group="a", partitions=(0,)) as src:
        take(src, 100)
        state = src.state_dict()
    assert state["positions"] == {"0": [1, 36]} and state["rows"] == 100
    with source(kafka_broker, kafka_topic, "arrow", group="b") as src:
        src.load_state_dict(state)
        assert SampleBatch.concat(read_all(src, 1000)).equals(criteo_batch.slice(100, len(criteo_batch)))
        assert src.stats["rows"] == len(criteo_batch)


def test_unbounded_read_waits_for_records_and_interrupt_ends_it(kafka_broker, kafka_topic, criteo_lines):
    with source(kafka_broker, kafka_topic, "tsv", idle_timeout_ms=None, poll_timeout_ms=100) as src:
        threading.Timer(1.0, send_all, (kafka_broker, kafka_topic, criteo_lines[:3])).start()
        t0 = time.monotonic()
        assert len(src.read(10)) == 3  # blocked until the records came
        assert time.monotonic() - t0 >= 0.9
        threading.Timer(0.5, src.interrupt).start()
        assert src.read(10) is None


def test_open_source_kafka_url(kafka_broker, kafka_topic, criteo_lines, criteo_batch):
    send_all(kafka_broker, kafka_topic, criteo_lines[:20])
    url = f"kafka://{kafka_broker}/{kafka_topic}?format=tsv&group=url&api_version=0.9&idle_timeout_ms=1000"
    with open_source(url) as src:
        assert SampleBatch.concat(read_all(src)).equals(criteo_batch.slice(0, 20))


def test_shared_resume_harness_with_bad_records_mid_message(kafka_broker, kafka_topic, criteo_batch):
    """tests/loader/resume_harness.py (every source passes it): random read sizes, stop, JSON
    state, fresh source, load, read on == one uninterrupted run, skip counts included."""
    import pathlib
    import sys
    import uuid

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from loader.resume_harness import check_source_resume

    msgs = arrow_payloads(criteo_batch.slice(0, 300), 70)
    send_all(kafka_broker, kafka_topic, [msgs[0], b"junk", msgs[1], msgs[2][:100], msgs[3], msgs[4]])

    def make():  # a fresh group each time: the state, not a commit, decides where to start
        return source(kafka_broker, kafka_topic, "arrow", group=uuid.uuid4().hex, bad_records="skip")

    full = check_source_resume(make, trials=2, max_read=90)
    assert full.equals(SampleBatch.concat([criteo_batch.slice(0, 140), criteo_batch.slice(210, 300)]))


def test_lag_counts_the_records_behind_the_log_end(kafka_broker, kafka_topic, criteo_lines):
    # NOTE [lag]: what the last fetch reported as the log end minus the read position
    send_all(kafka_broker, kafka_topic, criteo_lines)
    with source(kafka_broker, kafka_topic, "tsv") as src:
        assert src.lag() == {"records": {}, "event_time_s": None}  # nothing fetched yet
        take(src, 64)
        lag = src.lag()
        assert lag["records"] == {0: len(criteo_lines) - 64}, lag
        assert lag["event_time_s"] is None  # a 0.9 broker gives no timestamps
        read_all(src)
        assert src.lag()["records"] == {0: 0}

"""`herald train --resume` right after a kill -9, against a real Kafka broker.

The killed job's consumer stays a member of the group until its session times out;
the resumed job's consumer is assigned the partition only then. The source waits for
its assignment (bounded by the session timeout plus a margin) before the idle timeout
counts, so the resumed job trains every remaining step (NOTE [kafka assignment] in
herald/loader/kafka/source.py).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from kafka import KafkaProducer

from herald.errors import PeerTimeout
from herald.loader.kafka.source import KafkaSource, KafkaSourceConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from test_kafka_train import ROWS_PER_MESSAGE, STEP_SAMPLES, _committed, _logged  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

WORKERS, BATCH = 2, 32


def _train_cmd(fmt, bootstrap, topic, run_dir, *extra):
    # kafka-python's session timeout against a 0.9 broker is 30 s: the killed job's
    # consumer holds the partition that long; the idle timeout is far shorter
    url = f"kafka://{bootstrap}/{topic}?format={fmt}&group=g-{topic}&api_version=0.9&idle_timeout_ms=3000"
    return [
        sys.executable,
        "-m",
        "herald",
        "train",
        "--quiet",
        "--source",
        url,
        "--workers",
        str(WORKERS),
        "--batch-size",
        str(BATCH),
        "--cache-rows",
        "1500",
        "--embedding-dim",
        "4",
        "--checkpoint-every",
        "2",
        "--log-sample-ids",
        "--run-dir",
        str(run_dir),
        "--timeout-ms",
        "60000",
        *extra,
    ]


@pytest.mark.slow  # ~50-60 s a case (2 shared cores, real Kafka broker)
@pytest.mark.parametrize("fmt", ["tsv", "arrow"])
def test_resume_right_after_kill_minus_9_trains_the_remaining_steps(tmp_path, data_dir, kafka_broker, kafka_topic, fmt):
    """tsv: nothing waits before the first read. arrow: the schema wait comes first (it
    also waits for the assignment, outside schema_timeout_ms)."""
    source = data_dir / "criteo" / "criteo_kaggle_sample_train.tsv"
    total = 1530
    per_message = ROWS_PER_MESSAGE if fmt == "arrow" else 1
    subprocess.run(
        [
            sys.executable,
            "-m",
            "herald",
            "produce",
            "--bootstrap",
            kafka_broker,
            "--topic",
            kafka_topic,
            "--format",
            fmt,
            "--rows-per-message",
            str(ROWS_PER_MESSAGE),
            "--limit",
            str(total),
            "--client-option",
            "api_version=0.9",
            "--no-progress",
            str(source),
        ],
        check=True,
        timeout=120,
    )
    steps_total = total // STEP_SAMPLES
    run_dir = tmp_path / "run"
    job = subprocess.Popen(
        _train_cmd(fmt, kafka_broker, kafka_topic, run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while _logged(run_dir).size < 8 * STEP_SAMPLES:
        assert job.poll() is None, "training ended before the kill point"
        assert time.monotonic() < deadline, "training made no progress"
        time.sleep(0.05)
    os.kill(job.pid, signal.SIGKILL)  # its consumer stays in the group until its session times out
    job.wait(10)
    committed = _committed(kafka_broker, kafka_topic)
    assert committed.offsets and committed.offsets[0][0] * per_message < steps_total * STEP_SAMPLES
    first = _logged(run_dir).size

    t0 = time.monotonic()
    done = subprocess.run(
        _train_cmd(fmt, kafka_broker, kafka_topic, run_dir, "--resume"), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    trained_now = (_logged(run_dir).size - first) // STEP_SAMPLES
    assert trained_now > 0, (
        f"the resumed job trained nothing (after {time.monotonic() - t0:.1f} s):\n{done.stderr[-3000:]}"
    )
    final = _committed(kafka_broker, kafka_topic)
    assert final.offsets[0][0] * per_message + final.offsets[0][1] == steps_total * STEP_SAMPLES
    trained = _logged(run_dir)
    assert np.unique(trained).size == steps_total * STEP_SAMPLES, "a record was never trained"


def _produce(bootstrap, topic, n):
    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=(0, 9))
    try:
        for i in range(n):
            producer.send(
                topic,
                f"{i % 2}\t{i}\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t".encode()
                + "\t".join(["a1b2c3d4"] * 26).encode(),
            )
        producer.flush(30)
    finally:
        producer.close()


def _config(bootstrap, topic, group, client_id="herald-test", session_timeout_ms=6000, **kw):
    return KafkaSourceConfig(
        bootstrap_servers=bootstrap,
        topic=topic,
        group_id=group,
        format="tsv",
        client_options={"api_version": (0, 9), "session_timeout_ms": session_timeout_ms, "client_id": client_id},
        **kw,
    )


def test_a_group_member_that_holds_the_partition_is_reported_not_read_as_the_end(kafka_broker, kafka_topic):
    """Another live member holds the only partition: this source is assigned nothing, and
    at the idle end records remain after the group's committed position, so it raises
    instead of ending (the range assignor gives the partition to the first member id:
    client ids "a-..." < "z-..." make the holder that member)."""
    _produce(kafka_broker, kafka_topic, 20)
    # the holder only has to stay in the group: a long session survives a loaded machine
    holder = KafkaSource(
        _config(
            kafka_broker, kafka_topic, "held", client_id="a-holder", idle_timeout_ms=60_000, session_timeout_ms=30_000
        )
    )
    stop = threading.Event()
    try:
        assert holder.read(5) is not None  # the holder owns partition 0
        holder.commit()

        def keep_member():  # heartbeats and rejoins the rebalance the second member starts
            while not stop.is_set():
                holder._poll(50)

        thread = threading.Thread(target=keep_member, daemon=True)
        thread.start()
        src = KafkaSource(_config(kafka_broker, kafka_topic, "held", client_id="z-src", idle_timeout_ms=1500))
        try:
            t0 = time.monotonic()
            with pytest.raises(PeerTimeout) as info:
                while src.read(5) is not None:
                    pytest.fail("the second member was given records the holder owns")
            message = str(info.value)
            assert kafka_topic in message and "'held'" in message and "partition 0: offsets 5..19" in message, message
            assert "--resume" in message and "idle_timeout_ms" in message, message
            assert src._group.unassigned_since is None and not src._consumer.assignment()
            assert time.monotonic() - t0 < 30
        finally:
            src.close()
    finally:
        stop.set()
        holder_thread = locals().get("thread")
        if holder_thread is not None:
            holder_thread.join(10)
        holder.close()


def test_no_assignment_within_the_bound_is_a_peer_timeout_naming_group_and_topic(kafka_broker, kafka_topic):
    """A consumer that never gets its assignment (here: a coordinator that never answers
    the join, simulated with a consumer whose poll never assigns) raises PeerTimeout."""

    class NeverAssigned:
        config = {"session_timeout_ms": 500}

        def subscribe(self, topics, listener=None):
            pass

        def poll(self, timeout_ms=0):
            time.sleep(timeout_ms / 1000)
            return {}

        def assignment(self):
            return set()

        def close(self, **kw):
            pass

    cfg = _config(kafka_broker, kafka_topic, "never", idle_timeout_ms=200, assignment_timeout_ms=1500)
    src = KafkaSource(cfg, consumer=NeverAssigned())
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout) as info:
        src.read(5)
    waited = time.monotonic() - t0
    assert 1.4 < waited < 30, waited  # at least the bound; the upper one is generous (a loaded machine adds seconds)
    message = str(info.value)
    assert kafka_broker in message and "never" in message and kafka_topic in message and "1500 ms" in message
    src.close()

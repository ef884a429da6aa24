"""A Kafka broker killed mid-stream under ``herald train`` with checkpoints on (NOTE [kafka
outage] in herald/loader/kafka/outage.py): an outage within the window is ridden out and every
record is trained at least once; a longer one ends the job naming the broker, the topic, the
last committed offsets and the resume command, and blames no worker.

The broker is this module's own (it is killed with SIGKILL and started again on the same port,
log folder and ZooKeeper), not the session's shared one.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from kafka import KafkaConsumer, TopicPartition

from herald.loader.global_batches import record_sample_ids
from herald.loader.kafka.broker import BrokerError, KafkaBroker

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(400)]

WORKERS, BATCH, ROWS_PER_MESSAGE, TOTAL = 2, 32, 100, 1530
STEP_SAMPLES = WORKERS * BATCH
STEPS = TOTAL // STEP_SAMPLES
OUTAGE_S = 10.0


@pytest.fixture(scope="module")
def broker():
    b = KafkaBroker()
    try:
        b.start()
    except (BrokerError, OSError) as exc:
        b.stop()
        pytest.fail(f"could not start the Kafka broker of the outage tests: {exc}", pytrace=False)
    yield b
    b.stop()


def _produce(bootstrap: str, topic: str) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "herald",
            "produce",
            "--bootstrap",
            bootstrap,
            "--topic",
            topic,
            "--format",
            "arrow",
            "--rows-per-message",
            str(ROWS_PER_MESSAGE),
            "--limit",
            str(TOTAL),
            "--client-option",
            "api_version=0.9",
            "--no-progress",
            f"synthetic://criteo?rows={TOTAL}&seed=3",
        ],
        check=True,
        timeout=120,
    )


def _train_cmd(bootstrap, topic, run_dir, *extra, window_ms=None):
    # max_partition_fetch_bytes: about one message per fetch, so reads wait on the broker too;
    # session_timeout_ms: the member a job lost with its broker leaves behind expires in 6 s,
    # not 30, before the --resume joins (NOTE [kafka assignment])
    url = (
        f"kafka://{bootstrap}/{topic}?format=arrow&group=g-{topic}&api_version=0.9&idle_timeout_ms=4000"
        "&max_partition_fetch_bytes=40000&session_timeout_ms=6000"
        + (f"&outage_timeout_ms={window_ms}" if window_ms else "")
    )
    return [
        sys.executable,
        "-m",
        "herald",
        "train",
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
        "4",
        "--log-sample-ids",
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def _logged(run_dir) -> np.ndarray:
    path = pathlib.Path(run_dir) / "trained_sample_ids.u64"
    return np.fromfile(path, np.uint64) if path.exists() else np.zeros(0, np.uint64)


def _trainable() -> np.ndarray:
    """The ids of every sample in a full global batch (the last partial one is never trained)."""
    k = np.arange(STEPS * STEP_SAMPLES)
    return record_sample_ids(0, np.zeros(k.size, np.int32), k // ROWS_PER_MESSAGE, k % ROWS_PER_MESSAGE)


def _committed_offset(bootstrap: str, topic: str) -> int | None:
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, group_id=f"g-{topic}", api_version=(0, 9), enable_auto_commit=False
    )
    try:
        meta = consumer.committed(TopicPartition(topic, 0), metadata=True)
        return None if meta is None else int(meta.offset)
    finally:
        consumer.close()


def _start_and_kill_at(broker, cmd, run_dir, step: int, log: pathlib.Path) -> subprocess.Popen:
    """Start ``cmd``; once ``step`` steps are logged, SIGKILL the broker. Returns the job."""
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    deadline = time.monotonic() + 180
    while _logged(run_dir).size < step * STEP_SAMPLES:
        assert job.poll() is None, f"training ended before the broker was killed:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "training made no progress"
        time.sleep(0.05)
    broker.kill_kafka()
    return job


def test_a_broker_restarted_straight_after_its_crash_comes_back(broker):
    # its ZooKeeper registration outlives the SIGKILL by the session timeout (6 s): Kafka 0.9
    # refuses to start until then, and restart_kafka starts it again until it may
    broker.kill_kafka()
    broker.restart_kafka()
    assert broker.kafka_pid is not None and broker._probe()


def test_an_outage_within_the_window_is_ridden_out_and_every_record_trained(tmp_path, broker):
    topic = f"outage-short-{time.monotonic_ns()}"
    _produce(broker.bootstrap, topic)
    run_dir, log = tmp_path / "run", tmp_path / "stderr.txt"
    job = _start_and_kill_at(broker, _train_cmd(broker.bootstrap, topic, run_dir), run_dir, 6, log)
    killed = time.monotonic()
    try:
        # the outage lasts OUTAGE_S; the job may not end in it (its window: the consumer's 6 + 30 s)
        while time.monotonic() - killed < OUTAGE_S:
            assert job.poll() is None, f"the job ended during the outage:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
    finally:
        broker.restart_kafka()
    rc = job.wait(240)
    err = log.read_text(errors="replace")
    assert rc == 0, err[-3000:]
    assert f"herald: kafka: broker {broker.bootstrap} lost" in err, err[-3000:]
    assert "back after" in err, err[-3000:]
    trained = _logged(run_dir)
    assert np.isin(_trainable(), trained).all(), "a record was never trained"
    assert _committed_offset(broker.bootstrap, topic) == STEPS * STEP_SAMPLES // ROWS_PER_MESSAGE


def test_an_outage_past_the_window_ends_the_job_naming_the_broker_and_the_resume(tmp_path, broker):
    topic = f"outage-long-{time.monotonic_ns()}"
    _produce(broker.bootstrap, topic)
    run_dir, log = tmp_path / "run", tmp_path / "stderr.txt"
    job = _start_and_kill_at(broker, _train_cmd(broker.bootstrap, topic, run_dir, window_ms=3000), run_dir, 6, log)
    try:
        rc = job.wait(120)
    finally:
        if job.poll() is None:
            job.kill()
        broker.restart_kafka()
    err = log.read_text(errors="replace")
    assert rc == 1, err[-3000:]
    error = [line for line in err.splitlines() if line.startswith("herald: error:")]
    assert len(error) == 1, err[-3000:]
    message = error[0]
    assert broker.bootstrap in message and repr(topic) in message and "outage_timeout_ms=3000" in message, message
    committed = _committed_offset(broker.bootstrap, topic)
    assert committed is not None and f"last committed offsets: partition 0: offset {committed}" in message, message
    assert "--resume" in message and str(run_dir) in message, message
    assert "exited with code" not in err and "worker-" not in message, err[-3000:]
    # the resume command it names trains every record (at least once)
    done = subprocess.run(
        _train_cmd(broker.bootstrap, topic, run_dir, "--resume", "--quiet"), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert np.isin(_trainable(), _logged(run_dir)).all(), "a record was never trained"

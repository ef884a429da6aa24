"""Online training from a real Kafka broker: at-least-once delivery across a kill -9.

NOTE [kafka delivery] (herald/loader/global_batches.py): offsets are committed only with a
checkpoint taken after every sample before them was trained; a restart resumes from
the latest checkpoint and replays what came after it.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from kafka import KafkaConsumer, TopicPartition

from herald.loader.global_batches import record_sample_ids
from herald.loader.kafka.config import KafkaPosition

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~40-55 s a case (2 shared cores, real Kafka)

WORKERS, BATCH, ROWS_PER_MESSAGE = 2, 32, 100
STEP_SAMPLES = WORKERS * BATCH


def _train_cmd(bootstrap, topic, run_dir, *extra):
    url = f"kafka://{bootstrap}/{topic}?format=arrow&group=g-{topic}&api_version=0.9&idle_timeout_ms=4000"
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
        "4",
        "--log-sample-ids",
        "--run-dir",
        str(run_dir),
        "--timeout-ms",
        "60000",
        *extra,
    ]


def _logged(run_dir) -> np.ndarray:
    path = pathlib.Path(run_dir) / "trained_sample_ids.u64"
    return np.fromfile(path, np.uint64) if path.exists() else np.zeros(0, np.uint64)


def _children(pid: int) -> list[int]:
    out = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _ids_before(position: KafkaPosition, rows_per_message: int, total: int) -> np.ndarray:
    """Sample ids of every sample before ``position`` (single partition 0)."""
    offset, skip = position.offsets.get(0, (0, 0))
    n = min(total, offset * rows_per_message + skip)
    k = np.arange(n)
    return record_sample_ids(0, np.zeros(n, np.int32), k // rows_per_message, k % rows_per_message)


def _committed(bootstrap, topic) -> KafkaPosition:
    """The group's committed position of partition 0 (with herald's skip metadata)."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, group_id=f"g-{topic}", api_version=(0, 9), enable_auto_commit=False
    )
    try:
        meta = consumer.committed(TopicPartition(topic, 0), metadata=True)
        if meta is None:
            return KafkaPosition(topic, {})
        skip = int(meta.metadata.split("=")[1]) if (meta.metadata or "").startswith("herald:skip=") else 0
        return KafkaPosition(topic, {0: (int(meta.offset), skip)})
    finally:
        consumer.close()


@pytest.mark.parametrize("mode", [[], ["--consistency", "gba", "--gba-threshold", "0"]], ids=["bsp", "gba"])
def test_kill_minus_9_then_resume_trains_every_record(tmp_path, data_dir, kafka_broker, kafka_topic, mode):
    """At-least-once delivery across a kill -9, under BSP and under GBA (iota = 0): NOTE
    [gba checkpoints] (herald/dispatch/gba.py) says a GBA checkpoint commits the offsets as
    BSP's does. ``kafka_topic`` is a fresh topic per parametrization."""
    source = data_dir / "criteo" / "criteo_kaggle_sample_train.tsv"
    total = 1530
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
            "arrow",
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
    kill_after = random.Random(7).randrange(6, steps_total - 3)
    run_dir = tmp_path / "run"

    job = subprocess.Popen(
        _train_cmd(kafka_broker, kafka_topic, run_dir, *mode), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while _logged(run_dir).size < kill_after * STEP_SAMPLES:
        assert job.poll() is None, "training ended before the kill point"
        assert time.monotonic() < deadline, "training made no progress"
        time.sleep(0.05)
    children = _children(job.pid)
    os.kill(job.pid, signal.SIGKILL)
    job.wait(10)
    first = _logged(run_dir)
    # committed offsets never pass an untrained record
    committed = _committed(kafka_broker, kafka_topic)
    assert committed.offsets, "no offsets were committed before the kill (checkpoints every 4 steps)"
    assert np.isin(_ids_before(committed, ROWS_PER_MESSAGE, total), first).all()
    # the job's children (PS shard, workers) die with it
    gone = time.monotonic() + 10
    while any(pathlib.Path(f"/proc/{c}").exists() for c in children) and time.monotonic() < gone:
        time.sleep(0.1)
    assert not [c for c in children if pathlib.Path(f"/proc/{c}").exists()], "orphan processes after kill -9"

    ckpts = run_dir / "checkpoints"
    meta = json.loads((ckpts / (ckpts / "latest").read_text().strip() / "meta.json").read_text())
    ckpt = KafkaPosition.from_dict(meta["source_position"])  # where the resumed job starts
    done = subprocess.run(
        _train_cmd(kafka_broker, kafka_topic, run_dir, *mode, "--resume"), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    consistency = report["consistency"]
    assert consistency["mode"] == ("gba" if mode else "bsp")
    # NOTE [lag]: the resumed job started behind the log end and read up to it (what is left
    # at the last full global batch: the records of the partial one, less than a batch's)
    lag = report["lag"]["records"]
    assert lag["peak"] > lag["final_total"] and lag["final_total"] <= STEP_SAMPLES // ROWS_PER_MESSAGE + 2, lag
    assert f"lag behind the stream's end: {lag['final_total']} records" in (run_dir / "report.txt").read_text()
    assert consistency.get("dropped_or_decayed", 0) == 0  # iota = 0: GBA is exactly BSP
    trained = _logged(run_dir)
    everything = _ids_before(
        KafkaPosition(kafka_topic, {0: (total // ROWS_PER_MESSAGE, total % ROWS_PER_MESSAGE)}), ROWS_PER_MESSAGE, total
    )
    trainable = everything[: steps_total * STEP_SAMPLES]  # the final partial global batch is never trained
    assert np.isin(trainable, trained).all(), "a record was never trained"
    assert not np.isin(everything[steps_total * STEP_SAMPLES :], trained).any()
    # replays are exactly the samples trained after the checkpoint the job resumed from
    replayed = first.size - np.isin(first, _ids_before(ckpt, ROWS_PER_MESSAGE, total)).sum()
    assert trained.size - np.unique(trained).size == replayed
    final = _committed(kafka_broker, kafka_topic)
    assert final.offsets[0][0] * ROWS_PER_MESSAGE + final.offsets[0][1] == steps_total * STEP_SAMPLES

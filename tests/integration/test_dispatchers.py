"""Several dispatchers feed one PS (docs/dispatch.md, "Several dispatchers";
Persia §4.1 sample ids): each `herald serve dispatcher --dispatcher-rank R` reads its own
Kafka topic and serves its own worker; the sample ids of the two are disjoint because
their top 8 bits are the dispatcher's rank (both read partition 0 from offset 0, so
without the rank their ids would collide)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.integration.test_train_roles import _free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(400)]  # ~75 s (2 shared cores)

ROWS, BATCH = 384, 32  # the dev sample has 409 rows


def _produce(bootstrap, topic, source):
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
            "64",
            "--limit",
            str(ROWS),
            "--client-option",
            "api_version=0.9",
            "--no-progress",
            str(source),
        ],
        check=True,
        timeout=120,
    )


def test_two_dispatchers_with_distinct_ranks_feed_one_ps(tmp_path, data_dir, kafka_broker, kafka_topic):
    topics = [f"{kafka_topic}-a", f"{kafka_topic}-b"]
    for topic, part in zip(topics, ("train", "dev")):
        _produce(kafka_broker, topic, data_dir / "criteo" / f"criteo_kaggle_sample_{part}.tsv")
    ps_addr = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "herald", "serve", "ps", "--shard", "0", "--num-shards", "1", "--bind", ps_addr],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        dispatchers, workers = [], []
        for rank, topic in enumerate(topics):
            url = f"kafka://{kafka_broker}/{topic}?format=arrow&group=g-{topic}&api_version=0.9&idle_timeout_ms=4000"
            address = f"tcp://127.0.0.1:{_free_port()}"
            dispatchers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "herald",
                        "serve",
                        "dispatcher",
                        "--dispatcher-rank",
                        str(rank),
                        "--source",
                        url,
                        "--workers",
                        "1",
                        "--batch-size",
                        str(BATCH),
                        "--cache-rows",
                        "2000",
                        "--embedding-dim",
                        "4",
                        "--ps",
                        ps_addr,
                        "--bind",
                        address,
                        "--timeout-ms",
                        "60000",
                        "--sample-id-log",
                        str(tmp_path / f"ids-{rank}.u64"),
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
            workers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "herald",
                        "serve",
                        "worker",
                        "--dispatcher",
                        address,
                        "--rank",
                        "0",
                        "--world-size",
                        "1",
                        "--timeout-ms",
                        "60000",
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        procs += dispatchers + workers
        outs = [p.communicate(timeout=300)[0] for p in dispatchers + workers]
        assert all(p.returncode == 0 for p in dispatchers + workers), "\n---\n".join(o[-2000:] for o in outs)
        assert "dispatcher 0: " in outs[0] and "dispatcher 1: " in outs[1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    ids = [np.fromfile(tmp_path / f"ids-{rank}.u64", np.uint64) for rank in range(2)]
    for rank, got in enumerate(ids):
        assert got.size == ROWS // BATCH * BATCH, f"dispatcher {rank} trained {got.size} samples"
        assert np.all(got >> np.uint64(56) == rank), "a sample id does not carry its dispatcher's rank"
        assert np.unique(got).size == got.size
    assert not np.intersect1d(ids[0], ids[1]).size, "the two dispatchers' sample ids collide"
    low = np.uint64((1 << 56) - 1)
    assert np.array_equal(np.sort(ids[0] & low), np.sort(ids[1] & low)), (
        "both read partition 0 from offset 0: only the rank tells their ids apart"
    )

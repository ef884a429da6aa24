"""The roles as separate processes: failures are named, the example script trains."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
from proc_tree import children

pytestmark = pytest.mark.integration

REPO = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_killed_worker_is_named_and_the_job_stops_cleanly(tmp_path, data_dir):
    source = data_dir / "movielens" / "ml-latest-small" / "ratings.csv"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "herald",
            "train",
            "--quiet",
            "--source",
            str(source),
            "--workers",
            "2",
            "--batch-size",
            "64",
            "--epochs",
            "5",
            "--run-dir",
            str(tmp_path),
            "--timeout-ms",
            "60000",
            "--log-sample-ids",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    victim = None
    while victim is None and time.monotonic() < deadline:
        victim = next((pid for pid, cmd in children(job.pid) if "--rank 1" in cmd), None)
        time.sleep(0.2)
    assert victim is not None, "worker 1 never started"
    log = tmp_path / "trained_sample_ids.u64"
    while not log.exists() or log.stat().st_size < 10 * 128 * 8:  # ten steps trained
        assert job.poll() is None and time.monotonic() < deadline, "training ended or stalled before the kill"
        time.sleep(0.05)
    others = [pid for pid, _ in children(job.pid) if pid != victim]
    os.kill(victim, 9)
    out, err = job.communicate(timeout=60)
    assert job.returncode != 0
    assert "worker-1" in err or "worker 1" in err, err[-2000:]

    def running(pid: int) -> bool:  # alive and not a zombie
        try:
            return "Z" not in pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False

    def outlived() -> list[int]:
        return [p for p in others if running(p)]

    gone = time.monotonic() + 10  # far below the job's 60 s timeout, after which a child would end by itself
    while outlived() and time.monotonic() < gone:
        time.sleep(0.05)
    assert not outlived(), "a child outlived the failed job"


@pytest.mark.slow  # ~23 s (2 shared cores)
def test_example_script_trains_against_served_ps_and_dispatcher(tmp_path, data_dir):
    """examples/train_dlrm.py (public API only) with `herald serve ps` and `herald serve dispatcher`."""
    source = data_dir / "criteo" / "criteo_kaggle_sample_dev.tsv"
    ps_port, disp_port, dist_port = _free_port(), _free_port(), _free_port()
    procs = []
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    try:
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "herald",
                    "serve",
                    "ps",
                    "--shard",
                    "0",
                    "--num-shards",
                    "1",
                    "--bind",
                    f"tcp://127.0.0.1:{ps_port}",
                    "--seed",
                    "0",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        disp = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "herald",
                "serve",
                "dispatcher",
                "--source",
                str(source),
                "--workers",
                "2",
                "--batch-size",
                "32",
                "--cache-ratio",
                "0.5",
                "--ps",
                f"tcp://127.0.0.1:{ps_port}",
                "--bind",
                f"tcp://127.0.0.1:{disp_port}",
                "--timeout-ms",
                "60000",
                "--dist-init",
                f"tcp://127.0.0.1:{dist_port}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs.append(disp)
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(REPO / "examples" / "train_dlrm.py"),
                    "--dispatcher",
                    f"tcp://127.0.0.1:{disp_port}",
                ],
                env=dict(env, RANK=str(r), WORLD_SIZE="2"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(2)
        ]
        procs += workers
        outs = [w.communicate(timeout=240)[0] for w in workers]
        assert all(w.returncode == 0 for w in workers), (outs, disp.poll() is not None and disp.communicate()[0])
        assert "step 0: loss" in outs[0]
        dout = disp.communicate(timeout=60)[0]
        assert disp.returncode == 0, dout
        assert "steps acked by all 2 workers" in dout
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)

"""A worker that stops answering during `herald train` is the one the error names first
(NOTE [silent workers] in herald/job/recovery/silence.py), not the healthy worker that timed out
waiting on it. Real `herald train` jobs: 2 workers, MovieLens ratings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from proc_tree import descendants, parent_of, stopped, train_until_mid_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.slow  # ~30 s (2 shared cores)
def test_a_stopped_worker_is_named_in_the_headline(tmp_path, data_dir):
    job, worker = train_until_mid_job(tmp_path, data_dir, "serve worker", "--rank 0")
    with stopped(worker):
        _, err = job.communicate(timeout=120)
    assert job.returncode != 0, err[-3000:]
    headline = next(line for line in err.splitlines() if line.startswith("herald: error: "))
    assert headline.startswith(f"herald: error: worker-0 (pid {worker}, stopped"), err[-3000:]
    assert "went silent" in headline and str(tmp_path / "worker-0.log") in headline
    assert "worker-1" not in headline  # the worker that timed out waiting comes after, as "(then: ...)"


@pytest.mark.slow  # ~60 s (2 shared cores): the job starts and stops a local Ray instance
def test_a_killed_ray_actor_leaves_no_private_folder(tmp_path, data_dir, ray):
    """--launcher ray on one node: kill -9 of worker 1's Ray actor (its role's child dies with
    it, the actor's own cleanup never runs); the launcher removes the private folder the actor
    made for the role (NOTE [run leftovers]), as it does every other role's."""
    run = tmp_path / "run"
    source = data_dir / "movielens" / "ml-latest-small" / "ratings.csv"
    args = ["--quiet", "--source", str(source), "--workers", "2", "--batch-size", "64", "--epochs", "20"]
    args += ["--run-dir", str(run), "--timeout-ms", "60000", "--log-sample-ids", "--launcher", "ray"]
    job = subprocess.Popen(
        [sys.executable, "-m", "herald", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        ids, deadline = run / "trained_sample_ids.u64", time.monotonic() + 180
        while not (ids.exists() and ids.stat().st_size >= 5 * 128 * 8):  # five steps trained
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=30)[1][-3000:]
            time.sleep(0.05)
        [owner] = run.glob(".owner-*.json")  # the launcher's record of what it made (NOTE [run leftovers])
        folders = [p for p in json.loads(owner.read_text())["paths"] if "herald-worker-" in p]
        assert len(folders) == 2 and all(os.path.isdir(f) for f in folders), folders
        procs = dict(descendants(job.pid))
        worker = next(pid for pid, cmd in procs.items() if "serve worker" in cmd and "--rank 1 " in cmd + " ")
        actor = parent_of(worker)
        os.kill(actor, signal.SIGKILL)
        _, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
    assert job.returncode != 0, err[-3000:]
    assert "worker-1" in err, err[-3000:]
    assert [f for f in folders if os.path.exists(f)] == [], f"private folders outlived the job:\n{err[-3000:]}"

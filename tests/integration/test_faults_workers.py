"""A worker that stops answering during `herald train` is the one the error names first
(NOTE [silent workers] in herald/job/silence.py), not the healthy worker that timed out
waiting on it. Real `herald train` jobs: 2 workers, MovieLens ratings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from proc_tree import children

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TIMEOUT_MS = 10_000


@pytest.mark.slow   # ~30 s (2 shared cores)
def test_a_stopped_worker_is_named_in_the_headline(tmp_path, data_dir):
    source = data_dir / "movielens" / "ml-latest-small" / "ratings.csv"
    job = subprocess.Popen([sys.executable, "-m", "herald", "train", "--quiet", "--source", str(source),
                            "--workers", "2", "--batch-size", "64", "--epochs", "20", "--run-dir", str(tmp_path),
                            "--timeout-ms", str(TIMEOUT_MS), "--log-sample-ids"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    worker = None
    log = tmp_path / "trained_sample_ids.u64"
    while worker is None or not log.exists() or log.stat().st_size < 10 * 128 * 8:   # ten steps trained
        assert job.poll() is None and time.monotonic() < deadline, \
            f"training ended or stalled before the fault: {job.communicate(timeout=30)[1][-3000:]}"
        worker = worker or next((pid for pid, cmd in children(job.pid)
                                 if "serve worker" in cmd and "--rank 0" in cmd), None)
        time.sleep(0.05)
    os.kill(worker, signal.SIGSTOP)
    try:
        _, err = job.communicate(timeout=120)
    finally:
        try:
            os.kill(worker, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert job.returncode != 0, err[-3000:]
    headline = next(line for line in err.splitlines() if line.startswith("herald: error: "))
    assert headline.startswith(f"herald: error: worker-0 (pid {worker}, stopped"), err[-3000:]
    assert "went silent" in headline and str(tmp_path / "worker-0.log") in headline
    assert "worker-1" not in headline   # the worker that timed out waiting comes after, as "(then: ...)"

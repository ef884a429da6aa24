"""A PS shard that dies or goes silent during `herald train` is named, fast.

NOTE [ps liveness] (herald/ps/watch.py): the launcher's liveness check covers the PS
shard processes (a dead one is named at the next check, ~0.5 s) and pings them (a
silent one is named after half the job's --timeout-ms); the shard logs live in the
run folder (ps-shard-I.log). Real `herald train` jobs: 2 workers, MovieLens ratings.
"""

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


def _train_until_mid_job(tmp_path, data_dir) -> tuple[subprocess.Popen, int]:
    """Start a 2-worker job; return it and its PS shard's pid once 10 steps are trained."""
    source = data_dir / "movielens" / "ml-latest-small" / "ratings.csv"
    job = subprocess.Popen([sys.executable, "-m", "herald", "train", "--quiet", "--source", str(source),
                            "--workers", "2", "--batch-size", "64", "--epochs", "20", "--run-dir", str(tmp_path),
                            "--timeout-ms", str(TIMEOUT_MS), "--log-sample-ids"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    shard = None
    log = tmp_path / "trained_sample_ids.u64"
    while shard is None or not log.exists() or log.stat().st_size < 10 * 128 * 8:   # ten steps trained
        assert job.poll() is None and time.monotonic() < deadline, \
            f"training ended or stalled before the fault: {job.communicate(timeout=30)[1][-3000:]}"
        shard = shard or next((pid for pid, cmd in children(job.pid) if "serve ps" in cmd and "--shard 0" in cmd), None)
        time.sleep(0.05)
    return job, shard


@pytest.mark.slow   # ~20 s (2 shared cores)
def test_a_killed_ps_shard_is_named_within_seconds(tmp_path, data_dir):
    job, shard = _train_until_mid_job(tmp_path, data_dir)
    t0 = time.monotonic()
    os.kill(shard, signal.SIGKILL)
    out, err = job.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert job.returncode != 0, err[-3000:]
    log = tmp_path / "ps-shard-0.log"
    assert "PS shard 0" in err and "killed by signal 9" in err and str(log) in err, err[-3000:]
    assert "serving on" in err   # the log's tail is quoted
    assert log.exists(), "the shard log must survive the job (it lives in the run folder)"
    # named by the liveness check, not by a worker's PS timeout: no timeout was reported first, and
    # the job failed before any TIMEOUT_MS ran out (a generous bound: a loaded machine adds seconds)
    assert "did not answer" not in err.split("PS shard 0")[0], "a worker's PS timeout was reported first"
    assert elapsed < TIMEOUT_MS / 1000, f"the job took {elapsed:.1f} s to fail after the kill:\n{err[-3000:]}"


def test_a_silent_ps_shard_is_named_within_the_timeout(tmp_path, data_dir):
    job, shard = _train_until_mid_job(tmp_path, data_dir)
    t0 = time.monotonic()
    os.kill(shard, signal.SIGSTOP)
    try:
        out, err = job.communicate(timeout=120)
    finally:
        try:
            os.kill(shard, signal.SIGCONT)
        except ProcessLookupError:
            pass
    elapsed = time.monotonic() - t0
    assert job.returncode != 0, err[-3000:]
    assert "PS shard 0" in err and "silent" in err and str(tmp_path / "ps-shard-0.log") in err, err[-3000:]
    assert "did not answer" not in err.split("PS shard 0")[0], "a worker's PS timeout was reported first"
    # generous: the shard is named after half the timeout, a loaded machine adds seconds to the teardown
    assert elapsed < 3 * TIMEOUT_MS / 1000, f"the job took {elapsed:.1f} s to fail after SIGSTOP:\n{err[-3000:]}"

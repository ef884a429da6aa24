"""A PS shard that dies or goes silent during `herald train` is named, fast.

NOTE [ps liveness] (herald/ps/watch.py): the launcher's liveness check covers the PS
shard processes (a dead one is named at the next check, ~0.5 s) and pings them (a
silent one is named after half the job's --timeout-ms); the shard logs live in the
run folder (ps-shard-I.log). Real `herald train` jobs: 2 workers, MovieLens ratings.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from proc_tree import FAULT_TIMEOUT_MS, stopped, train_until_mid_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TIMEOUT_MS = FAULT_TIMEOUT_MS


@pytest.mark.slow  # ~20 s (2 shared cores)
def test_a_killed_ps_shard_is_named_within_seconds(tmp_path, data_dir):
    job, shard = train_until_mid_job(tmp_path, data_dir, "serve ps", "--shard 0")
    t0 = time.monotonic()
    os.kill(shard, signal.SIGKILL)
    out, err = job.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert job.returncode != 0, err[-3000:]
    log = tmp_path / "ps-shard-0.log"
    assert "PS shard 0" in err and "killed by signal 9" in err and str(log) in err, err[-3000:]
    assert "serving on" in err  # the log's tail is quoted
    assert log.exists(), "the shard log must survive the job (it lives in the run folder)"
    # named by the liveness check, not by a worker's PS timeout: no timeout was reported first, and
    # the job failed before any TIMEOUT_MS ran out (a generous bound: a loaded machine adds seconds)
    assert "did not answer" not in err.split("PS shard 0")[0], "a worker's PS timeout was reported first"
    assert elapsed < TIMEOUT_MS / 1000, f"the job took {elapsed:.1f} s to fail after the kill:\n{err[-3000:]}"


def test_a_silent_ps_shard_is_named_within_the_timeout(tmp_path, data_dir):
    job, shard = train_until_mid_job(tmp_path, data_dir, "serve ps", "--shard 0")
    t0 = time.monotonic()
    with stopped(shard):
        out, err = job.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert job.returncode != 0, err[-3000:]
    assert "PS shard 0" in err and "silent" in err and str(tmp_path / "ps-shard-0.log") in err, err[-3000:]
    assert "did not answer" not in err.split("PS shard 0")[0], "a worker's PS timeout was reported first"
    # generous: the shard is named after half the timeout, a loaded machine adds seconds to the teardown
    assert elapsed < 3 * TIMEOUT_MS / 1000, f"the job took {elapsed:.1f} s to fail after SIGSTOP:\n{err[-3000:]}"

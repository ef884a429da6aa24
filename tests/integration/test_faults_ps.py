"""A PS shard that dies or goes silent during `herald train` is named, fast.

NOTE [ps liveness] (herald/ps/watch.py): the launcher's liveness check covers the PS
shard processes (a dead one is named at the next check, ~0.5 s) and pings them (a
silent one is named after half the job's --timeout-ms); the shard logs live in the
run folder (ps-shard-I.log). NOTE [death notices] (herald/deaths.py): every wait on a
shard, in any process of the job, ends once the shard's supervisor saw it die, at any
phase of a step or a checkpoint. Real `herald train` jobs: 2 workers, MovieLens ratings.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
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


# ---------------------------------------------------------------- a kill at each phase
# NOTE [death notices] (herald/deaths.py): whatever the job waits on when the shard dies (a
# worker's pull, step message or dense sum, the barrier's flush, the dispatcher's checkpoint),
# the wait ends as soon as the shard's supervisor reaps it, naming it with its signal and log.
KILLPOINT = pathlib.Path(__file__).resolve().parent / "killpoint"  # its sitecustomize: the kill
LONG_TIMEOUT_MS = 60_000  # a wait that fell back to its --timeout-ms would fail the hang guard below
HANG_GUARD_S = 10.0  # measured: under 1.3 s from the death to the job's end on 2 shared cores
#: phase -> HERALD_TEST_KILL_AT of shard 0 (tests/integration/killpoint/sitecustomize.py); with
#: --checkpoint-every 5 and 2 workers a shard sees, after each checkpoint: 2 pulls, 10 step
#: messages, the flush's 2 push_rows, the checkpoint
PHASES = {
    "pull": "0:pull:3",  # a worker's first pull after the first checkpoint
    "step message": "0:step:13",  # the first message of step 6: the other rank's is still to come
    "dense": "0:step:14",  # the last message of step 6: the shard then sums the ranks' dense slices
    "flush": "0:push_rows:1",  # the first barrier's write-backs
    "checkpoint staging": "0:checkpoint:1",  # the shard writing its part of step 4's checkpoint
    "checkpoint commit": "0:after-checkpoint:1",  # dead while the dispatcher commits step 4's
}


def _train_killed(tmp_path, data_dir, kill_at: str, *extra: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """A 2-worker ``herald train`` (30 steps, a checkpoint every 5) whose shard 0 kills itself
    at ``kill_at``; the finished job, when the shard died and when the job ended (Unix s)."""
    note = tmp_path / "died.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(KILLPOINT), os.environ.get("PYTHONPATH")])),
        "HERALD_TEST_KILL_AT": kill_at,
        "HERALD_TEST_KILL_NOTE": str(note),
    }
    source = data_dir / "movielens" / "ml-latest-small" / "ratings.csv"
    args = ["--quiet", "--source", str(source), "--workers", "2", "--batch-size", "64", "--steps", "30"]
    args += ["--checkpoint-every", "5", "--run-dir", str(tmp_path / "run"), "--timeout-ms", str(LONG_TIMEOUT_MS)]
    job = subprocess.run(
        [sys.executable, "-m", "herald", "train", *args, *extra], env=env, capture_output=True, text=True, timeout=240
    )
    ended = time.time()
    assert note.exists(), f"shard 0 never reached its kill point {kill_at}:\n{job.stderr[-3000:]}"
    return job, json.loads(note.read_text())["unix_s"], ended


@pytest.mark.slow  # ~15 s a case (2 shared cores)
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_shard_killed_at_any_phase_is_named_at_once(tmp_path, data_dir, phase):
    job, died, ended = _train_killed(tmp_path, data_dir, PHASES[phase])
    err = job.stderr
    assert job.returncode != 0, err[-3000:]
    log = tmp_path / "run" / "ps-shard-0.log"
    assert "PS shard 0" in err and "was killed by signal 9 (SIGKILL)" in err and str(log) in err, err[-3000:]
    assert "serving on" in err  # the log's tail is quoted
    assert "did not answer" not in err, f"a wait ran out its timeout instead of seeing the death:\n{err[-3000:]}"
    assert ended - died < HANG_GUARD_S, f"the job took {ended - died:.1f} s to fail after the death:\n{err[-3000:]}"
    if phase == "checkpoint staging":  # what the next start or resume of the run folder removes
        assert (tmp_path / "run" / "checkpoints" / ".tmp-step-00000004").is_dir()


@pytest.mark.slow  # ~45 s (2 shared cores)
def test_a_shard_killed_while_staging_a_checkpoint_rolls_back_at_once(tmp_path, data_dir):
    """--ps-restarts 1, the shard killed while it writes step 9's checkpoint: the rollback to
    step 4's starts as soon as the shard died, the resumed attempt removes the staging folder,
    and the report's recovered_s counts from the death to the next attempt's first step."""
    job, died, _ = _train_killed(tmp_path, data_dir, "0:checkpoint:2", "--ps-restarts", "1")
    err = job.stderr
    assert job.returncode == 0, err[-3000:]
    assert "rolling the job back to checkpoint step-00000004" in err, err[-3000:]
    assert "did not answer" not in err, err[-3000:]
    staging = tmp_path / "run" / "checkpoints" / ".tmp-step-00000009"
    assert f"removed the unfinished checkpoint(s) a killed run left: {staging}" in err, err[-3000:]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-step-*"))
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    [failover] = report["failovers"]
    assert failover["part"] == "ps" and failover["cause"].startswith("PS shard 0"), failover
    # detected when the supervisor reaped the shard (its notice's time), after the kill note was written
    assert died <= failover["detected_unix_s"] < died + HANG_GUARD_S, (died, failover)
    assert failover["stopped_s"] < HANG_GUARD_S, failover
    assert failover["recovered_s"] == pytest.approx(failover["resumed_unix_s"] - failover["detected_unix_s"], abs=2e-3)

"""NOTE [silent workers] (herald/job/recovery/silence.py): which worker a failed job's headline
names. The dispatcher's side (what it saw) is tested with scripted peers in
tests/dispatch/test_dispatcher_peers.py; here the rule, on hand-made views."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from herald.dispatch.peers import Silence
from herald.errors import HeraldError
from herald.job.recovery.failure import raise_job_failure
from herald.job.recovery.rollback import ShardFailed, WorkerFailed
from herald.job.recovery.silence import killed_ranks, merge_silences, process_state, silent_culprits, silent_headline


def _silence(quiet, awaited, reported=(), waiting_for="ack of step 11 from workers [0, 1]"):
    return Silence(dict(quiet), frozenset(awaited), frozenset(reported), waiting_for, 10.0)


class _Shards:
    def __init__(self, failure=None):
        self._failure = failure

    def failure(self):
        return self._failure


class _Workers:
    def __init__(self, codes, failure=None):
        self.codes, self._failure, self.stopped = codes, failure, False

    def failure(self, grace_s=0.0):
        return self._failure

    def exit_codes(self):
        return self.codes

    def describe(self, rank):
        return f"pid {100 + rank}; log worker-{rank}.log"

    def stop(self):
        self.stopped = True


def test_the_silent_worker_is_named_when_the_one_waiting_on_it_failed():
    # rank 1 exited with an error after 20 s of silence (it timed out waiting); rank 0 runs, silent
    silence = _silence({0: 21.0, 1: 20.0}, awaited={0, 1})
    assert silent_culprits(silence, {0: None, 1: 1}) == [0]
    # rank 1 reported its timeout instead (still exiting): the same
    assert silent_culprits(_silence({0: 21.0, 1: 20.0}, {0, 1}, reported={1}), {0: None, 1: None}) == [0]
    # the one that noticed acked the step waited for and is stuck in the next: not awaited, still a witness
    assert silent_culprits(_silence({0: 21.0, 1: 20.0}, awaited={0}), {0: None, 1: 1}) == [0]


def test_no_one_is_named_without_a_witness_or_with_a_dead_worker():
    silence = _silence({0: 21.0, 1: 20.0}, awaited={0, 1})
    assert silent_culprits(silence, {0: None, 1: None}) == []  # nobody failed after waiting
    assert silent_culprits(silence, {0: -9, 1: 1}) == []  # rank 0 was killed: that is the cause
    assert silent_culprits(_silence({0: 21.0}, {0, 1}), {0: None, 1: 1}) == []  # rank 1 failed mid-step
    assert silent_culprits(silence, None) == []  # workers not started here
    assert silent_culprits(None, {0: None, 1: 1}) == []


def test_the_headline_names_the_silent_worker_then_what_followed():
    silence = _silence({0: 20.4, 1: 20.0}, awaited={0, 1})
    workers = _Workers({0: None, 1: 1}, failure="worker-1 exited with code 1; last lines of worker-1.log:\n...")
    exc = HeraldError("dispatcher x: no message within 20000 ms while waiting for ack of step 11 from workers [0, 1]")
    with pytest.raises(HeraldError) as failed:
        raise_job_failure(exc, _Shards(), workers, silence)
    lines = str(failed.value).splitlines()
    assert lines[0].startswith(
        "worker-0 (pid 100; log worker-0.log) went silent: it sent the dispatcher nothing "
        "for 20.4 s while the job waited for ack of step 11 from workers [0, 1]"
    ), lines[0]
    assert lines[1].startswith("(then: worker-1 exited with code 1") and "(then: dispatcher x" in lines[-1]
    assert workers.stopped
    # a lost PS shard keeps its precedence
    with pytest.raises(ShardFailed, match="^PS shard 0 was killed"):
        raise_job_failure(exc, _Shards("PS shard 0 was killed by signal 9"), _Workers({0: None, 1: 1}), silence)
    # without a witness the job's error stands as it was
    with pytest.raises(HeraldError, match="^dispatcher x"):
        raise_job_failure(exc, _Shards(), _Workers({0: None, 1: None}), silence)


def test_a_silent_worker_is_lost_not_failed():
    """NOTE [worker failover] (herald/job/recovery/rollback.py): the silent worker's error is a WorkerFailed."""
    silence = _silence({0: 20.4, 1: 20.0}, awaited={0, 1})
    exc = HeraldError("dispatcher x: no message within 20000 ms while waiting for ack of step 11 from workers [0, 1]")
    with pytest.raises(WorkerFailed) as lost:
        raise_job_failure(exc, _Shards(), _Workers({0: None, 1: 1}), silence)
    assert lost.value.ranks == (0,) and lost.value.cause == "worker-0 went silent"
    assert str(lost.value).startswith("worker-0 (pid 100; log worker-0.log) went silent")


def test_a_killed_worker_is_lost_and_a_worker_error_ends_the_job():
    """A worker a signal ended is lost (WorkerFailed, put before the echo the other worker
    reported); a worker that reported an error of its own (exit code 1) ends the job."""
    assert killed_ranks({0: 1, 1: -9, 2: None, 3: -11}) == [1, 3] and killed_ranks(None) == []
    dead = "worker-1 was killed by signal 9; last lines of worker-1.log:\n(tail)"
    echo = HeraldError("worker 0 failed: RuntimeError: [gloo] Connection closed by peer")
    workers = _Workers({0: None, 1: -9}, failure=dead)
    before = time.time()
    with pytest.raises(WorkerFailed) as lost:
        raise_job_failure(echo, _Shards(), workers)
    assert before <= lost.value.seen_unix_s <= time.time()  # when the job saw it: the report's recovery counts from it
    assert lost.value.ranks == (1,) and lost.value.cause == "worker-1 was killed by signal 9 (SIGKILL)"
    assert str(lost.value) == f"{dead}\n(then: {echo})" and workers.stopped
    # the liveness check's own error names the dead worker already: the message as it was
    with pytest.raises(WorkerFailed, match="^worker-1 was killed by signal 9; last lines") as lost:
        raise_job_failure(HeraldError(dead), _Shards(), _Workers({0: None, 1: -9}, failure=dead))
    assert str(lost.value) == dead
    # a worker's own error (it reported it, then exited with code 1): not lost, the job ends
    own = HeraldError("worker 1 failed: ConfigError: --model dcn needs ...")
    for codes in ({0: None, 1: 1}, {0: None, 1: None}):
        with pytest.raises(HeraldError) as failed:
            raise_job_failure(own, _Shards(), _Workers(codes, failure="worker-1 exited with code 1; ..."))
        assert not isinstance(failed.value, WorkerFailed)
    # a diverged loss and a lost PS shard keep their precedence over a killed worker
    diverged = HeraldError("worker 0 failed: TrainingDiverged: rank 0: the loss is nan at step 3: ...")
    with pytest.raises(HeraldError, match="^rank 0: the loss is nan") as failed:
        raise_job_failure(diverged, _Shards(), _Workers({0: None, 1: -9}, failure=dead))
    assert not isinstance(failed.value, WorkerFailed)
    with pytest.raises(ShardFailed):
        raise_job_failure(echo, _Shards("PS shard 0 was killed by signal 9"), _Workers({0: None, 1: -9}, failure=dead))
    # workers this job did not start (no exit codes): never lost
    with pytest.raises(HeraldError) as failed:
        raise_job_failure(echo, _Shards(), _Workers(None))
    assert not isinstance(failed.value, WorkerFailed)


def test_several_silent_workers_and_groups():
    silence = _silence({0: 30.0, 2: 25.0, 1: 20.0}, awaited={0, 1, 2}, reported={1})
    assert silent_culprits(silence, {0: None, 1: None, 2: None}) == [0, 2]
    head = silent_headline([0, 2], silence, lambda r: f"pid {r}")
    assert head.startswith(
        "worker-0 (pid 0), worker-2 (pid 2) went silent: they sent the dispatcher nothing for 30.0 s"
    )
    # one dispatcher per group: group 1's rank 0 is worker 2
    merged = merge_silences([None, _silence({0: 12.0}, {0}, reported={1}, waiting_for="w")], [0, 2])
    assert merged.quiet == {2: 12.0} and merged.awaited == {2} and merged.reported == {3} and merged.silent == {2: 12.0}
    assert merge_silences([None, None], [0, 2]) is None


def test_process_state_tells_a_stopped_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_state(child.pid) in ("sleeping", "running")
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(child.pid) != "stopped (SIGSTOP or a debugger)" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(child.pid) == "stopped (SIGSTOP or a debugger)"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) == "state unknown"  # reaped: gone

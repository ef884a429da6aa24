"""The loop of attempts of a job that loses a process (herald/job/recovery/rollback.py, NOTE [worker
failover], NOTE [ps failover]) with a fake attempt: each cause's budget, the job ending
naming the lost rank once its budget is spent, the report's failovers, and no rollback to
a checkpoint another job left in the run folder. The real thing (a worker killed -9, the
final model equal to an uninterrupted run's): tests/integration/test_resume.py."""

from __future__ import annotations

import json
import os
import time
import types

import pytest

from herald.contracts.train import TrainConfig
from herald.errors import HeraldError
from herald.job.recovery.rollback import Rollbacks, ShardFailed, WorkerFailed, run_attempts

EVERY = 4


def _cfg(tmp_path, **kw) -> TrainConfig:
    return TrainConfig.from_flags(run_dir=str(tmp_path), checkpoint_every=EVERY, **kw)


def _checkpoint(tmp_path, step: int) -> None:
    """A checkpoint of ``step`` named by ``latest`` (only what :func:`checkpoints.latest` reads),
    written afresh as a job writes one (a new meta.json replaces the old)."""
    folder = tmp_path / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json.tmp").write_text(json.dumps({"step": step}))
    os.replace(folder / "meta.json.tmp", folder / "meta.json")
    (tmp_path / "checkpoints" / "latest").write_text(folder.name)


def _acks(rollbacks: Rollbacks, steps) -> None:
    for step in steps:
        rollbacks.on_step(types.SimpleNamespace(step=step))  # a StepRecord's step is all it reads


def _killed(rank: int, seen_unix_s: float | None = None) -> WorkerFailed:
    return WorkerFailed(
        f"worker-{rank} was killed by signal 9; last lines of worker-{rank}.log:\n(tail)",
        ranks=[rank],
        cause=f"worker-{rank} was killed by signal 9 (SIGKILL)",
        seen_unix_s=seen_unix_s,
    )


def test_a_lost_worker_rolls_back_then_the_job_goes_on(tmp_path):
    seen, lost_at = [], time.time() - 2.0  # the loss seen 2 s before the rollback (the attempt stopping)

    def attempt(cfg, rollbacks):
        seen.append(cfg.resume)
        if len(seen) == 1:
            _acks(rollbacks, range(0, 6))  # steps 0..5 acked, checkpoint of step 3, worker 1 lost in step 6
            _checkpoint(tmp_path, 3)
            raise _killed(1, seen_unix_s=lost_at)
        _acks(rollbacks, range(4, 10))
        return {"failovers": rollbacks.failovers, "earlier": rollbacks.earlier}

    rep = run_attempts(_cfg(tmp_path, worker_restarts=1), attempt)
    assert seen == [False, True]  # the second attempt resumes from the checkpoint
    (failover,) = rep["failovers"]
    assert failover["detected_unix_s"] == round(lost_at, 3)
    assert 2.0 <= failover["stopped_s"] <= failover["recovered_s"]  # both counted from the loss seen
    # recovered: from the loss seen to the first step the next attempt acked (NOTE [failover policy])
    assert failover["recovered_s"] == pytest.approx(failover["resumed_unix_s"] - failover["detected_unix_s"], abs=2e-3)
    timed = ("detected_unix_s", "stopped_s", "resumed_unix_s", "recovered_s")
    assert {k: v for k, v in failover.items() if k not in timed} == {
        "part": "worker",
        "ranks": [1],
        "cause": "worker-1 was killed by signal 9 (SIGKILL)",
        "lost_at_step": 6,
        "last_acked_step": 5,
        "rolled_back_to": "step-00000003",
        "checkpoint_step": 3,
        "steps_rolled_back": 2,
    }
    assert [a.steps for a in rep["earlier"]] == [tuple(range(6))]


def test_a_worker_lost_again_after_its_budget_ends_the_job_naming_the_rank(tmp_path):
    calls = []

    def attempt(cfg, rollbacks):
        calls.append(cfg)
        _checkpoint(tmp_path, 3)
        raise _killed(1)

    with pytest.raises(HeraldError) as ended:
        run_attempts(_cfg(tmp_path, worker_restarts=2), attempt)
    assert len(calls) == 3 and not isinstance(ended.value, WorkerFailed)
    lines = str(ended.value).splitlines()
    assert lines[0].startswith("worker-1 was killed by signal 9") and lines[1] == "(tail)"  # its log's tail
    assert lines[-1] == (
        "(worker-1 lost again after 2 rollback(s) for a lost worker, --worker-restarts 2: the job "
        "ends here; the log above says why)"
    )


def test_each_cause_has_its_own_budget(tmp_path):
    causes = [ShardFailed("PS shard 0 at ipc://x (pid 7) was killed by signal 9; its log ..."), _killed(0)]

    def attempt(cfg, rollbacks):
        _checkpoint(tmp_path, 3)
        if causes:
            raise causes.pop(0)
        return rollbacks.failovers

    failovers = run_attempts(_cfg(tmp_path, ps_restarts=1, worker_restarts=1), attempt)
    assert [(f["part"], f["ranks"]) for f in failovers] == [("ps", None), ("worker", [0])]
    assert failovers[0]["cause"] == "PS shard 0 at ipc://x (pid 7) was killed by signal 9; its log ..."
    # no budget for workers: the error as it was, whatever the PS budget
    with pytest.raises(HeraldError) as ended:
        run_attempts(_cfg(tmp_path, ps_restarts=3), lambda cfg, rb: (_ for _ in ()).throw(_killed(1)))
    assert str(ended.value) == str(_killed(1))


def test_no_rollback_before_this_jobs_first_checkpoint(tmp_path):
    _checkpoint(tmp_path, 11)  # another job's, left in the run folder

    def attempt(cfg, rollbacks):
        raise _killed(1)

    with pytest.raises(
        HeraldError,
        match=r"no checkpoint of this job to roll back to yet \(--worker-restarts 1\): "
        r"the first is written after step 3\)$",
    ):
        run_attempts(_cfg(tmp_path, worker_restarts=1), attempt)
    # resumed from it, the job rolls back to it
    tried = []

    def resumed(cfg, rollbacks):
        tried.append(cfg)
        if len(tried) == 1:
            raise _killed(1)
        return rollbacks.failovers

    (failover,) = run_attempts(_cfg(tmp_path, worker_restarts=1, resume=True), resumed)
    assert failover["rolled_back_to"] == "step-00000011" and failover["lost_at_step"] == 12
    assert failover["last_acked_step"] is None and failover["recovered_s"] is None

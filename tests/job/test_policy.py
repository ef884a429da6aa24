"""The failover policy (NOTE [failover policy] in herald/job/recovery/policy.py) on its own, as
the test bed's supervisor and ``herald serve dispatcher`` use it: each refusal's reason, the
record with the death noticed and training resumed, the latest checkpoint whoever wrote it.
``herald train``'s wording of it: tests/job/test_rollback.py."""

from __future__ import annotations

import json
import os
import time

import pytest

from herald.errors import DataError
from herald.job.recovery.policy import Budget, FailoverPolicy, RollbackRefused
from herald.job.report.inputs import Attempt


def _checkpoint(run_dir, step: int) -> None:
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json.tmp").write_text(json.dumps({"step": step}))
    os.replace(folder / "meta.json.tmp", folder / "meta.json")
    (run_dir / "checkpoints" / "latest").write_text(folder.name)


def _policy(run_dir, allowed: int = 1, resumed: bool = False) -> FailoverPolicy:
    return FailoverPolicy(run_dir, {"ps": Budget(allowed, "--ps-restarts")}, resumed=resumed)


def _reason(policy: FailoverPolicy) -> str:
    with pytest.raises(RollbackRefused) as refused:
        policy.check("ps")
    return refused.value.reason


def test_each_refusal_has_its_reason(tmp_path):
    assert _reason(_policy(tmp_path, allowed=0)) == "no budget"
    policy = _policy(tmp_path)
    assert _reason(policy) == "no checkpoint"
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-00000007")  # names a folder that is not there
    assert _reason(policy) == "unreadable"
    _checkpoint(tmp_path, 7)
    policy.record_rollback("ps", "PS shard 0 lost", time.time())
    with pytest.raises(RollbackRefused) as spent:
        policy.check("ps")
    assert spent.value.reason == "spent" and spent.value.used == 1 and spent.value.budget.flag == "--ps-restarts"


def test_the_checkpoint_another_job_left_is_not_this_jobs_unless_it_resumed_from_it(tmp_path):
    _checkpoint(tmp_path, 5)
    assert _policy(tmp_path).latest() is None and _reason(_policy(tmp_path)) == "no checkpoint"
    assert _policy(tmp_path, resumed=True).latest().step == 5
    policy = _policy(tmp_path)
    _checkpoint(tmp_path, 5)  # written again under the same name: this job's
    assert policy.latest().step == 5
    assert FailoverPolicy.latest_in(tmp_path).step == 5  # serve dispatcher: whoever wrote it


def test_a_rollback_records_the_death_noticed_and_training_going_on(tmp_path):
    policy = _policy(tmp_path, allowed=2)
    for step in range(6):
        policy.acked(step)
    _checkpoint(tmp_path, 3)
    seen = time.time() - 1.0
    record = policy.record_rollback("ps", "PS shard 0 lost", seen, restart_s=None)
    assert record == {
        "part": "ps",
        "cause": "PS shard 0 lost",
        "detected_unix_s": round(seen, 3),
        "lost_at_step": 6,
        "last_acked_step": 5,
        "rolled_back_to": "step-00000003",
        "checkpoint_step": 3,
        "steps_rolled_back": 2,
        "restart_s": None,
        "resumed_unix_s": None,
        "recovered_s": None,
    }
    assert policy.failovers == [record] and [a.steps for a in policy.earlier] == [tuple(range(6))]
    assert isinstance(policy.earlier[0], Attempt)
    policy.begin()
    policy.acked(3)  # the checkpoint's own step (a stale step file): not training again yet
    assert record["recovered_s"] is None
    policy.acked(4)
    assert record["resumed_unix_s"] >= record["detected_unix_s"] + 1.0
    assert record["recovered_s"] == pytest.approx(record["resumed_unix_s"] - record["detected_unix_s"], abs=2e-3)
    # the test bed names the last acked step itself (its dispatcher's step file), None: none
    second = policy.record_rollback("ps", "again", time.time(), last_acked=None)
    assert second["lost_at_step"] == 4 and second["last_acked_step"] is None and second["steps_rolled_back"] is None


def test_an_unreadable_latest_says_why(tmp_path):
    policy = _policy(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-00000002")
    with pytest.raises(RollbackRefused) as refused:
        policy.check("ps")
    assert "step-00000002" in refused.value.detail and "unreadable" in refused.value.detail
    with pytest.raises(DataError):
        FailoverPolicy.latest_in(tmp_path)

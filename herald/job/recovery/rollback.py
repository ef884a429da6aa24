"""``herald train`` rolling a job back to its latest checkpoint when one of its processes is
lost: the failures that ask for it (:class:`PartLost`: :class:`ShardFailed`,
:class:`WorkerFailed`), the loop of attempts (:func:`run_attempts`) and its use of the failover
policy (:class:`Rollbacks`: each cause's budget, ``--ps-restarts``, ``--worker-restarts``, and
the report's ``failovers``: NOTE [failover policy] in herald/job/recovery/policy.py; NOTE [ps
failover] in herald/job/launcher.py says why the whole job goes back; NOTE [worker failover]
below).

NOTE [worker failover]
~~~~~~~~~~~~~~~~~~~~~~
A worker process that dies (killed by a signal: ``kill -9``, the OOM killer, a crash in
native code: SIGSEGV, SIGABRT) or goes silent (stopped, hung: NOTE [silent workers] in
herald/job/recovery/silence.py) takes the job's dense replica, its cache and its place in the
all-reduce with it; the other workers' state is then ahead of anything a replacement
could join. So a lost worker is handled as a lost PS shard is (NOTE [ps failover]):
with ``--worker-restarts N`` (and ``--checkpoint-every``) every process of the attempt
is stopped and the job goes on from its latest checkpoint as ``--resume`` does, at most
N times; the final model is the uninterrupted run's. Each cause has its own budget: a
job with ``--ps-restarts 1 --worker-restarts 2`` survives one lost shard and two lost
workers. A loss before the job's first checkpoint ends it: the checkpoint another job
left in the run folder (the latest at the start, unless this job resumed from it) is
not this job's state (:meth:`~herald.job.recovery.policy.FailoverPolicy.latest`).

Lost, not failed. :func:`herald.job.recovery.failure.raise_job_failure` (``herald train``'s local
workers, whose exit codes it knows) raises :class:`WorkerFailed` only for a worker that
a signal this job did not send ended (negative exit code: :func:`~herald.job.recovery.silence.killed_ranks`)
or that the silence rule names (alive, reported nothing). A worker that reported an
error itself (an exception in its training loop, sent to the dispatcher as ``error``,
then exit code 1: a diverged loss, a bad setting, a model the data cannot feed, a
checkpoint it could not write) ends the job as before: it raised, so a restart from
the same checkpoint would raise the same way. A killed worker takes precedence over the
errors the other workers report next (gloo's "connection closed" is the echo of its
death); a diverged loss and a lost PS shard keep theirs. Workers this job did not start
(``herald serve dispatcher``, the test bed's torchruns) are never rolled back for.

``--consistency gba`` rolls back the same way: every process is restarted, so a
surviving shard's gradient buffer is a new one at the checkpoint's next global step,
as after a lost shard (NOTE [gba checkpoints] in herald/dispatch/gba.py). Going on with
the remaining workers instead (GBA's elastic training) is not built.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from herald.contracts.train import TrainConfig
from herald.errors import HeraldError
from herald.job.recovery.policy import Budget, FailoverPolicy, RollbackRefused

T = TypeVar("T")


class PartLost(HeraldError):
    """A process of one attempt of a job died or went silent: that attempt cannot go on, a
    rolled-back one can (:func:`run_attempts`, at most ``getattr(cfg.recovery, budget)`` times per
    cause). The message names the process and says what followed.

    Args:
        message: the job's error (first line: the lost process).
        ranks: the lost workers' ranks (ints), empty for a PS shard.
        cause: one line for the report (default: the message's first line).
        seen_unix_s: when the job saw the loss (Unix seconds; default: now).
    """

    retriable = True
    part = "process"  # the report's word for what was lost
    budget = ""  # the TrainConfig setting (of its recovery): rollbacks allowed for this cause

    def __init__(
        self, message: str, *, ranks: Sequence[int] = (), cause: str | None = None, seen_unix_s: float | None = None
    ):
        super().__init__(message)
        self.ranks = tuple(int(r) for r in ranks)
        self.cause = cause or (message.splitlines() or [""])[0]
        self.seen_unix_s = time.time() if seen_unix_s is None else float(seen_unix_s)


class ShardFailed(PartLost):
    """A local PS shard died or went silent during the job (the message names it); NOTE [ps
    failover] rolls the job back (``--ps-restarts``)."""

    part, budget = "ps", "ps_restarts"


class WorkerFailed(PartLost):
    """A local worker process was killed by a signal or went silent (the message names it by
    rank, with its log); NOTE [worker failover] rolls the job back (``--worker-restarts``)."""

    part, budget = "worker", "worker_restarts"


class Rollbacks(FailoverPolicy):
    """The failover policy of one ``herald train`` job ``cfg`` (its first attempt's settings;
    NOTE [failover policy]): a budget for each :class:`PartLost` cause (``--ps-restarts``,
    ``--worker-restarts``), and :meth:`roll_back` in ``herald train``'s words.

    A failover record has the policy's keys and ``ranks`` (the lost workers' ranks; None for a
    shard: ``cause`` names it) and ``stopped_s`` (seconds from the loss seen to every process of
    the attempt stopped); ``recovered_s`` is from the loss seen to the next attempt's first step
    acked by every worker (None while there is none), as the test bed's (herald/testbed/job.py).
    """

    def __init__(self, cfg: TrainConfig):
        budgets = {
            lost.part: Budget(int(getattr(cfg.recovery, lost.budget)), "--" + lost.budget.replace("_", "-"))
            for lost in (ShardFailed, WorkerFailed)
        }
        super().__init__(cfg.run_dir, budgets, resumed=cfg.resume)
        self.cfg = cfg

    def roll_back(self, exc: PartLost) -> TrainConfig:
        """The settings of the attempt after ``exc`` (``--resume`` from the latest checkpoint
        of this job), its failover recorded and said on stderr.

        Raises:
            HeraldError: ``exc``'s message, with why the job ends here when it does: the
            cause's budget is 0 (the message as it was) or spent, or this job has written
            no checkpoint yet.
        """
        try:
            record = self.record_rollback(
                exc.part,
                exc.cause,
                exc.seen_unix_s,
                ranks=list(exc.ranks) or None,
                stopped_s=round(max(0.0, time.time() - exc.seen_unix_s), 3),
            )
        except RollbackRefused as refused:
            raise HeraldError(self._refusal(exc, refused)) from None
        budget = self.budgets[exc.part]
        print(
            f"herald train: {exc.cause}\nrolling the job back to checkpoint {record['rolled_back_to']} (failover "
            f"{self.used(exc.part)} of at most {budget.allowed} for a lost {exc.part}, {budget.flag} {budget.allowed})",
            file=sys.stderr,
            flush=True,
        )
        return dataclasses.replace(self.cfg, resume=True)

    def _refusal(self, exc: PartLost, refused: RollbackRefused) -> str:
        """``exc``'s message with why there is no rollback (none added without a budget)."""
        flag, allowed = refused.budget.flag, refused.budget.allowed
        if refused.reason == "no budget":
            return str(exc)
        if refused.reason == "unreadable":
            return f"{exc}\n(cannot roll back ({flag} {allowed}): {refused.detail})"
        if refused.reason == "no checkpoint":
            return (
                f"{exc}\n(no checkpoint of this job to roll back to yet ({flag} {allowed}): the first "
                f"is written after step {self.cfg.checkpoint_every - 1})"
            )
        what = ", ".join(f"worker-{r}" for r in exc.ranks) or f"a {exc.part}"
        return (
            f"{exc}\n({what} lost again after {refused.used} rollback(s) for a lost {exc.part}, "
            f"{flag} {allowed}: the job ends here; the log above says why)"
        )


def run_attempts(cfg: TrainConfig, attempt: Callable[[TrainConfig, Rollbacks], T]) -> T:
    """Run ``attempt(settings, rollbacks)`` until one returns, rolling back after each
    :class:`PartLost` that its budget allows (:meth:`Rollbacks.roll_back`): the one home of
    "roll back and run another attempt". ``attempt`` passes ``rollbacks.on_step`` as its step
    callback and ``rollbacks.failovers`` / ``rollbacks.earlier`` to its report.

    Raises:
        HeraldError: a lost process beyond its budget (named), or whatever ``attempt`` raises.
    """
    rollbacks = Rollbacks(cfg)
    settings = cfg
    while True:
        rollbacks.begin()
        try:
            return attempt(settings, rollbacks)
        except PartLost as exc:
            settings = rollbacks.roll_back(exc)

"""Rolling a job back to its latest checkpoint when one of its processes is lost: the
failures that ask for it (:class:`PartLost`: :class:`ShardFailed`, :class:`WorkerFailed`),
each cause's budget (``--ps-restarts``, ``--worker-restarts``), the loop of attempts
(:func:`run_attempts`) and the report's ``failovers`` (NOTE [ps failover] in
herald/job/launcher.py says why the whole job goes back; NOTE [worker failover] below).

NOTE [worker failover]
~~~~~~~~~~~~~~~~~~~~~~
A worker process that dies (killed by a signal: ``kill -9``, the OOM killer, a crash in
native code: SIGSEGV, SIGABRT) or goes silent (stopped, hung: NOTE [silent workers] in
herald/job/silence.py) takes the job's dense replica, its cache and its place in the
all-reduce with it; the other workers' state is then ahead of anything a replacement
could join. So a lost worker is handled as a lost PS shard is (NOTE [ps failover]):
with ``--worker-restarts N`` (and ``--checkpoint-every``) every process of the attempt
is stopped and the job goes on from its latest checkpoint as ``--resume`` does, at most
N times; the final model is the uninterrupted run's. Each cause has its own budget: a
job with ``--ps-restarts 1 --worker-restarts 2`` survives one lost shard and two lost
workers. A loss before the job's first checkpoint ends it: the checkpoint another job
left in the run folder (the latest at the start, unless this job resumed from it) is
not this job's state (:meth:`Rollbacks._latest`).

Lost, not failed. :func:`herald.job.parts.raise_job_failure` (``herald train``'s local
workers, whose exit codes it knows) raises :class:`WorkerFailed` only for a worker that
a signal this job did not send ended (negative exit code: :func:`~herald.job.silence.killed_ranks`)
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
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from herald.contracts.train import TrainConfig
from herald.dispatch.records import StepRecord
from herald.errors import DataError, HeraldError
from herald.job import checkpoints
from herald.job.report_attempts import Attempt

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


class Rollbacks:
    """The rollbacks of one job ``cfg`` (its first attempt's settings): the report's
    ``failovers`` (one dict per rollback) and the ``earlier`` attempts
    (:class:`~herald.job.report_attempts.Attempt`), both filled as the job goes.

    A failover dict: ``part`` (``"worker"`` or ``"ps"``), ``ranks`` (the lost workers'
    ranks; None for a shard: ``cause`` names it), ``cause``, ``detected_unix_s`` (when the
    job saw the loss, Unix seconds), ``lost_at_step`` (the first step not acked by every
    worker), ``last_acked_step`` (None: none in that attempt), ``rolled_back_to`` (the
    checkpoint folder), ``checkpoint_step``, ``steps_rolled_back`` (trained again),
    ``stopped_s`` (seconds from the loss seen to every process of the attempt stopped) and
    ``recovered_s`` (from the loss seen to the next attempt's first step acked by every
    worker; None while there is none), as the test bed's (herald/testbed/job.py).
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg, self.root = cfg, pathlib.Path(cfg.run_dir) / "checkpoints"
        self.failovers: list[dict[str, Any]] = []
        self.earlier: list[Attempt] = []
        start = self._found()
        # the latest checkpoint at the start is another job's unless this one resumes from it
        self._foreign = None if cfg.resume or start is None else _identity(start)
        self._first_step = start.step + 1 if cfg.resume and start is not None else 0
        self._acked: list[int] = []
        self._started = time.perf_counter()
        self._lost_at: float | None = None  # when the last loss was seen (Unix s), until the next ack

    def begin(self) -> None:
        """An attempt starts (its steps and time are counted from here)."""
        self._acked, self._started = [], time.perf_counter()

    def on_step(self, rec: StepRecord) -> None:
        """The attempt's ``on_step``: ``rec.step`` was acked by every worker."""
        self._acked.append(rec.step)
        if self._lost_at is not None:
            self.failovers[-1]["recovered_s"] = round(time.time() - self._lost_at, 3)
            self._lost_at = None

    def roll_back(self, exc: PartLost) -> TrainConfig:
        """The settings of the attempt after ``exc`` (``--resume`` from the latest checkpoint
        of this job), its failover recorded and said on stderr.

        Raises:
            HeraldError: ``exc``'s message, with why the job ends here when it does: the
            cause's budget is 0 (the message as it was) or spent, or this job has written
            no checkpoint yet.
        """
        now = time.perf_counter()
        allowed = int(getattr(self.cfg.recovery, exc.budget))
        flag = "--" + exc.budget.replace("_", "-")
        used = sum(f["part"] == exc.part for f in self.failovers)
        if allowed == 0:
            raise HeraldError(str(exc)) from None
        try:
            latest = self._latest()
        except DataError as err:
            raise HeraldError(f"{exc}\n(cannot roll back ({flag} {allowed}): {err})") from None
        if latest is None:
            raise HeraldError(
                f"{exc}\n(no checkpoint of this job to roll back to yet ({flag} {allowed}): the first "
                f"is written after step {self.cfg.checkpoint_every - 1})"
            ) from None
        if used >= allowed:
            what = ", ".join(f"worker-{r}" for r in exc.ranks) or f"a {exc.part}"
            raise HeraldError(
                f"{exc}\n({what} lost again after {used} rollback(s) for a lost {exc.part}, "
                f"{flag} {allowed}: the job ends here; the log above says why)"
            ) from None
        last = max(self._acked, default=None)
        self.failovers.append(
            {
                "part": exc.part,
                "ranks": list(exc.ranks) or None,
                "cause": exc.cause,
                "detected_unix_s": round(exc.seen_unix_s, 3),
                "lost_at_step": self._first_step if last is None else last + 1,
                "last_acked_step": last,
                "rolled_back_to": latest.path.name,
                "checkpoint_step": latest.step,
                "steps_rolled_back": None if last is None else max(0, last - latest.step),
                "stopped_s": round(max(0.0, time.time() - exc.seen_unix_s), 3),
                "recovered_s": None,
            }
        )
        self.earlier.append(Attempt(tuple(self._acked), now - self._started))
        self._lost_at, self._first_step = exc.seen_unix_s, latest.step + 1
        print(
            f"herald train: {exc.cause}\nrolling the job back to checkpoint {latest.path.name} (failover "
            f"{used + 1} of at most {allowed} for a lost {exc.part}, {flag} {allowed})",
            file=sys.stderr,
            flush=True,
        )
        return dataclasses.replace(self.cfg, resume=True)

    def _found(self) -> checkpoints.Checkpoint | None:
        """The latest checkpoint in the run folder at the start (None: none, or unreadable: the
        first attempt names why when it resumes from it)."""
        try:
            return checkpoints.latest(self.root)
        except DataError:
            return None

    def _latest(self) -> checkpoints.Checkpoint | None:
        """The latest checkpoint of this job: None when there is none or it is the one another
        job left in the run folder (the latest at the start, when this job did not resume from it).

        Raises:
            DataError: ``latest`` names an unreadable checkpoint.
        """
        found = checkpoints.latest(self.root)
        return None if found is None or _identity(found) == self._foreign else found


def _identity(found: checkpoints.Checkpoint) -> tuple[str, int, int]:
    """One checkpoint on disk: its folder's name, its ``meta.json``'s inode and modification
    time (ns); a checkpoint written again under the same name is another."""
    st = os.stat(found.path / "meta.json")
    return found.path.name, st.st_ino, st.st_mtime_ns


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

"""One failover policy for every job that rolls back to a checkpoint (NOTE [failover policy]).

NOTE [failover policy]
~~~~~~~~~~~~~~~~~~~~~~
A job that loses a process goes back, whole, to its latest checkpoint (Persia §4.4; NOTE [ps
failover] in herald/job/launcher.py says why the whole job). Three programs do it, each with
its own processes, and one :class:`FailoverPolicy` decides and records it for all of them:
``herald train`` in one process (:class:`herald.job.recovery.rollback.Rollbacks`, a lost PS
shard or worker), the test bed's supervisor across hosts (herald/testbed/job.py, a lost PS
shard), and ``herald serve dispatcher``, which leaves the rollback to its supervisor and names
the checkpoint to go back to when it exits with status 75 (:meth:`FailoverPolicy.latest_in`,
NOTE [ps failover across hosts] in herald/job/recovery/failover.py).

1. **A budget per cause** (:class:`Budget`): rollbacks allowed for a lost PS shard
   (``--ps-restarts``) and for a lost worker (``--worker-restarts``), counted apart.
2. **The latest checkpoint of this job**: the one ``RUN_DIR/checkpoints/latest`` names, unless
   it is the one another job left there: the latest at the policy's start, when the job did not
   resume from it (a checkpoint is its folder's name, its ``meta.json``'s inode and modification
   time: one written again under the same name is another). A loss before the job's first own
   checkpoint cannot be rolled back.
3. **The rollback**, refused (:class:`RollbackRefused`, its ``reason``) when the cause has no
   budget, the latest checkpoint is unreadable, there is none of this job, or the budget is
   spent; each program words the refusal its own way (its messages are tested).
4. **The record**, one dict per failover in :attr:`FailoverPolicy.failovers` (the report's
   ``failovers``): ``part``, ``cause``, ``detected_unix_s`` (when the death was noticed, Unix
   seconds: for a PS shard of ``herald train``, the moment its supervisor reaped it, NOTE
   [death notices] in herald/deaths.py), ``lost_at_step`` (the first step not acked by every
   worker), ``last_acked_step`` (None: none in that attempt), ``rolled_back_to`` (the checkpoint's folder),
   ``checkpoint_step``, ``steps_rolled_back`` (trained again), ``resumed_unix_s`` (when the next
   attempt acked its first step past the checkpoint: training again; None until then) and
   ``recovered_s`` = ``resumed_unix_s`` - ``detected_unix_s`` (seconds from the death noticed to
   training again, ms resolution), with the program's own keys (``herald train``: ``ranks``,
   ``stopped_s``; the test bed: ``restart_s``). The attempt that ended goes to
   :attr:`FailoverPolicy.earlier` (its acked steps and seconds: the report counts them).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any

from herald.errors import DataError, HeraldError
from herald.job import checkpoints
from herald.job.report.inputs import Attempt


@dataclasses.dataclass(frozen=True)
class Budget:
    """Rollbacks allowed for one cause: ``allowed`` (int >= 0) and the ``flag`` that sets it
    (e.g. ``--ps-restarts``)."""

    allowed: int
    flag: str


class RollbackRefused(HeraldError):
    """The policy does not roll the job back (NOTE [failover policy], 3.).

    Attributes:
        reason: ``"no budget"`` (the cause's budget is 0), ``"unreadable"`` (the latest
            checkpoint cannot be read: ``detail`` says why), ``"no checkpoint"`` (none of this
            job yet) or ``"spent"`` (``used`` rollbacks done for the cause, its budget).
        budget: the cause's :class:`Budget`; used: rollbacks done for the cause so far.
    """

    def __init__(self, reason: str, budget: Budget, used: int, detail: str = ""):
        super().__init__(
            f"no rollback ({reason}; {budget.flag} {budget.allowed}, {used} done){': ' + detail if detail else ''}"
        )
        self.reason, self.budget, self.used, self.detail = reason, budget, used, detail


def _identity(found: checkpoints.Checkpoint) -> tuple[str, int, int]:
    """One checkpoint on disk: its folder's name, its ``meta.json``'s inode and modification
    time (ns); a checkpoint written again under the same name is another."""
    st = os.stat(found.path / "meta.json")
    return found.path.name, st.st_ino, st.st_mtime_ns


class FailoverPolicy:
    """The rollbacks of one job (NOTE [failover policy]) with its run folder ``run_dir`` and a
    :class:`Budget` per cause (``budgets``: part, e.g. ``"ps"`` or ``"worker"``, -> budget);
    ``resumed``: the job started from the latest checkpoint there (``--resume``).

    Attributes:
        failovers: one record per rollback (the report's ``failovers``), filled as the job goes.
        earlier: the attempts the rollbacks ended (:class:`~herald.job.report.inputs.Attempt`).
    """

    def __init__(self, run_dir: str | os.PathLike, budgets: Mapping[str, Budget], *, resumed: bool):
        self.root = pathlib.Path(run_dir) / "checkpoints"
        self.budgets = dict(budgets)
        self.failovers: list[dict[str, Any]] = []
        self.earlier: list[Attempt] = []
        try:
            start = checkpoints.latest(self.root)
        except DataError:  # unreadable: the first attempt names why when it resumes from it
            start = None
        # the latest checkpoint at the start is another job's unless this one resumes from it
        self._foreign = None if resumed or start is None else _identity(start)
        self._first_step = start.step + 1 if resumed and start is not None else 0
        self._acked: list[int] = []
        self._started = time.perf_counter()
        self._recovering: dict[str, Any] | None = None  # the last failover, until training goes on

    @staticmethod
    def latest_in(run_dir: str | os.PathLike) -> checkpoints.Checkpoint | None:
        """The latest checkpoint in ``run_dir`` (``RUN_DIR/checkpoints/latest``), whichever job wrote it.

        Raises:
            DataError: ``latest`` names an unreadable checkpoint.
        """
        return checkpoints.latest(pathlib.Path(run_dir) / "checkpoints")

    def latest(self) -> checkpoints.Checkpoint | None:
        """The latest checkpoint of this job: None when there is none or it is the one another
        job left in the run folder (NOTE [failover policy], 2.).

        Raises:
            DataError: ``latest`` names an unreadable checkpoint.
        """
        found = checkpoints.latest(self.root)
        return None if found is None or _identity(found) == self._foreign else found

    def used(self, part: str) -> int:
        """Rollbacks done so far for a lost ``part``."""
        return sum(f["part"] == part for f in self.failovers)

    def begin(self) -> None:
        """An attempt starts: its steps and time are counted from here."""
        self._acked, self._started = [], time.perf_counter()

    def acked(self, step: int) -> None:
        """``step`` was acked by every worker: the attempt's, and after a rollback the first one
        past the checkpoint is when training went on (``resumed_unix_s``, ``recovered_s``)."""
        self._acked.append(int(step))
        last = self._recovering
        if last is not None and step > last["checkpoint_step"]:
            now = time.time()
            last["resumed_unix_s"] = round(now, 3)
            last["recovered_s"] = round(now - last["detected_unix_s"], 3)
            self._recovering = None

    def on_step(self, rec: Any) -> None:
        """The attempt's ``on_step`` (a :class:`~herald.dispatch.records.StepRecord`): :meth:`acked`."""
        self.acked(rec.step)

    def check(self, part: str) -> checkpoints.Checkpoint:
        """The checkpoint a lost ``part`` rolls the job back to.

        Raises:
            RollbackRefused: no budget for ``part``, an unreadable latest checkpoint, none of
            this job yet, or the budget spent (NOTE [failover policy], 3.).
        """
        budget, used = self.budgets[part], self.used(part)
        if budget.allowed == 0:
            raise RollbackRefused("no budget", budget, used)
        try:
            latest = self.latest()
        except DataError as err:
            raise RollbackRefused("unreadable", budget, used, str(err)) from None
        if latest is None:
            raise RollbackRefused("no checkpoint", budget, used)
        if used >= budget.allowed:
            raise RollbackRefused("spent", budget, used)
        return latest

    def record_rollback(
        self, part: str, cause: str, detected_unix_s: float, *, last_acked: Any = ..., **extra: Any
    ) -> dict[str, Any]:
        """Record the rollback of the attempt that lost ``part`` (``cause``: one line; the death
        noticed at ``detected_unix_s``) to :meth:`check`'s checkpoint; ``last_acked``: the last
        step every worker acked (default: the largest :meth:`acked` in the attempt; None: none);
        ``extra``: the program's own keys. Returns the record (also in :attr:`failovers`).

        Raises:
            RollbackRefused: as :meth:`check`.
        """
        latest = self.check(part)
        last = max(self._acked, default=None) if last_acked is ... else last_acked
        record = {
            "part": part,
            "cause": cause,
            "detected_unix_s": round(detected_unix_s, 3),
            "lost_at_step": self._first_step if last is None else last + 1,
            "last_acked_step": last,
            "rolled_back_to": latest.path.name,
            "checkpoint_step": latest.step,
            "steps_rolled_back": None if last is None else max(0, last - latest.step),
            **extra,
            "resumed_unix_s": None,
            "recovered_s": None,
        }
        self.failovers.append(record)
        self.earlier.append(Attempt(tuple(self._acked), time.perf_counter() - self._started))
        self._recovering, self._first_step = record, latest.step + 1
        return record

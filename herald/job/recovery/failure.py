"""What a failed job reports: its error naming the cause, a lost process told from a failed
one (:func:`raise_job_failure`; NOTE [worker failover] in herald/job/recovery/rollback.py)."""

from __future__ import annotations

import time
from typing import Any, NoReturn

from herald.dispatch.peers import Silence
from herald.errors import HeraldError, SourceLost
from herald.job.recovery.rollback import ShardFailed, WorkerFailed
from herald.job.recovery.silence import killed_ranks, silent_culprits, silent_headline
from herald.procs import signal_words


def raise_job_failure(exc: HeraldError, ps_alive: Any, children: Any, silence: Silence | None = None) -> NoReturn:
    """Stop the children and raise what a failed job reports: ``exc`` naming its cause.

    ``ps_alive``: the shards' liveness check (``failure()``, and ``failed_at()`` when it knows
    when the shard was lost: the failover's ``detected_unix_s``); ``children``: the worker
    launcher (``failure(grace_s)``, ``exit_codes()``, ``describe(rank)``, ``stop()``);
    ``silence``: the dispatchers' view of the wait that failed. A dead or silent PS shard
    is the cause of whatever the workers report next (:class:`ShardFailed`: ``run_train``
    decides whether to roll back, NOTE [ps failover]); a worker's ``TrainingDiverged``
    says it all (step, rank, cause); a worker that went silent is named before the
    workers that timed out waiting on it (NOTE [silent workers] in herald/job/recovery/silence.py)
    and a worker a signal ended is put first: both are :class:`WorkerFailed` (lost, not
    failed: NOTE [worker failover] in herald/job/recovery/rollback.py); else a dead child's failure
    is put first (a worker's own error: the job ends). A lost data source (:class:`SourceLost`,
    NOTE [kafka outage] in herald/loader/kafka/outage.py) is the dispatcher's own failure: the
    workers it stopped are not blamed.
    """
    if isinstance(exc, SourceLost):
        children.stop()
        raise exc
    seen = time.time()  # the loss seen (NOTE [worker failover]: the report's recovery time counts from here)
    cause = ps_alive.failure() or children.failure(grace_s=2.0)
    codes = children.exit_codes()  # before the stop: which still run, which a signal ended
    silent, killed = silent_culprits(silence, codes), killed_ranks(codes)
    head = silent_headline(silent, silence, children.describe) if silent else None
    children.stop()
    if "TrainingDiverged: " in str(exc):
        raise HeraldError(str(exc).split("TrainingDiverged: ", 1)[1]) from None
    shard_cause = ps_alive.failure()
    if shard_cause:
        lost_at = getattr(ps_alive, "failed_at", lambda: None)()  # the death itself, when known
        raise ShardFailed(
            shard_cause if shard_cause in str(exc) else f"{shard_cause}\n(then: {exc})",
            seen_unix_s=min(seen, lost_at) if lost_at is not None else seen,
        ) from exc
    if head is not None:
        then = [cause] if cause else []
        then += [str(exc)] if not cause or cause not in str(exc) else []
        raise WorkerFailed(
            "\n".join([head, *(f"(then: {t})" for t in then)]),
            ranks=silent,
            cause=f"{', '.join(f'worker-{r}' for r in silent)} went silent",
            seen_unix_s=seen,
        ) from exc
    if killed:  # cause: children.failure() names a killed worker first, with its log's tail
        words = "; ".join(f"worker-{r} was killed by {signal_words(codes[r])}" for r in killed)
        raise WorkerFailed(
            cause if cause and cause in str(exc) else f"{cause or words}\n(then: {exc})",
            ranks=killed,
            cause=words,
            seen_unix_s=seen,
        ) from exc
    if cause and cause not in str(exc):
        raise HeraldError(f"{cause}\n(then: {exc})") from exc
    raise exc

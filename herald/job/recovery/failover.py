"""PS failover when the dispatcher is a process of its own (``herald serve dispatcher``,
the test bed's dispatcher): detect a lost PS shard, stop with a distinct exit status
(:class:`herald.job.parts.RemotePS` watches the shards and raises :func:`shard_lost`).

NOTE [ps failover across hosts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Persia §4.4: a lost PS shard is recovered from its last checkpoint, and the rest of the
job goes back to the same point (NOTE [ps failover] in herald/job/launcher.py says why
the whole job). ``herald train`` does all of it in one process; across hosts the work is
split. The dispatcher pings every PS shard while it waits on its workers (NOTE [ps
liveness]: a shard that answers no ping for half of ``--timeout-ms`` is named, before
any worker's own PS timeout blames someone else); when one is lost it stops and exits
with :data:`SHARD_FAILED_EXIT` (75, ``EX_TEMPFAIL``: "try again"), its last stderr line
naming the shard and the latest checkpoint. Whoever supervises the hosts (a cluster
manager; on the test bed :func:`herald.testbed.job.run_job`, with the failover policy of NOTE
[failover policy] in herald/job/recovery/policy.py) then restarts the PS shard
(a fresh ``herald serve ps``), the dispatcher with ``--resume`` (it restores every shard
from the checkpoint through the admin op, and gives the workers the checkpoint's dense
state and its own position) and the workers (fresh caches). Because resume is exact,
the final model equals an uninterrupted run's; the steps after the checkpoint are
trained twice. Under ``--consistency gba`` restarting only the lost shard is enough
too: the ``restore`` drops a surviving shard's gradient buffer and global step (NOTE
[gba tokens] in herald/ps/gba.py), which belong to the rolled-back run, and the resumed
workers' first requests make a new one at their ``base``, the checkpoint's next global
step (NOTE [gba checkpoints] in herald/dispatch/gba.py).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from herald.errors import HeraldError
from herald.job.recovery.policy import FailoverPolicy
from herald.ps.watch import ShardWatch

SHARD_FAILED_EXIT = 75
"""Exit status of a dispatcher process that lost a PS shard (``EX_TEMPFAIL`` of
sysexits.h): restart the shard, then the dispatcher with ``--resume``."""


class ShardLost(HeraldError):
    """A PS shard died or went silent under a dispatcher process (the message names the
    shard and the latest checkpoint); its exit status is :data:`SHARD_FAILED_EXIT`."""

    exit_code = SHARD_FAILED_EXIT


def watch_shards(addresses: Sequence[str], timeout_ms: int, keys_dir: str | None = None) -> ShardWatch:
    """A liveness check for ``Dispatcher(liveness=...)`` over remote PS shards
    (``addresses``, shard order): a shard is lost once it answers no ping for half of
    ``timeout_ms`` (ms). The call raises; :meth:`ShardWatch.failure` says it was a shard."""
    return ShardWatch(addresses, silent_ms=max(1, int(timeout_ms) // 2), keys_dir=keys_dir)


def shard_lost(cause: str, run_dir: str | None) -> ShardLost:
    """The error of a lost shard: ``cause`` (names the shard) and the latest checkpoint of
    ``run_dir`` (None: the process writes no checkpoints), with what to do next."""
    root = pathlib.Path(run_dir).resolve() / "checkpoints" if run_dir else None
    try:  # the checkpoint the supervisor rolls the job back to (NOTE [failover policy])
        found = FailoverPolicy.latest_in(pathlib.Path(run_dir).resolve()) if run_dir else None
    except HeraldError as exc:  # an unreadable checkpoint: say so, the shard is still the news
        found, root = None, f"{root} ({exc})"
    if found is not None:
        what = (
            f"latest checkpoint: {found.path} (step {found.step}); restart the shard and this dispatcher "
            f"with --resume to roll the job back to it"
        )
    elif root is not None:
        what = (
            f"no checkpoint in {root}: the job cannot roll back; run it with --checkpoint-every STEPS to make "
            "failover possible"
        )
    else:
        what = (
            "no checkpoints (--checkpoint-every 0): the job cannot roll back; give --run-dir and "
            "--checkpoint-every STEPS to make failover possible"
        )
    first = cause.splitlines()[0] if cause else "a PS shard was lost"
    return ShardLost(f"{first}\n{what} (exit status {SHARD_FAILED_EXIT}; docs/operations.md)")

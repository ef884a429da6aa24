"""``herald train``: PS shards, the dispatcher and N workers as local processes.

The dispatcher runs in this process (so progress and the report come from one
place); each PS shard and each worker is a child process started with
``python -m herald serve ...`` (:class:`herald.job.parts.LocalPS`,
:class:`herald.job.parts.LocalWorkers`). A child that exits early is reported by name
and the whole job stops (children are terminated with a bounded wait: no orphans).
``--groups G --consistency hybrid`` runs one dispatcher per group instead (NOTE
[independent groups] in herald/job/group_dispatch.py). The job itself is run by
:class:`herald.job.runner.JobRunner` (NOTE [job runner]); this module picks its parts
and rolls it back when a PS shard or a worker is lost (NOTE [ps failover], NOTE [worker
failover] in herald/job/recovery/rollback.py).
"""

from __future__ import annotations

import pathlib
from typing import Any

from herald.contracts.train import TrainConfig
from herald.dispatch.dispatcher import Dispatcher
from herald.job.interfaces import JobHooks, RunOptions
from herald.job.parts import Checkpointing, LocalPS, LocalWorkers
from herald.job.ray.parts import ray_parts
from herald.job.recovery.rollback import Rollbacks, run_attempts
from herald.job.runner import JobInterrupted, JobReport, JobRunner

__all__ = ["JobInterrupted", "run_train"]  # JobInterrupted: herald train's clean stop on a signal

#: ``--launcher`` -> the job's PS and worker parts (herald.contracts.vocab.LAUNCHERS): local
#: processes, or Ray actors over a cluster's nodes (NOTE [ray job] in herald/job/ray/parts.py)
PARTS = {"local": lambda cfg: (LocalPS(), LocalWorkers()), "ray": ray_parts}


# NOTE [ps failover]
# ~~~~~~~~~~~~~~~~~~
# Persia §4.4 recovers from a lost PS by reloading its last checkpoint; the rest of the
# job must then go back to the same point, or the PS rows and the dense replicas, the
# worker caches and the data position would disagree. herald rolls the whole job back:
# when the liveness watch (NOTE [ps liveness]) names a dead or silent shard and
# ``--ps-restarts N`` allows another attempt, every process of the attempt is stopped and
# the job starts again as ``--resume`` does: fresh PS shards restored from the latest
# checkpoint, the dispatcher's position and the dense state of that checkpoint, empty
# worker caches (a cache is a copy of PS rows, so an empty one is exact). Resume is exact
# (tests/integration/test_resume.py), so the final model equals an uninterrupted run;
# the steps after the checkpoint are trained twice, which is the cost of a failure. The
# report lists each failover (``failovers``: cause, checkpoint, the last step acked before,
# the steps rolled back) and counts every attempt's steps and samples, naming the steps
# trained again (``attempts``, ``retrained_steps``: herald/job/report/attempts.py). Without
# a checkpoint (``--checkpoint-every``) there is nothing to go back to and the failure ends
# the job as before. A lost worker is rolled back for the same way (``--worker-restarts N``,
# its own budget: NOTE [worker failover] in herald/job/recovery/rollback.py, whose run_attempts is
# the one loop of attempts). Whether to roll back, to which checkpoint, and the record of it are
# the failover policy's (NOTE [failover policy] in herald/job/recovery/policy.py), which the test
# bed's supervisor uses too.


def run_train(
    cfg: TrainConfig, *, progress: bool = True, on_finish=None, started_at: float | None = None
) -> dict[str, Any]:
    """Run a whole training job; returns the report dict (also written to ``run_dir``).
    ``started_at``: when this job's own process started (``herald train``:
    :func:`herald.job.runner.process_started_at`), the origin of the report's start-up
    milestones; None: the job's own start.

    A PS shard that dies is survived up to ``cfg.recovery.ps_restarts`` times, a worker that dies or
    goes silent up to ``cfg.recovery.worker_restarts`` times, by rolling the job back to its latest
    checkpoint (NOTE [ps failover], :func:`herald.job.recovery.rollback.run_attempts`); see
    :func:`_run_attempt` for the rest.
    """
    return run_attempts(
        cfg,
        lambda attempt, rollbacks: _run_attempt(
            attempt, progress=progress, on_finish=on_finish, rollbacks=rollbacks, started_at=started_at
        ),
    )


def _run_attempt(
    cfg: TrainConfig, *, progress: bool, on_finish, rollbacks: Rollbacks, started_at: float | None
) -> dict[str, Any]:
    """One attempt of :func:`run_train`; ``rollbacks``: the earlier attempts (for the report)
    and this one's step callback (each step acked by every worker).

    ``on_finish(ps_addresses, job)``, if given, runs after the final flush while the PS
    shards are still up (tests read the trained rows there). SIGINT / SIGTERM end the
    job cleanly at the next step (with a final checkpoint when checkpointing is on); the
    report (``interrupted``) is written and then :class:`JobInterrupted` is raised.

    Raises:
        ConfigError: bad settings; HeraldError: a child process failed (named);
        PartLost: a PS shard (ShardFailed) or a worker (WorkerFailed) was lost;
        JobInterrupted: stopped by SIGINT / SIGTERM (exit status 130 / 143).
    """
    ids = pathlib.Path(cfg.run_dir) / "trained_sample_ids.u64" if cfg.log_sample_ids else None
    # kafka:// sources checkpoint even without --checkpoint-every: their offsets are committed there
    ckpts = Checkpointing("herald train", enabled=bool(cfg.checkpoint_every or cfg.is_stream), check_config=True)
    # Dispatcher: looked up here at each attempt (tests wrap it: tests/integration/test_fuzz_dispatcher.py)
    ps, workers = PARTS[cfg.launcher.name](cfg)
    options = RunOptions(
        dispatcher=Dispatcher, progress=progress, stop_on_signals=True, sample_id_log=ids, started_at=started_at
    )
    return (
        JobRunner(
            ps=ps,
            workers=workers,
            checkpoints=ckpts,
            report=JobReport(rollbacks.failovers, rollbacks.earlier),
            hooks=JobHooks(on_step=rollbacks.on_step, on_finish=on_finish),
            options=options,
        )
        .run(cfg)
        .report
    )

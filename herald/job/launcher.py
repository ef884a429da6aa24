"""``herald train``: PS shards, the dispatcher and N workers as local processes.

The dispatcher runs in this process (so progress and the report come from one
place); each PS shard and each worker is a child process started with
``python -m herald serve ...`` (:class:`herald.job.parts.LocalPS`,
:class:`herald.job.parts.LocalWorkers`). A child that exits early is reported by name
and the whole job stops (children are terminated with a bounded wait: no orphans).
``--groups G --consistency hybrid`` runs one dispatcher per group instead (NOTE
[independent groups] in herald/job/group_dispatch.py). The job itself is run by
:class:`herald.job.runner.JobRunner` (NOTE [job runner]); this module picks its parts
and rolls it back when a PS shard is lost (NOTE [ps failover]).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from typing import Any

from herald.dispatch.dispatcher import Dispatcher
from herald.errors import HeraldError
from herald.job import checkpoints
from herald.job.parts import Checkpointing, LocalPS, LocalWorkers, ShardFailed
from herald.job.report_attempts import Attempt
from herald.job.runner import JobInterrupted, JobReport, JobRunner
from herald.spec.train import TrainConfig

__all__ = ["JobInterrupted", "run_train"]   # JobInterrupted: herald train's clean stop on a signal


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
# trained again (``attempts``, ``retrained_steps``: herald/job/report_attempts.py). Without
# a checkpoint (``--checkpoint-every``) there is nothing to go back to and the failure ends
# the job as before.


def run_train(cfg: TrainConfig, *, progress: bool = True, on_finish=None,
              started_at: float | None = None) -> dict[str, Any]:
    """Run a whole training job; returns the report dict (also written to ``run_dir``).
    ``started_at``: when this job's own process started (``herald train``:
    :func:`herald.job.runner.process_started_at`), the origin of the report's start-up
    milestones; None: the job's own start.

    A PS shard that dies is survived up to ``cfg.ps_restarts`` times by rolling the job
    back to its latest checkpoint (NOTE [ps failover]); see :func:`_run_attempt` for the rest.
    """
    failovers: list[dict[str, Any]] = []
    earlier: list[Attempt] = []   # the attempts a failover ended: counted in the report
    attempt = cfg
    while True:
        acked: list[int] = []
        started = time.perf_counter()
        try:
            return _run_attempt(attempt, progress=progress, on_finish=on_finish, failovers=failovers,
                                earlier=earlier, acked=acked, started_at=started_at)
        except ShardFailed as exc:
            latest = checkpoints.latest(pathlib.Path(cfg.run_dir) / "checkpoints")
            if len(failovers) >= cfg.ps_restarts or latest is None:
                hint = ("" if cfg.ps_restarts == 0 else
                        " (no checkpoint to roll back to: use --checkpoint-every)" if latest is None else
                        f" (after {len(failovers)} failover(s), --ps-restarts {cfg.ps_restarts})")
                raise HeraldError(f"{exc}{hint}") from None
            last = max(acked, default=None)
            failovers.append({"cause": str(exc).splitlines()[0], "rolled_back_to": latest.path.name,
                              "checkpoint_step": latest.step, "last_acked_step": last,
                              "steps_rolled_back": None if last is None else max(0, last - latest.step)})
            earlier.append(Attempt(tuple(acked), time.perf_counter() - started))
            print(f"herald train: {str(exc).splitlines()[0]}\nrolling the job back to checkpoint "
                  f"{latest.path.name} (failover {len(failovers)} of at most {cfg.ps_restarts})", file=sys.stderr)
            attempt = dataclasses.replace(cfg, resume=True)


def _run_attempt(cfg: TrainConfig, *, progress: bool, on_finish, failovers: list[dict[str, Any]],
                 earlier: list[Attempt], acked: list[int], started_at: float | None) -> dict[str, Any]:
    """One attempt of :func:`run_train`; ``failovers`` and ``earlier``: the earlier attempts'
    (for the report); ``acked`` gets each step acked by every worker (int, ack order).

    ``on_finish(ps_addresses, job)``, if given, runs after the final flush while the PS
    shards are still up (tests read the trained rows there). SIGINT / SIGTERM end the
    job cleanly at the next step (with a final checkpoint when checkpointing is on); the
    report (``interrupted``) is written and then :class:`JobInterrupted` is raised.

    Raises:
        ConfigError: bad settings; HeraldError: a child process failed (named);
        ShardFailed: a PS shard was lost; JobInterrupted: stopped by SIGINT / SIGTERM
        (exit status 130 / 143).
    """
    ids = pathlib.Path(cfg.run_dir) / "trained_sample_ids.u64" if cfg.log_sample_ids else None
    # kafka:// sources checkpoint even without --checkpoint-every: their offsets are committed there
    ckpts = Checkpointing("herald train", enabled=bool(cfg.checkpoint_every or cfg.is_stream), check_config=True)
    # Dispatcher: looked up here at each attempt (tests wrap it: tests/integration/test_fuzz_dispatcher.py)
    return JobRunner(ps=LocalPS(), workers=LocalWorkers(), checkpoints=ckpts, report=JobReport(failovers, earlier),
                     dispatcher=Dispatcher, progress=progress, stop_on_signals=True, on_finish=on_finish,
                     on_step=lambda rec: acked.append(rec.step), sample_id_log=ids,
                     started_at=started_at).run(cfg).report

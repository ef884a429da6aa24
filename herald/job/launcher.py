"""``herald train``: PS shards, the dispatcher and N workers as local processes.

The dispatcher runs in this process (so progress and the report come from one
place); each PS shard and each worker is a child process started with
``python -m herald serve ...`` (:class:`herald.job.runner.LocalProcesses`). A child that
exits early is reported by name and the whole job stops (children are terminated with a
bounded wait: no orphans). ``--groups G --consistency hybrid`` runs one dispatcher per
group instead (NOTE [independent groups] in herald/job/group_dispatch.py).
"""

from __future__ import annotations

import dataclasses
import pathlib
import signal
import sys
import time
from typing import Any

from herald.dispatch.dispatcher import Dispatcher, StepRecord
from herald.errors import HeraldError
from herald.job import checkpoints
from herald.job import report as report_mod
from herald.job.data import JobData
from herald.job.group_dispatch import independent_groups, run_group_attempt
from herald.job.runner import (JobInterrupted, LocalProcesses, ShardFailed, StopOnSignals, dispatcher_config,
                               finish_job, prepare_run)
from herald.spec.flags import flag_errors
from herald.spec.job import JobSpec
from herald.spec.train import TrainConfig


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
# report lists each failover (``failovers``). Without a checkpoint (``--checkpoint-every``)
# there is nothing to go back to and the failure ends the job as before.


def run_train(cfg: TrainConfig, *, progress: bool = True, on_finish=None) -> dict[str, Any]:
    """Run a whole training job; returns the report dict (also written to ``run_dir``).

    A PS shard that dies is survived up to ``cfg.ps_restarts`` times by rolling the job
    back to its latest checkpoint (NOTE [ps failover]); see :func:`_run_attempt` for the rest.
    """
    failovers: list[dict[str, Any]] = []
    attempt = cfg
    while True:
        try:
            return _run_attempt(attempt, progress=progress, on_finish=on_finish, failovers=failovers)
        except ShardFailed as exc:
            latest = checkpoints.latest(pathlib.Path(cfg.run_dir) / "checkpoints")
            if len(failovers) >= cfg.ps_restarts or latest is None:
                hint = ("" if cfg.ps_restarts == 0 else
                        " (no checkpoint to roll back to: use --checkpoint-every)" if latest is None else
                        f" (after {len(failovers)} failover(s), --ps-restarts {cfg.ps_restarts})")
                raise HeraldError(f"{exc}{hint}") from None
            failovers.append({"cause": str(exc).splitlines()[0], "rolled_back_to": latest.path.name})
            print(f"herald train: {str(exc).splitlines()[0]}\nrolling the job back to checkpoint "
                  f"{latest.path.name} (failover {len(failovers)} of at most {cfg.ps_restarts})", file=sys.stderr)
            attempt = dataclasses.replace(cfg, resume=True)


def _run_attempt(cfg: TrainConfig, *, progress: bool, on_finish, failovers: list[dict[str, Any]]) -> dict[str, Any]:
    """One attempt of :func:`run_train`; ``failovers``: the earlier attempts' (for the report).

    ``on_finish(ps_addresses, job)``, if given, runs after the final flush while the PS
    shards are still up (tests read the trained rows there). SIGINT / SIGTERM end the
    job cleanly at the next step (with a final checkpoint when checkpointing is on); the
    report (``interrupted``) is written and then :class:`JobInterrupted` is raised.

    Raises:
        ConfigError: bad settings; HeraldError: a child process failed (named);
        JobInterrupted: stopped by SIGINT / SIGTERM (exit status 130 / 143).
    """
    if independent_groups(cfg):   # --groups G --consistency hybrid: one dispatcher per group
        return run_group_attempt(cfg, progress=progress, on_finish=on_finish, failovers=failovers)
    run_dir = prepare_run(cfg)
    data = JobData(cfg)
    # --resume: PS rows, dense state and the dispatcher's state (next step, next batch,
    # producer position) of the latest checkpoint (herald/job/checkpoints.py)
    # (kafka:// sources checkpoint even without --checkpoint-every: their offsets are committed there)
    ckpts = checkpoints.DispatcherCheckpoints(run_dir, resume=cfg.resume, who="herald train", config=cfg,
                                              enabled=bool(cfg.checkpoint_every or cfg.is_stream))
    with flag_errors():
        new_scheduler = data.scheduler_factory(cfg)

    records: list[StepRecord] = []
    id_log = open(run_dir / "trained_sample_ids.u64", "ab") if cfg.log_sample_ids else None
    t_start = time.perf_counter()
    with LocalProcesses(cfg, data) as local:
        ps = local.ps
        ckpts.attach(ps, data)   # --resume: restores the PS rows first
        job = JobSpec.build(cfg, data, list(local.shards.addresses)).replace(
            dist_init=local.dist_init, resume_dense=ckpts.resume_dense)
        use_ckpt = ckpts.enabled
        bar = report_mod.Progress(cfg, enabled=progress, total_steps=data.total_steps(cfg),
                                  skipped=lambda: data.batches.skipped)
        disp_cfg = dispatcher_config(cfg)
        interrupted = None
        try:
            with Dispatcher(disp_cfg, data.batches, new_scheduler, job, on_step=bar.update,
                            **ckpts.dispatcher_kwargs(),
                            liveness=local.liveness, sample_id_log=id_log) as disp, \
                    StopOnSignals(disp, data) as stopper:
                ckpts.load(disp)
                for rank in range(cfg.workers):
                    local.start_worker(rank, disp.address, rank, cfg.workers, job)
                records = disp.serve()
                if stopper.signum is not None:
                    # at_step: steps trained = where --resume continues; checkpoint: its folder
                    interrupted = {"signal": signal.Signals(stopper.signum).name, "at_step": disp.next_step,
                                   "checkpoint": f"step-{disp.checkpoints[-1]:08d}"
                                   if use_ckpt and disp.checkpoints else None}
                capacity_rows = disp.scheduler.capacity_rows
                dispatcher_s = {k: v / 1e3 for k, v in disp.timer.take().items()}
            local.children.wait(timeout_s=60, context=" after the end of training")
        except HeraldError as exc:
            local.fail(exc)
        except BaseException:
            local.children.stop()
            raise
        finally:
            bar.close()
            if id_log is not None:
                id_log.close()
        train_s = time.perf_counter() - t_start
        ps_stats, metrics, skipped = finish_job(data, job, ps, local.shards.addresses, run_dir, on_finish)
    rep = report_mod.build(cfg, records, train_s, metrics, batches_info=data.batches.info, split_info=data.split_info,
                           capacity_rows=capacity_rows, dispatcher_s=dispatcher_s, ps_stats=ps_stats,
                           skipped=skipped, interrupted=interrupted, scheduler=data.scheduler_stats())
    rep["replicated_tables"] = [data.schema.table_names[t] for t in data.replicated]
    rep["replica_rows_per_worker"] = data.replica_rows
    rep["failovers"] = failovers
    rep["consistency"]["switched_from"] = ckpts.switched_from   # --resume under another mode (NOTE [gba checkpoints])
    report_mod.write(rep, records, run_dir)
    if interrupted is not None:
        raise JobInterrupted(interrupted, rep, run_dir)
    return rep

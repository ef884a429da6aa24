"""``herald train``: PS shards, the dispatcher and N workers as local processes.

The dispatcher runs in this process (so progress and the report come from one
place); each PS shard and each worker is a child process started with
``python -m herald serve ...``. A child that exits early is reported by name and
the whole job stops (children are terminated with a bounded wait: no orphans).

Security (docs/operations.md, "Securing a multi-host job"): with ``--keys DIR`` every
role's ZeroMQ traffic is CURVE (NOTE [transport security] in herald/auth.py); the PS
shards take admin ops (checkpoint, restore, shutdown) only with this job's token and
only inside ``RUN_DIR/checkpoints`` (NOTE [ps admin ops]); the workers' dense process
group rendezvous through a file in the run folder (no listening store) and gloo is kept
on the loopback interface (:func:`_dense_store`, :func:`_worker_env`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import secrets
import signal
import sys
import time
from typing import Any, Iterator, NoReturn

from herald.auth import load_client_keys, load_server_keys, loopback_interface
from herald.errors import HeraldError
from herald.procs import Supervisor
from herald.ps import LocalShards, PSClient
from herald.ps.config import ShardLimits
from herald.dispatch.dispatcher import Dispatcher, DispatcherConfig, StepRecord
from herald.job import checkpoints
from herald.job.data import JobData
from herald.spec.flags import flag_errors
from herald.spec.job import JobSpec
from herald.spec.train import TrainConfig


@contextlib.contextmanager
def _dense_store(run_dir: pathlib.Path) -> Iterator[str]:
    """The workers' ``torch.distributed`` init method: ``file://`` a fresh file in the run
    folder (torch's FileStore: no listening socket, unlike rank 0's TCPStore, which binds
    every interface); the file is removed when the job ends."""
    path = run_dir.resolve() / f".dist-store-{secrets.token_hex(8)}"
    try:
        yield f"file://{path}"
    finally:
        path.unlink(missing_ok=True)


def _worker_env() -> dict[str, str]:
    """Environment of the local workers: their intra-op threads, and gloo's interface
    (``GLOO_SOCKET_IFNAME``) on loopback unless the user chose one: the workers share
    this host, so their all-reduce connections need not listen on any other interface."""
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    lo = loopback_interface()
    if "GLOO_SOCKET_IFNAME" not in os.environ and lo is not None:
        env["GLOO_SOCKET_IFNAME"] = lo
    return env


class ShardFailed(HeraldError):
    """A PS shard died or went silent during the job (the message names it); raised by
    one attempt of :func:`run_train` so that NOTE [ps failover] can roll the job back."""


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


def raise_job_failure(exc: HeraldError, ps_alive: Any, children: Supervisor) -> NoReturn:
    """Stop the children and raise what a failed job reports: ``exc`` naming its cause.

    A dead or silent PS shard is the cause of whatever the workers report next
    (:class:`ShardFailed`: ``run_train`` decides whether to roll back, NOTE [ps failover]);
    a worker's ``TrainingDiverged`` says it all (step, rank, cause); else a dead child's
    failure is put first.
    """
    cause = ps_alive.failure() or children.failure(grace_s=2.0)
    children.stop()
    if "TrainingDiverged: " in str(exc):
        raise HeraldError(str(exc).split("TrainingDiverged: ", 1)[1]) from None
    shard_cause = ps_alive.failure()
    if shard_cause:
        raise ShardFailed(shard_cause if shard_cause in str(exc) else f"{shard_cause}\n(then: {exc})") from exc
    if cause and cause not in str(exc):
        raise HeraldError(f"{cause}\n(then: {exc})") from exc
    raise exc


def dispatcher_config(cfg: TrainConfig, **overrides: Any) -> DispatcherConfig:
    """The :class:`DispatcherConfig` of a job: the job's settings (workers,
    ``--max-inflight-steps``, ``--timeout-ms``, ``--checkpoint-every``, keys) with this
    dispatcher's ``overrides`` (``bind``, ``dispatcher_rank``, a group's ``num_workers``).
    The one place ``herald train``, the group launcher, ``herald serve dispatcher`` and the
    test bed's dispatcher build it.

    Raises:
        ConfigError: a setting out of range (named by its flag).
    """
    settings = dict(num_workers=cfg.workers, max_inflight_steps=cfg.max_inflight_steps,
                    peer_timeout_ms=cfg.timeout_ms, checkpoint_every_steps=cfg.checkpoint_every,
                    keys_dir=cfg.keys_dir, insecure=cfg.insecure)
    with flag_errors():
        return DispatcherConfig(**{**settings, **overrides})


def finish_job(data: JobData, job: JobSpec, ps: PSClient, addresses: Any, run_dir: pathlib.Path,
               on_finish) -> tuple[dict, dict, dict]:
    """After training: the PS shards' stats, ``on_finish(addresses, job)``, the held-out
    evaluation and the skipped-record counts; closes ``data``.

    Returns:
        ``(ps_stats, metrics, skipped)``: ``skipped`` is ``{"train": ..., "eval": ...}``
        (reason -> count, NOTE [bad records]).
    """
    from herald.job import report as report_mod

    ps_stats = ps.stats()
    if on_finish is not None:
        on_finish(list(addresses), job)
    metrics = report_mod.evaluate(job, data.eval_source, run_dir, addresses) if data.eval_source is not None else {}
    data.close()
    skipped = {"train": dict(data.batches.skipped),
               "eval": dict(data.eval_source.stats["skipped"]) if data.eval_source is not None else {}}
    return ps_stats, metrics, skipped


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
    from herald.job import report as report_mod
    from herald.job.group_dispatch import independent_groups, run_group_attempt

    if independent_groups(cfg):   # --groups G --consistency hybrid: one dispatcher per group
        return run_group_attempt(cfg, progress=progress, on_finish=on_finish, failovers=failovers)
    if cfg.keys_dir is not None:   # NOTE [transport security]: bad keys stop the job before anything starts
        load_server_keys(cfg.keys_dir)
        load_client_keys(cfg.keys_dir)
    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)   # the shards' checkpoint root (NOTE [ps admin ops])
    data = JobData(cfg)
    # --resume: PS rows, dense state and the dispatcher's state (next step, next batch,
    # producer position) of the latest checkpoint (herald/job/checkpoints.py)
    # (kafka:// sources checkpoint even without --checkpoint-every: their offsets are committed there)
    ckpts = checkpoints.DispatcherCheckpoints(run_dir, resume=cfg.resume, who="herald train", config=cfg,
                                              enabled=bool(cfg.checkpoint_every or cfg.is_stream))
    with flag_errors():
        new_scheduler = data.scheduler_factory(cfg)

    children = Supervisor(run_dir, new_session=True, env=_worker_env())
    records: list[StepRecord] = []
    id_log = open(run_dir / "trained_sample_ids.u64", "ab") if cfg.log_sample_ids else None
    t_start = time.perf_counter()
    # ipc: every process is local, and ZeroMQ over Unix sockets moves ~2x the bytes of
    # TCP loopback here (docs/ps.md, benchmark)
    # NOTE [ps liveness] (herald/ps/watch.py): shard logs in the run folder (ps-shard-I.log),
    # an aggregation a dead worker leaves open is aborted within the job's timeout
    with LocalShards(num_shards=cfg.num_ps_shards, tables=cfg.tables(data.schema), seed=cfg.seed,
                     transport="ipc", log_dir=run_dir,
                     limits=ShardLimits(aggregation_timeout_ms=cfg.timeout_ms, max_rows=cfg.ps_max_rows), keys_dir=cfg.keys_dir,
                     checkpoint_root=run_dir / "checkpoints") as shards, \
            PSClient(list(shards.addresses), tables=cfg.tables(data.schema), timeout_ms=cfg.timeout_ms,
                     num_workers=cfg.workers, keys_dir=cfg.keys_dir, admin_token=shards.admin_token) as ps, \
            _dense_store(run_dir) as dist_init:
        # a dead shard is named at the next check, a silent one after half the job's timeout
        ps_alive = shards.watch(silent_ms=max(1, cfg.timeout_ms // 2))
        ckpts.attach(ps, data)   # --resume: restores the PS rows first
        job = JobSpec.build(cfg, data, list(shards.addresses)).replace(
            dist_init=dist_init, resume_dense=ckpts.resume_dense)
        use_ckpt = ckpts.enabled
        bar = report_mod.Progress(cfg, enabled=progress, total_steps=data.total_steps(cfg),
                                  skipped=lambda: data.batches.skipped)
        disp_cfg = dispatcher_config(cfg)
        interrupted = None
        try:
            with Dispatcher(disp_cfg, data.batches, new_scheduler, job, on_step=bar.update,
                            **ckpts.dispatcher_kwargs(),
                            liveness=lambda: (ps_alive(), children.check()), sample_id_log=id_log) as disp, \
                    _stop_on_signals(disp, data) as stopper:
                ckpts.load(disp)
                for rank in range(cfg.workers):
                    # every worker on this host, as torchrun would say (NOTE [worker devices])
                    children.env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(cfg.workers))
                    children.start(f"worker-{rank}", [sys.executable, "-m", "herald", "serve", "worker",
                                                      "--dispatcher", disp.address, "--rank", str(rank),
                                                      "--world-size", str(cfg.workers),
                                                      "--device", cfg.device, "--cache-device", cfg.cache_device,
                                                      "--timeout-ms", str(cfg.timeout_ms),
                                                      *(["--keys", job.keys_dir] if job.keys_dir else [])])
                records = disp.serve()
                if stopper.signum is not None:
                    # at_step: steps trained = where --resume continues; checkpoint: its folder
                    interrupted = {"signal": signal.Signals(stopper.signum).name, "at_step": disp.next_step,
                                   "checkpoint": f"step-{disp.checkpoints[-1]:08d}"
                                   if use_ckpt and disp.checkpoints else None}
                capacity_rows = disp.scheduler.capacity_rows
                dispatcher_s = {k: v / 1e3 for k, v in disp.timer.take().items()}
            children.wait(timeout_s=60, context=" after the end of training")
        except HeraldError as exc:
            raise_job_failure(exc, ps_alive, children)
        except BaseException:
            children.stop()
            raise
        finally:
            bar.close()
            if id_log is not None:
                id_log.close()
        train_s = time.perf_counter() - t_start
        ps_stats, metrics, skipped = finish_job(data, job, ps, shards.addresses, run_dir, on_finish)
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


class JobInterrupted(HeraldError):
    """``herald train`` stopped cleanly on SIGINT or SIGTERM (report and final checkpoint
    written). ``exit_code`` is 128 + the signal number (130 SIGINT, 143 SIGTERM), what a
    shell reports for a process the signal ended; ``report`` is the job's report dict."""

    def __init__(self, interrupted: dict[str, Any], report: dict[str, Any], run_dir: pathlib.Path):
        self.report, self.signal_name, self.at_step = report, interrupted["signal"], interrupted["at_step"]
        self.exit_code = 128 + int(signal.Signals[self.signal_name])
        folder = interrupted.get("checkpoint")
        resume = (f"checkpoint {run_dir / 'checkpoints' / folder} written: continue with the same options and "
                  "--resume" if folder is not None else
                  "no checkpoint (run with --checkpoint-every STEPS to be able to --resume)")
        super().__init__(f"interrupted by {self.signal_name} at step {self.at_step}; report in "
                         f"{run_dir / 'report.txt'}; {resume}")


class _stop_on_signals:
    """While active, SIGINT and SIGTERM stop the dispatcher at the next step boundary;
    ``signum`` is the first signal received (None: none)."""

    def __init__(self, disp: Dispatcher, data: JobData):
        self.disp, self.data, self.saved = disp, data, {}
        self.signum: int | None = None

    def _handler(self, signum, frame) -> None:
        print(f"herald train: {signal.Signals(signum).name}: stopping after the current step", file=sys.stderr)
        if self.signum is None:
            self.signum = signum
        self.disp.stop()
        self.data.interrupt()

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.saved[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self.saved.items():
            signal.signal(sig, old)


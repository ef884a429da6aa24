"""The job runner: one composition root for every job of herald (NOTE [job runner]).

NOTE [job runner]
~~~~~~~~~~~~~~~~~
``herald train`` (herald/job/launcher.py, with one dispatcher or one per group), ``herald
serve dispatcher`` (herald/job/serve_dispatcher.py), the test bed's dispatcher process
(herald/testbed/dispatcher.py) and the dispatcher capacity benchmark
(herald/bench/capacity.py) each run a job the same way, written once in
:meth:`JobRunner.run`:

1. **Settings.** The dispatchers' :class:`DispatcherConfig` (:func:`dispatcher_config`):
   one, or one per group when ``cfg`` asks for independent groups and the worker part
   places them (NOTE [independent groups] in herald/job/group_dispatch.py); then the
   parts' ``prepare`` (keys, folders), the checkpoints (the resume point), the data
   (:class:`~herald.job.data.JobData`, or the entry point's own: :class:`~herald.job.interfaces.JobInputs`)
   and its scheduler factory.
2. **Processes.** With ``--pin-cores`` the parts' local processes and this one get their
   cores (:meth:`JobRunner._plan_cores`). The PS part opens (starts or dials the shards),
   then the worker part (its dense store), and this process is pinned (until the job
   ends); the checkpoints restore the PS rows on resume; the job's :class:`JobSpec` names
   the shards, the workers' init method and the dense state to resume.
3. **Serve.** The dispatcher(s) bind where the worker part says (``herald train``: a
   private ipc socket, NOTE [local job sockets]; their liveness check: the PS part's,
   then the worker part's), load the resume point, the worker part starts the workers
   against their addresses, and the dispatcher(s) serve to the end of the data (SIGINT / SIGTERM
   stop them at a step where the entry point asks: :class:`~herald.job.serving.StopOnSignals`;
   herald/job/serving.py); the workers are waited for. A failure goes to the PS part's
   ``fail`` (:meth:`~herald.job.parts.base.PSProvider.fail`), which stops the workers and
   raises the job's error naming its cause.
4. **Finish.** With a report: the PS shards' stats, ``on_finish``, the held-out
   evaluation (once the worker part says every dense replica is written), then the data
   is closed and, once the local processes are reaped, the job's CPU time taken
   (:func:`herald.procs.cpu_seconds`: this process and its reaped children, from the
   start of :meth:`JobRunner.run`), and the report written (:class:`JobReport`, from the
   blocks of NOTE [report blocks] in herald/job/report/blocks.py). A clean stop on a signal
   raises :class:`JobInterrupted` after the report.

What differs between the entry points is only which parts they plug in (herald/job/parts/), their
hooks and run options (herald/job/interfaces.py):

- ``herald train``: :class:`LocalPS`, :class:`LocalWorkers`, checkpoints (resumable
  always), the report, progress, SIGINT / SIGTERM stop at a step; NOTE [ps failover]
  around it (:func:`herald.job.launcher.run_train`, the failover policy of NOTE [failover
  policy] in herald/job/recovery/policy.py).
- ``herald serve dispatcher``: :class:`RemotePS`, :class:`ExternalWorkers`, checkpoints
  with ``--checkpoint-every`` / ``--resume``, no report.
- the test bed's dispatcher: :class:`RemotePS`, ``TestBedWorkers`` (torchruns on other
  hosts), checkpoints, the report.
- ``herald bench dispatcher``: :class:`NoPS`, ``AckPeerWorkers`` (fake workers), its own
  data, neither checkpoints nor report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import sys
import time
from typing import Any

from herald.contracts.flags import flag_errors
from herald.contracts.job import JobSpec
from herald.contracts.train import TrainConfig
from herald.dispatch.config import DispatcherConfig
from herald.dispatch.records import StepRecord
from herald.errors import HeraldError
from herald.job import group_dispatch
from herald.job.checkpoints import DispatcherCheckpoints
from herald.job.data import JobData
from herald.job.interfaces import JobHooks, JobInputs, ReportedInputs, RunOptions
from herald.job.parts import Checkpointing, PSProvider, WorkerLauncher
from herald.job.report import CpuTime, GroupStreams, JobReport, Progress, ReportInputs, evaluate
from herald.job.serving import Layout, Served, Serving, StartupClock, process_started_at
from herald.procs import core_plan, cpu_seconds, pin_to_cores

# the runner's names that entry points and tests import from here
__all__ = [
    "JobInterrupted",
    "JobReport",
    "JobResult",
    "JobRunner",
    "Served",
    "StartupClock",
    "dispatcher_config",
    "process_started_at",
]


class JobInterrupted(HeraldError):
    """``herald train`` stopped cleanly on SIGINT or SIGTERM (report and final checkpoint
    written). ``exit_code`` is 128 + the signal number (130 SIGINT, 143 SIGTERM), what a
    shell reports for a process the signal ended; ``report`` is the job's report dict."""

    def __init__(self, interrupted: dict[str, Any], report: dict[str, Any], run_dir: pathlib.Path):
        self.report, self.signal_name, self.at_step = report, interrupted["signal"], interrupted["at_step"]
        self.exit_code = 128 + int(signal.Signals[self.signal_name])
        folder = interrupted.get("checkpoint")
        resume = (
            f"checkpoint {run_dir / 'checkpoints' / folder} written: continue with the same options and --resume"
            if folder is not None
            else "no checkpoint (run with --checkpoint-every STEPS to be able to --resume)"
        )
        super().__init__(
            f"interrupted by {self.signal_name} at step {self.at_step}; report in {run_dir / 'report.txt'}; {resume}"
        )


def dispatcher_config(cfg: TrainConfig, **overrides: Any) -> DispatcherConfig:
    """The :class:`DispatcherConfig` of a job: the job's settings (workers,
    ``--max-inflight-steps``, ``--timeout-ms``, ``--checkpoint-every``, keys, ``--batch-size``) with this
    dispatcher's ``overrides`` (``bind``, ``dispatcher_rank``, a group's ``num_workers``).
    The one place every dispatcher of a job is configured (:class:`JobRunner`).

    Raises:
        ConfigError: a setting out of range (named by its flag).
    """
    settings = dict(
        num_workers=cfg.workers,
        max_inflight_steps=cfg.inflight_steps,
        peer_timeout_ms=cfg.timeout_ms,
        checkpoint_every_steps=cfg.checkpoint_every,
        keys_dir=cfg.security.keys_dir,
        insecure=cfg.security.insecure,
        batch_size_per_worker=cfg.batch_size,
    )
    with flag_errors():
        return DispatcherConfig(**{**settings, **overrides})


@dataclasses.dataclass
class JobResult:
    """What :meth:`JobRunner.run` returns: ``records`` every step acked by all workers (one
    dispatcher per group: every group's, in the order their last ack arrived), ``served``
    the details, ``report`` the report dict (None: no report part)."""

    records: list[StepRecord]
    served: Served
    report: dict[str, Any] | None


@dataclasses.dataclass
class _Trained:
    """What training left for the report: the job's spec, the PS shards' stats (with a report)
    and the held-out evaluation's metrics (empty without one)."""

    job: JobSpec
    ps_stats: list[dict] | None
    metrics: dict[str, Any]


class JobRunner:
    """Runs one job from its settings to its report (NOTE [job runner]) with the parts given.

    Args:
        ps: the PS part (:mod:`herald.job.parts`); workers: the worker part.
        checkpoints: the checkpoint part, or None (no checkpoints, no ``--resume``).
        report: the report part, or None: no report, no evaluation, and the workers keep
            their dense replicas (the job's ``run_dir`` is None).
        data: what the job reads (:class:`~herald.job.interfaces.JobInputs`; with checkpoints
            also :class:`~herald.job.interfaces.ResumableInputs`, with a report or progress
            :class:`~herald.job.interfaces.ReportedInputs`: :class:`~herald.job.data.JobData` is
            all three); None: ``JobData`` of the settings.
        hooks: the entry point's callbacks (:class:`~herald.job.interfaces.JobHooks`: each step,
            the dispatchers once serving, the end of training); default: none.
        options: how this process runs the job (:class:`~herald.job.interfaces.RunOptions`: the
            dispatcher class and settings, progress, signals, the sample id log, the process's start).
    """

    def __init__(
        self,
        *,
        ps: PSProvider,
        workers: WorkerLauncher,
        checkpoints: Checkpointing | None = None,
        report: JobReport | None = None,
        data: JobInputs | None = None,
        hooks: JobHooks = JobHooks(),
        options: RunOptions = RunOptions(),
    ):
        self.ps, self.workers, self.checkpoints, self.report, self.data = ps, workers, checkpoints, report, data
        self.hooks, self.options = hooks, options
        self.serving = Serving(workers, options, hooks, self._liveness)

    def run(self, cfg: TrainConfig) -> JobResult:
        """Run the job ``cfg`` (NOTE [job runner]).

        Raises:
            ConfigError: bad settings; HeraldError: a process of the job failed (named, by
            the PS part's ``fail``); JobInterrupted: stopped by SIGINT / SIGTERM.
        """
        cpu0 = cpu_seconds()
        clock = StartupClock(self.options.started_at)
        layout = self._layout(cfg)
        self.ps.prepare(cfg)
        self.workers.prepare(cfg)
        # --resume: PS rows, dense state and the dispatcher's state (next step, next batch,
        # producer position) of the latest checkpoint (herald/job/checkpoints.py)
        ckpts = self.checkpoints.open(cfg) if self.checkpoints is not None else None
        rank = layout.dispatchers[0].dispatcher_rank
        data = self.data if self.data is not None else JobData(layout.data_cfg, dispatcher_rank=rank)
        try:
            served, trained = self._train(cfg, layout, data, ckpts, clock)
            served.cpu_s, served.cpu_scope = cpu_seconds() - cpu0, self._cpu_scope(cfg)  # children reaped
        except BaseException:
            data.close()
            raise
        records = group_dispatch.merge_records(served.records) if layout.grouped else served.records[0]
        rep = None
        if self.report is not None:
            rep = self._write_report(cfg, layout, data, served, records, trained, ckpts)
        if served.interrupted is not None:
            raise JobInterrupted(served.interrupted, rep, pathlib.Path(cfg.run_dir))
        return JobResult(records, served, rep)

    def _train(
        self,
        cfg: TrainConfig,
        layout: Layout,
        data: JobInputs,
        ckpts: DispatcherCheckpoints | None,
        clock: StartupClock,
    ) -> tuple[Served, _Trained]:
        """Steps 2 to 4 of NOTE [job runner] up to the report: the processes, serving, the
        evaluation; ``data`` closed once done (the caller closes it on a failure)."""
        with flag_errors():
            new_scheduler = data.scheduler_factory(layout.data_cfg)
        clock.mark("data_ready")
        t_start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            log = self.options.sample_id_log
            id_log = stack.enter_context(open(log, "ab")) if log else None
            job = self._open_parts(cfg, data, ckpts, stack, clock)
            bar = self._progress(layout.data_cfg, data)
            try:
                on_step = bar.update if bar is not None else None
                served = self.serving.serve(cfg, layout, data, job, ckpts, new_scheduler, on_step, id_log)
                self.workers.wait()
            except HeraldError as exc:
                self.ps.fail(exc, self.workers, self.serving.silence)
            except BaseException:
                self.workers.stop()
                raise
            finally:
                if bar is not None:
                    bar.close()
            served.train_s = time.perf_counter() - t_start
            served.startup = clock.milestones(served)
            trained = self._after_training(cfg, data, job)
            data.close()
        return served, trained

    def _open_parts(
        self,
        cfg: TrainConfig,
        data: JobInputs,
        ckpts: DispatcherCheckpoints | None,
        stack: contextlib.ExitStack,
        clock: StartupClock,
    ) -> JobSpec:
        """Step 2 of NOTE [job runner]: cores planned, the PS part then the worker part opened,
        this process pinned, the PS rows restored on resume; returns the job's spec."""
        my_cores = self._plan_cores(cfg)
        self.ps.open(cfg, data, stack)
        clock.mark("ps_ready")
        self.workers.open(cfg, stack)
        if my_cores is not None:  # after the shards started: they start with this process's cores
            stack.callback(pin_to_cores, sorted(os.sched_getaffinity(0)))
            pin_to_cores(my_cores)
        if ckpts is not None:
            ckpts.attach(self.ps.client, data)  # --resume: restores the PS rows first
        return JobSpec.build(cfg, data, self.ps.addresses).replace(
            dist_init=self.workers.dist_init,
            resume_dense=ckpts.resume_dense if ckpts is not None else None,
            **({} if self.report is not None else {"run_dir": None}),
        )

    def _progress(self, data_cfg: TrainConfig, data: ReportedInputs) -> Progress | None:
        """The progress bar over what one dispatcher serves (None: no progress at all)."""
        if self.options.progress is None:
            return None
        return Progress(
            data_cfg,
            enabled=self.options.progress,
            total_steps=data.total_steps(data_cfg),
            skipped=lambda: data.batches.skipped,
            lag=lambda: data.batches.lag.last,
        )

    def _layout(self, cfg: TrainConfig) -> Layout:
        """One dispatcher per group when ``cfg`` asks for independent groups and the worker part
        places them (NOTE [independent groups]: ``data_cfg`` is then a group's sub-job), else one
        dispatcher (``data_cfg`` is ``cfg``)."""
        if self.workers.places_groups and group_dispatch.independent_groups(cfg):
            sub = group_dispatch.group_config(cfg)
            disps = [
                dispatcher_config(cfg, num_workers=sub.workers, dispatcher_rank=g) for g in range(cfg.groups.count)
            ]
            return Layout(True, sub, disps)
        return Layout(False, cfg, [dispatcher_config(cfg, **self.options.dispatcher_settings)])

    def _plan_cores(self, cfg: TrainConfig) -> list[int] | None:
        """``--pin-cores``: give the parts' local processes their cores (:func:`~herald.procs.core_plan`
        over this process's cores: the workers first, so they get the larger blocks, then
        the PS shards, then this process with its dispatchers), say so in one line on
        stderr, and return this process's cores; None without ``--pin-cores``."""
        if not cfg.pin_cores:
            return None
        n_workers, n_ps = self.workers.local_processes(cfg), self.ps.local_processes(cfg)
        available = sorted(os.sched_getaffinity(0))
        plan = core_plan(n_workers + n_ps + 1, available)
        self.workers.cores, self.ps.cores = plan[:n_workers], plan[n_workers:-1]
        names = [f"worker-{r}" for r in range(n_workers)] + [f"ps-shard-{i}" for i in range(n_ps)] + ["dispatcher"]
        line = ", ".join(f"{name} on {','.join(map(str, cores))}" for name, cores in zip(names, plan))
        if len(plan) > len(available):
            line += f" ({len(plan)} processes on {len(available)} cores: some share a core, round-robin)"
        print(f"--pin-cores: {line}", file=sys.stderr, flush=True)
        return plan[-1]

    def _cpu_scope(self, cfg: TrainConfig) -> str:
        """Which processes the job's CPU time covers: this one and the parts' local ones
        (``"local processes (dispatcher, PS shards, workers)"`` for ``herald train``)."""
        roles = (("PS shards", self.ps.local_processes(cfg)), ("workers", self.workers.local_processes(cfg)))
        local = ", ".join(["dispatcher"] + [name for name, n in roles if n])
        external = " and ".join(name for name, n in roles if not n)
        return f"local processes ({local})" + (f"; not counted: {external} (external)" if external else "")

    def _after_training(self, cfg: TrainConfig, data: JobInputs, job: JobSpec) -> _Trained:
        """With the PS shards still up: their stats and the held-out evaluation (with a report
        only, and not of a ``--script`` job's model; ``metrics`` empty without eval rows), ``on_finish`` between."""
        ps_stats = self.ps.client.stats() if self.report is not None else None
        self.hooks.finished(list(self.ps.addresses), job)
        metrics: dict = {}
        # --script: the model is the script's, which herald cannot rebuild (NOTE [own script])
        if self.report is not None and data.eval_source is not None and cfg.script.path is None:
            self.workers.replicas_written(cfg)
            metrics = evaluate(job, data.eval_source, pathlib.Path(cfg.run_dir), self.ps.addresses)
        return _Trained(job, ps_stats, metrics)

    def _write_report(
        self,
        cfg: TrainConfig,
        layout: Layout,
        data: ReportedInputs,
        served: Served,
        records: list[StepRecord],
        trained: _Trained,
        ckpts: DispatcherCheckpoints | None,
    ) -> dict[str, Any]:
        """Step 4's report (NOTE [report blocks]) of the job's ``records`` (ack order); ``data``
        is closed (the skipped counts are final)."""
        skipped = {
            "train": dict(data.batches.skipped),
            "eval": dict(data.eval_source.stats["skipped"]) if data.eval_source is not None else {},
        }
        groups = None
        if layout.grouped:  # NOTE [independent groups]: each step is one group's, acked by that group's workers
            summary = group_dispatch.stream_summary(served.records, served.feeds, served.train_s)
            groups = GroupStreams(served.feeds[0].batch_rows, layout.data_cfg.workers, summary)
        inp = ReportInputs(
            cfg,
            records,
            served.train_s,
            trained.metrics,
            batches_info=data.batches.info,
            split_info=data.split_info,
            capacity_rows=served.capacity_rows,
            dispatcher_s=served.dispatcher_s,
            ps_stats=trained.ps_stats,
            skipped=skipped,
            interrupted=served.interrupted,
            scheduler=data.scheduler_stats(),
            groups=groups,
            cpu=CpuTime(served.cpu_s, served.cpu_scope, served.steady_cpu_s),  # this attempt's
            startup=served.startup,  # this attempt's milestones (StartupClock)
            replicated_tables=[trained.job.tables[t].name for t in data.replicated],
            tables=trained.job.tables,
            features=trained.job.feature_list,
            replica_rows=data.replica_rows,
            switched_from=ckpts.switched_from if ckpts is not None else None,  # NOTE [gba checkpoints]
            lag=data.batches.lag.summary(),  # NOTE [lag] in herald/loader/kafka/source.py
        )
        # one dispatcher per group: the job's steps in ack order (each group numbers its own from 0) for the plots
        plotted = [dataclasses.replace(r, step=i) for i, r in enumerate(records)] if layout.grouped else records
        return self.report.write(inp, plotted)

    def _liveness(self) -> None:
        """The dispatchers' liveness check: the PS part's, then the worker part's."""
        self.ps.check()
        self.workers.check()

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
   (:class:`~herald.job.data.JobData`, or the entry point's own) and its scheduler factory.
2. **Processes.** With ``--pin-cores`` the parts' local processes and this one get their
   cores (:meth:`JobRunner._plan_cores`). The PS part opens (starts or dials the shards),
   then the worker part (its dense store), and this process is pinned (until the job
   ends); the checkpoints restore the PS rows on resume; the job's :class:`JobSpec` names
   the shards, the workers' init method and the dense state to resume.
3. **Serve.** The dispatcher(s) bind where the worker part says (``herald train``: a
   private ipc socket, NOTE [local job sockets]; their liveness check: the PS part's,
   then the worker part's), load the resume point, the worker part starts the workers
   against their addresses, and the dispatcher(s) serve to the end of the data (SIGINT / SIGTERM
   stop them at a step where the entry point asks: :class:`StopOnSignals`); the workers
   are waited for. A failure goes to the PS part's ``fail`` (:meth:`parts.PSProvider.fail`),
   which stops the workers and raises the job's error naming its cause.
4. **Finish.** With a report: the PS shards' stats, ``on_finish``, the held-out
   evaluation (once the worker part says every dense replica is written), then the data
   is closed and, once the local processes are reaped, the job's CPU time taken
   (:func:`herald.procs.cpu_seconds`: this process and its reaped children, from the
   start of :meth:`JobRunner.run`), and the report written (:class:`JobReport`). A clean
   stop on a signal raises :class:`JobInterrupted` after the report.

What differs between the entry points is only which parts they plug in (herald/job/parts.py):

- ``herald train``: :class:`LocalPS`, :class:`LocalWorkers`, checkpoints (resumable
  always), the report, progress, SIGINT / SIGTERM stop at a step; NOTE [ps failover]
  around it (:func:`herald.job.launcher.run_train`).
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
import threading
import time
from collections.abc import Callable
from typing import Any

from herald.contracts.flags import flag_errors
from herald.contracts.job import JobSpec
from herald.contracts.train import TrainConfig
from herald.dispatch.config import DispatcherConfig
from herald.dispatch.dispatcher import Dispatcher
from herald.dispatch.peers import Silence
from herald.dispatch.records import StepRecord
from herald.errors import HeraldError
from herald.job import group_dispatch, report_comm
from herald.job import report as report_mod
from herald.job.data import JobData
from herald.job.parts import Checkpointing, PSProvider, WorkerLauncher
from herald.job.report_attempts import Attempt, attempts_block
from herald.job.silence import merge_silences
from herald.procs import core_plan, cpu_seconds, pin_to_cores, seconds_since_start, tree_cpu_seconds


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


class StopOnSignals:
    """While active, SIGINT and SIGTERM stop ``disp`` (a dispatcher, or anything with
    ``stop()``) at the next step boundary and interrupt ``data``'s reader; ``signum`` is the
    first signal received (None: none)."""

    def __init__(self, disp: Any, data: Any):
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


@dataclasses.dataclass
class Served:
    """What the dispatchers of one job did: ``records[g]`` dispatcher ``g``'s steps acked by
    all its workers, ``feeds[g]`` the batches it served (one dispatcher per group: its
    :class:`~herald.job.group_dispatch.GroupBatches`), its scheduler's cache rows, the
    dispatchers' busy seconds per stage (summed), the signal stop (None: none), the
    seconds from the start of the PS part to the workers' end, the job's CPU seconds
    (user + sys) and which processes they cover (``cpu_scope``), and the start-up
    milestones (:class:`StartupClock`)."""

    records: list[list[StepRecord]]
    feeds: list[Any]
    capacity_rows: int
    dispatcher_s: dict[str, float]
    interrupted: dict[str, Any] | None
    train_s: float = 0.0
    cpu_s: float = 0.0
    cpu_scope: str = ""
    steady_cpu_s: float | None = None  # NOTE [steady cpu]; None: no step acked
    startup: dict[str, float] = dataclasses.field(default_factory=dict)
    hellos_at: float | None = None  # perf_counter() when the last dispatcher had every hello


class StartupClock:
    """The job's start-up as milestones: seconds from ``origin`` (``time.perf_counter()``
    when the ``herald train`` process started: :func:`process_started_at`; None: now) to
    ``imported`` (this object made: the interpreter and herald's imports; only with an
    ``origin``), ``data_ready`` (the source opened, its pre-pass and the scheduler),
    ``ps_ready`` (every PS shard serving), ``workers_ready`` (every worker said hello:
    started, imported, connected) and ``first_step`` (the first step acked by every
    worker). Milestones, not spans: the parts may start in parallel."""

    def __init__(self, origin: float | None = None):
        now = time.perf_counter()
        self.origin = now if origin is None else origin
        self.marks = {} if origin is None else {"imported": now - origin}

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter() - self.origin

    def milestones(self, served: Served) -> dict[str, float]:
        """Every milestone reached, in seconds (rounded to ms)."""
        out = dict(self.marks)
        if served.hellos_at is not None:
            out["workers_ready"] = served.hellos_at - self.origin
        first = next((r.acked_at for recs in served.records for r in recs[:1] if r.acked_at), None)
        if first is not None:
            out["first_step"] = first - self.origin
        return {k: round(v, 3) for k, v in out.items()}


def process_started_at() -> float:
    """``time.perf_counter()`` when this process started (:func:`~herald.procs.seconds_since_start`)."""
    return time.perf_counter() - seconds_since_start()


@dataclasses.dataclass
class JobResult:
    """What :meth:`JobRunner.run` returns: ``records`` every step acked by all workers (one
    dispatcher per group: every group's, in the order their last ack arrived), ``served``
    the details, ``report`` the report dict (None: no report part)."""

    records: list[StepRecord]
    served: Served
    report: dict[str, Any] | None


class JobReport:
    """The report part: after training the PS shards' stats and the held-out evaluation are
    taken, and ``report.txt``, ``report.json`` and ``report.png`` are written to the run
    folder (herald/job/report.py). ``failovers``: the report's ``failovers`` (the earlier
    attempts' of NOTE [ps failover]; the test bed's supervisor writes its own); ``earlier``:
    those attempts' steps and times, counted in the report with this one's
    (herald/job/report_attempts.py)."""

    def __init__(self, failovers: list[dict[str, Any]] | None = None, earlier: list[Attempt] | None = None):
        self.failovers = [] if failovers is None else failovers
        self.earlier = [] if earlier is None else earlier

    def write(
        self,
        cfg: TrainConfig,
        data: Any,
        served: Served,
        records: list[StepRecord],
        *,
        grouped: bool,
        ps_stats: list[dict] | None,
        metrics: dict,
        switched_from: str | None,
    ) -> dict[str, Any]:
        """Build the report of the job ``cfg`` (``records``: its steps, ack order), write it
        into ``cfg.run_dir`` and return it; ``data`` is closed (the skipped counts are final)."""
        skipped = {
            "train": dict(data.batches.skipped),
            "eval": dict(data.eval_source.stats["skipped"]) if data.eval_source is not None else {},
        }
        rep = report_mod.build(
            cfg,
            records,
            served.train_s,
            metrics,
            batches_info=data.batches.info,
            split_info=data.split_info,
            capacity_rows=served.capacity_rows,
            dispatcher_s=served.dispatcher_s,
            ps_stats=ps_stats,
            skipped=skipped,
            interrupted=served.interrupted,
            scheduler=data.scheduler_stats(),
        )
        if grouped:  # NOTE [independent groups]: samples/s of all groups, and each group's stream
            report_comm.fix_group_samples(rep, records, served.feeds[0].batch_rows, served.train_s)
            rep["group_streams"] = group_dispatch.stream_summary(served.records, served.feeds, served.train_s)
            # each step is one group's, acked by that group's workers
            rep.update(
                report_mod.ps_requests(
                    records, group_dispatch.group_config(cfg).workers, len(ps_stats) if ps_stats else cfg.num_ps_shards
                )
            )
        rep.update(
            report_mod.cpu_time(
                served.cpu_s,
                rep["samples"],
                served.cpu_scope,  # this attempt's
                served.steady_cpu_s,
                max(0, rep["steps"] - 1) * cfg.global_batch,
            )
        )
        rep["startup"] = served.startup  # this attempt's milestones (StartupClock)
        rep.update(attempts_block(rep, [r.step for r in records], self.earlier, cfg.global_batch))
        rep["replicated_tables"] = [data.schema.table_names[t] for t in data.replicated]
        rep["replica_rows_per_worker"] = data.replica_rows
        rep["failovers"] = self.failovers
        rep["consistency"]["switched_from"] = switched_from  # --resume under another mode (NOTE [gba checkpoints])
        # one dispatcher per group: the job's steps in ack order (each group numbers its own from 0) for the plots
        plotted = [dataclasses.replace(r, step=i) for i, r in enumerate(records)] if grouped else records
        report_mod.write(rep, plotted, pathlib.Path(cfg.run_dir))
        return rep


class JobRunner:
    """Runs one job from its settings to its report (NOTE [job runner]) with the parts given.

    Args:
        ps: the PS part (:mod:`herald.job.parts`); workers: the worker part.
        checkpoints: the checkpoint part, or None (no checkpoints, no ``--resume``).
        report: the report part, or None: no report, no evaluation, and the workers keep
            their dense replicas (the job's ``run_dir`` is None).
        data: what the job reads (a :class:`~herald.job.data.JobData` or an object with its
            ``schema``, ``dataset``, ``replicated``, ``replica_rows``, ``batches``,
            ``eval_source``, ``scheduler_factory``, ``interrupt`` and ``close``); None:
            ``JobData`` of the settings.
        dispatcher: the dispatcher class (tests wrap it).
        dispatcher_settings: this process's dispatcher settings (``bind``, ``dispatcher_rank``).
        progress: show the progress bar (False: its progressive validation only); None: no
            progress at all.
        stop_on_signals: SIGINT / SIGTERM stop the job at a step (report written, then
            :class:`JobInterrupted`); False: the signals keep their handlers.
        on_step: called with each step's :class:`StepRecord` (after the progress bar).
        on_serve: called with the dispatchers once the workers are started, before serving.
        on_finish: ``on_finish(ps_addresses, job)`` after the workers ended, while the PS
            shards are still up (tests read the trained rows there).
        sample_id_log: append the sample ids of every acked step to this file.
        started_at: ``time.perf_counter()`` when this job's own process started (``herald
            train``): the report's start-up milestones count from it, ``imported`` first;
            None (a job run inside a longer-lived process): from :meth:`run`.
    """

    def __init__(
        self,
        *,
        ps: PSProvider,
        workers: WorkerLauncher,
        checkpoints: Checkpointing | None = None,
        report: JobReport | None = None,
        data: Any = None,
        dispatcher: Callable[..., Any] = Dispatcher,
        dispatcher_settings: dict[str, Any] | None = None,
        progress: bool | None = None,
        stop_on_signals: bool = False,
        on_step: Callable[[StepRecord], None] | None = None,
        on_serve: Callable[[list], None] | None = None,
        on_finish: Callable[[list, JobSpec], None] | None = None,
        sample_id_log: str | pathlib.Path | None = None,
        started_at: float | None = None,
    ):
        self.ps, self.workers, self.checkpoints, self.report, self.data = ps, workers, checkpoints, report, data
        self.dispatcher, self.dispatcher_settings = dispatcher, dict(dispatcher_settings or {})
        self.progress, self.stop_on_signals = progress, stop_on_signals
        self.on_step, self.on_serve, self.on_finish, self.sample_id_log = on_step, on_serve, on_finish, sample_id_log
        self.started_at = started_at
        #: what the dispatchers' failed wait saw (NOTE [silent workers] in herald/job/silence.py)
        self._silence: Silence | None = None

    def run(self, cfg: TrainConfig) -> JobResult:
        """Run the job ``cfg`` (NOTE [job runner]).

        Raises:
            ConfigError: bad settings; HeraldError: a process of the job failed (named, by
            the PS part's ``fail``); JobInterrupted: stopped by SIGINT / SIGTERM.
        """
        ps, workers = self.ps, self.workers
        cpu0 = cpu_seconds()
        clock = StartupClock(self.started_at)
        grouped, data_cfg, disp_cfgs = self._layout(cfg)
        ps.prepare(cfg)
        workers.prepare(cfg)
        # --resume: PS rows, dense state and the dispatcher's state (next step, next batch,
        # producer position) of the latest checkpoint (herald/job/checkpoints.py)
        ckpts = self.checkpoints.open(cfg) if self.checkpoints is not None else None
        data = self.data if self.data is not None else JobData(data_cfg, dispatcher_rank=disp_cfgs[0].dispatcher_rank)
        try:
            with flag_errors():
                new_scheduler = data.scheduler_factory(data_cfg)
            clock.mark("data_ready")
            t_start = time.perf_counter()
            with contextlib.ExitStack() as stack:
                id_log = stack.enter_context(open(self.sample_id_log, "ab")) if self.sample_id_log else None
                my_cores = self._plan_cores(cfg)
                ps.open(cfg, data, stack)
                clock.mark("ps_ready")
                workers.open(cfg, stack)
                if my_cores is not None:  # after the shards started: they start with this process's cores
                    stack.callback(pin_to_cores, sorted(os.sched_getaffinity(0)))
                    pin_to_cores(my_cores)
                if ckpts is not None:
                    ckpts.attach(ps.client, data)  # --resume: restores the PS rows first
                job = JobSpec.build(cfg, data, ps.addresses).replace(
                    dist_init=workers.dist_init,
                    resume_dense=ckpts.resume_dense if ckpts is not None else None,
                    **({} if self.report is not None else {"run_dir": None}),
                )
                bar = (
                    report_mod.Progress(
                        data_cfg,
                        enabled=self.progress,
                        total_steps=data.total_steps(data_cfg),
                        skipped=lambda: data.batches.skipped,
                    )
                    if self.progress is not None
                    else None
                )
                try:
                    served = self._serve(
                        cfg, data_cfg, data, job, ckpts, disp_cfgs, new_scheduler, bar, id_log, grouped
                    )
                    workers.wait()
                except HeraldError as exc:
                    ps.fail(exc, workers, self._silence)
                except BaseException:
                    workers.stop()
                    raise
                finally:
                    if bar is not None:
                        bar.close()
                served.train_s = time.perf_counter() - t_start
                served.startup = clock.milestones(served)
                ps_stats, metrics = self._after_training(cfg, data, job)
                data.close()
            served.cpu_s, served.cpu_scope = cpu_seconds() - cpu0, self._cpu_scope(cfg)  # children reaped
        except BaseException:
            data.close()
            raise
        records = group_dispatch.merge_records(served.records) if grouped else served.records[0]
        rep = None
        if self.report is not None:
            rep = self.report.write(
                cfg,
                data,
                served,
                records,
                grouped=grouped,
                ps_stats=ps_stats,
                metrics=metrics,
                switched_from=ckpts.switched_from if ckpts is not None else None,
            )
        if served.interrupted is not None:
            raise JobInterrupted(served.interrupted, rep, pathlib.Path(cfg.run_dir))
        return JobResult(records, served, rep)

    def _layout(self, cfg: TrainConfig) -> tuple[bool, TrainConfig, list[DispatcherConfig]]:
        """``(grouped, data_cfg, dispatcher configs)``: one dispatcher per group when ``cfg``
        asks for independent groups and the worker part places them (NOTE [independent
        groups]: ``data_cfg`` is then a group's sub-job), else one dispatcher (``data_cfg`` is ``cfg``)."""
        if self.workers.places_groups and group_dispatch.independent_groups(cfg):
            sub = group_dispatch.group_config(cfg)
            return (
                True,
                sub,
                [dispatcher_config(cfg, num_workers=sub.workers, dispatcher_rank=g) for g in range(cfg.groups.count)],
            )
        return False, cfg, [dispatcher_config(cfg, **self.dispatcher_settings)]

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

    def _after_training(self, cfg: TrainConfig, data: Any, job: JobSpec) -> tuple[list[dict] | None, dict]:
        """With the PS shards still up: ``(ps_stats, metrics)``, their stats and the held-out
        evaluation (with a report only; ``metrics`` empty without eval rows), ``on_finish`` between."""
        ps_stats = self.ps.client.stats() if self.report is not None else None
        if self.on_finish is not None:
            self.on_finish(list(self.ps.addresses), job)
        metrics: dict = {}
        if self.report is not None and data.eval_source is not None:
            self.workers.replicas_written(cfg)
            metrics = report_mod.evaluate(job, data.eval_source, pathlib.Path(cfg.run_dir), self.ps.addresses)
        return ps_stats, metrics

    def _liveness(self) -> None:
        """The dispatchers' liveness check: the PS part's, then the worker part's."""
        self.ps.check()
        self.workers.check()

    def _serve(
        self,
        cfg: TrainConfig,
        data_cfg: TrainConfig,
        data: Any,
        job: JobSpec,
        ckpts: Any,
        disp_cfgs: list[DispatcherConfig],
        new_scheduler: Callable[[], Any],
        bar: Any,
        id_log: Any,
        grouped: bool,
    ) -> Served:
        """Bind the dispatchers, start the workers and serve the job to its end (``data_cfg``:
        what one dispatcher serves, a group's sub-job when ``grouped``)."""
        with contextlib.ExitStack() as stack:
            if grouped:  # NOTE [independent groups]: each group's dispatcher takes its own share of one stream
                shared = group_dispatch.SharedBatches(data.batches)
                feeds = [group_dispatch.GroupBatches(shared, g, data_cfg.global_batch) for g in range(len(disp_cfgs))]
                jobs = [job.replace(group_index=g) for g in range(len(disp_cfgs))]
            else:
                shared, feeds, jobs = None, [data.batches], [job]
            steady = SteadyCpu()
            on_step = _chain(bar.update if bar is not None else None, self.on_step, steady.first_step, threads=grouped)
            extra = ckpts.dispatcher_kwargs() if ckpts is not None else {}
            # bound where the worker part says its workers reach them (herald train: private ipc sockets)
            binds = [self.workers.dispatcher_bind(g) for g in range(len(disp_cfgs))]
            disp_cfgs = [c if b is None else dataclasses.replace(c, bind=b) for c, b in zip(disp_cfgs, binds)]
            disps = [
                stack.enter_context(
                    self.dispatcher(
                        c,
                        feed,
                        new_scheduler,
                        j,
                        on_step=on_step,
                        **extra,
                        liveness=self._liveness,
                        sample_id_log=id_log,
                    )
                )
                for c, feed, j in zip(disp_cfgs, feeds, jobs)
            ]
            everyone = group_dispatch.AllDispatchers(disps, shared) if grouped else disps[0]
            stopper = stack.enter_context(StopOnSignals(everyone, data)) if self.stop_on_signals else None
            if ckpts is not None:
                ckpts.load(disps[0])  # one dispatcher: independent groups take no checkpoints
            self.workers.start(cfg, job, [d.address for d in disps])
            if self.on_serve is not None:
                self.on_serve(disps)
            try:
                records = group_dispatch.serve_all(disps, everyone) if grouped else [disps[0].serve()]
                steady.end()
            except HeraldError:  # dispatcher g's rank r is worker g * k + r (one dispatcher: r)
                self._silence = merge_silences(
                    [d.silence() for d in disps], [g * disp_cfgs[0].num_workers for g in range(len(disps))]
                )
                raise
            interrupted = None
            if stopper is not None and stopper.signum is not None:
                # at_step: steps trained = where --resume continues; checkpoint: its folder
                done = disps[0].checkpoints if ckpts is not None and ckpts.enabled and not grouped else []
                interrupted = {
                    "signal": signal.Signals(stopper.signum).name,
                    "at_step": sum(len(r) for r in records) if grouped else disps[0].next_step,
                    "checkpoint": f"step-{done[-1]:08d}" if done else None,
                }
            dispatcher_s: dict[str, float] = {}
            for d in disps:
                for name, ms in d.timer.take().items():
                    dispatcher_s[name] = dispatcher_s.get(name, 0.0) + ms / 1e3
            hellos = [d.hellos_at for d in disps if d.hellos_at is not None]
            return Served(
                records,
                feeds,
                disps[0].scheduler.capacity_rows,
                dispatcher_s,
                interrupted,
                hellos_at=max(hellos) if len(hellos) == len(disps) else None,
                steady_cpu_s=steady.seconds,
            )


# NOTE [steady cpu]
# ~~~~~~~~~~~~~~~~~
# ``cpu_seconds`` is the whole job's CPU: start-up (every process imports torch and loads
# its kernels; a worker's first optimizer step imports torch._dynamo), training, the
# final flush, the held-out evaluation and the report. The steady figure is what training
# costs per sample once running, as ``samples_per_second`` is its steady throughput: the
# CPU of every local process (:func:`herald.procs.tree_cpu_seconds`) from the first
# step's record to the end of serving (the final flush in it), over the samples of the
# steps after the first. It is what a single process's training loop measures (the
# plain-PyTorch baseline of ``herald bench scale``: its CPU over its loop). On 2 cores, a
# 2-worker job of 1.2M synthetic rows spent 19 s of its 99 s outside it.
class SteadyCpu:
    """The CPU seconds of the job's local processes from the first step's record to
    :meth:`end` (NOTE [steady cpu]); ``seconds`` None until then."""

    def __init__(self):
        self._first: float | None = None
        self.seconds: float | None = None

    def first_step(self, rec: StepRecord) -> None:
        """``on_step``: read the CPU at the first record."""
        if self._first is None:
            self._first = tree_cpu_seconds()

    def end(self) -> None:
        """Serving ended: the CPU since the first record."""
        if self._first is not None:
            self.seconds = tree_cpu_seconds() - self._first


def _chain(*calls: Callable[[StepRecord], None] | None, threads: bool) -> Callable[[StepRecord], None] | None:
    """One ``on_step`` calling each of ``calls`` (None ones left out) in turn; ``threads``:
    the dispatchers call it from several threads (one per group), so the calls are serialised."""
    calls = tuple(c for c in calls if c is not None)
    if not calls:
        return None
    if len(calls) == 1 and not threads:
        return calls[0]
    lock = threading.Lock()

    def on_step(rec: StepRecord) -> None:
        with lock:
            for call in calls:
                call(rec)

    return on_step

"""Serving one job (step 3 of NOTE [job runner] in herald/job/runner.py): the dispatchers
bound where the worker part says, the resume point loaded, the workers started and the job
served to its end (:class:`Serving`), with what it did (:class:`Served`), its start-up
milestones (:class:`StartupClock`), its steady CPU (:class:`SteadyCpu`) and the clean stop
on SIGINT / SIGTERM (:class:`StopOnSignals`)."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from herald.contracts.job import JobSpec
from herald.contracts.train import TrainConfig
from herald.dispatch.config import DispatcherConfig
from herald.dispatch.peers import Silence
from herald.dispatch.records import StepRecord
from herald.errors import HeraldError
from herald.job import group_dispatch
from herald.job.checkpoints import DispatcherCheckpoints
from herald.job.interfaces import JobHooks, JobInputs, RunOptions
from herald.job.parts import WorkerLauncher
from herald.job.recovery.silence import merge_silences
from herald.procs import seconds_since_start, tree_cpu_seconds


@dataclasses.dataclass(frozen=True)
class Layout:
    """The dispatchers of a job: ``grouped`` (one per group: NOTE [independent groups] in
    herald/job/group_dispatch.py), ``data_cfg`` (what one dispatcher serves: a group's sub-job
    when grouped, else the job's settings) and ``dispatchers`` (one :class:`DispatcherConfig` each)."""

    grouped: bool
    data_cfg: TrainConfig
    dispatchers: list[DispatcherConfig]


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


def chain(*calls: Callable[[StepRecord], None] | None, threads: bool) -> Callable[[StepRecord], None] | None:
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


class Serving:
    """Serves one job (step 3 of NOTE [job runner]): binds its dispatchers where ``workers``
    (the worker part) says, loads the resume point, starts the workers and serves to the end
    of the data (or a signal's stop, with ``options.stop_on_signals``). ``liveness``: the
    dispatchers' liveness check. After a failed wait, :attr:`silence` is what the dispatchers
    saw (NOTE [silent workers] in herald/job/recovery/silence.py)."""

    def __init__(self, workers: WorkerLauncher, options: RunOptions, hooks: JobHooks, liveness: Callable[[], None]):
        self.workers, self.options, self.hooks, self.liveness = workers, options, hooks, liveness
        self.silence: Silence | None = None

    def serve(
        self,
        cfg: TrainConfig,
        layout: Layout,
        data: JobInputs,
        job: JobSpec,
        ckpts: DispatcherCheckpoints | None,
        new_scheduler: Callable[[], Any],
        on_step: Callable[[StepRecord], None] | None,
        sample_id_log: Any,
    ) -> Served:
        """Serve ``job`` (its settings ``cfg``, dispatchers ``layout``) to its end; ``on_step``
        (the progress bar's) runs before the hooks' own.

        Raises:
            HeraldError: a dispatcher's wait failed (:attr:`silence` says what it saw).
        """
        with contextlib.ExitStack() as stack:
            shared, feeds, jobs = self._feeds(layout, data, job)
            steady = SteadyCpu()
            calls = chain(on_step, self.hooks.on_step, steady.first_step, threads=layout.grouped)
            disps = self._bind(stack, layout, feeds, jobs, new_scheduler, ckpts, calls, sample_id_log)
            everyone = group_dispatch.AllDispatchers(disps, shared) if layout.grouped else disps[0]
            stopper = stack.enter_context(StopOnSignals(everyone, data)) if self.options.stop_on_signals else None
            if ckpts is not None:
                ckpts.load(disps[0])  # one dispatcher: independent groups take no checkpoints
            self.workers.start(cfg, job, [d.address for d in disps])
            self.hooks.served(disps)
            records = self._serve_all(disps, everyone, layout)
            steady.end()
            served = _served(disps, records, feeds, steady)
            served.interrupted = _interrupted(stopper, disps, records, ckpts, layout.grouped)
            return served

    @staticmethod
    def _feeds(layout: Layout, data: JobInputs, job: JobSpec) -> tuple[Any, list[Any], list[JobSpec]]:
        """``(shared stream, each dispatcher's batches, each one's job)``: one dispatcher per group
        takes its own share of one stream (NOTE [independent groups])."""
        if not layout.grouped:
            return None, [data.batches], [job]
        n, rows = len(layout.dispatchers), layout.data_cfg.global_batch
        shared = group_dispatch.SharedBatches(data.batches)
        feeds = [group_dispatch.GroupBatches(shared, g, rows) for g in range(n)]
        return shared, feeds, [job.replace(group_index=g) for g in range(n)]

    def _bind(self, stack, layout, feeds, jobs, new_scheduler, ckpts, on_step, sample_id_log) -> list[Any]:
        """The dispatchers, bound where the worker part says its workers reach them (``herald
        train``: private ipc sockets, NOTE [local job sockets]), left when ``stack`` ends."""
        extra = ckpts.dispatcher_kwargs() if ckpts is not None else {}
        binds = [self.workers.dispatcher_bind(g) for g in range(len(layout.dispatchers))]
        configs = [c if b is None else dataclasses.replace(c, bind=b) for c, b in zip(layout.dispatchers, binds)]
        return [
            stack.enter_context(
                self.options.dispatcher(
                    c,
                    feed,
                    new_scheduler,
                    j,
                    on_step=on_step,
                    **extra,
                    liveness=self.liveness,
                    sample_id_log=sample_id_log,
                )
            )
            for c, feed, j in zip(configs, feeds, jobs)
        ]

    def _serve_all(self, disps: list[Any], everyone: Any, layout: Layout) -> list[list[StepRecord]]:
        """Each dispatcher's records; a failed wait keeps what the dispatchers saw in :attr:`silence`."""
        try:
            return group_dispatch.serve_all(disps, everyone) if layout.grouped else [disps[0].serve()]
        except HeraldError:  # dispatcher g's rank r is worker g * k + r (one dispatcher: r)
            k = layout.dispatchers[0].num_workers
            self.silence = merge_silences([d.silence() for d in disps], [g * k for g in range(len(disps))])
            raise


def _served(disps: list[Any], records: list[list[StepRecord]], feeds: list[Any], steady: SteadyCpu) -> Served:
    """What the dispatchers did: their records and feeds, the cache rows, busy seconds per stage
    (summed over dispatchers), when the last one had every hello, the steady CPU."""
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
        None,
        hellos_at=max(hellos) if len(hellos) == len(disps) else None,
        steady_cpu_s=steady.seconds,
    )


def _interrupted(
    stopper: StopOnSignals | None,
    disps: list[Any],
    records: list[list[StepRecord]],
    ckpts: DispatcherCheckpoints | None,
    grouped: bool,
) -> dict[str, Any] | None:
    """The report's ``interrupted`` after a signal's stop (None: no signal): ``signal``, ``at_step``
    (steps trained = where --resume continues) and ``checkpoint`` (its folder, or None)."""
    if stopper is None or stopper.signum is None:
        return None
    done = disps[0].checkpoints if ckpts is not None and ckpts.enabled and not grouped else []
    return {
        "signal": signal.Signals(stopper.signum).name,
        "at_step": sum(len(r) for r in records) if grouped else disps[0].next_step,
        "checkpoint": f"step-{done[-1]:08d}" if done else None,
    }

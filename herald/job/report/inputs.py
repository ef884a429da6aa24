"""The one set of inputs every block of the report is built from (:class:`ReportInputs`), with
the figures of this attempt that several blocks share (steps, samples, the steady span)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from herald.dispatch.records import StepRecord


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One attempt of a job that a lost PS shard or worker ended: ``steps`` the job steps every worker
    acked in it (int, ack order), ``seconds`` from its start to its failure."""

    steps: tuple[int, ...]
    seconds: float


@dataclasses.dataclass(frozen=True)
class GroupStreams:
    """One dispatcher per group (NOTE [independent groups] in herald/job/group_dispatch.py), as
    the report needs it: ``batch_rows`` (int) samples in one group's step, ``workers`` (int)
    acking each step (one group's), ``summary`` the report's ``group_streams`` dict (per group:
    steps, samples, samples/s, final loss, batches taken of the shared stream)."""

    batch_rows: int
    workers: int
    summary: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class CpuTime:
    """The job's CPU time as measured by the runner: ``seconds`` (user + sys, s) of the processes
    ``scope`` names, and ``steady_s`` the seconds from the first step's record to the end of
    serving (NOTE [steady cpu] in herald/job/serving.py; None: no step acked)."""

    seconds: float
    scope: str
    steady_s: float | None = None


@dataclasses.dataclass(frozen=True)
class ReportInputs:
    """What the report of one attempt of a job is built from (every block reads these).

    Args:
        cfg: the job's :class:`~herald.contracts.train.TrainConfig`.
        records: this attempt's steps acked by every worker, in ack order (one dispatcher per
            group: every group's, merged).
        train_s: seconds from the start of the PS part to the workers' end.
        metrics: the held-out evaluation (:func:`herald.job.report.evaluate.evaluate`; empty
            without eval rows).
        batches_info: the producer's ``info`` (``dropped_samples``: the partial last batch).
        split_info: ``total_rows``, ``train_rows``, ``eval_rows`` (None: unknown, a stream).
        capacity_rows: the scheduler's cache rows per worker.
        dispatcher_s: seconds per dispatcher stage over the job (summed over dispatchers).
        ps_stats: one ``stats`` dict per PS shard, taken after training (None: not taken).
        skipped: bad records skipped, ``{"train": {reason: count}, "eval": {...}}`` (NOTE [bad records]).
        interrupted: ``{"signal", "at_step", "checkpoint"}`` when a signal stopped the job.
        scheduler: :meth:`herald.job.data.JobData.scheduler_stats`.
        groups: the dispatchers per group, or None (one dispatcher).
        cpu: the job's CPU time, or None (not measured).
        startup: the start-up milestones in seconds (:class:`herald.job.serving.StartupClock`).
        earlier: the attempts a failover ended before this one (NOTE [ps failover]).
        failovers: the report's ``failovers``, one dict per rollback (NOTE [failover policy]).
        replicated_tables: names of the tables replicated on every worker; replica_rows: their rows.
        tables, features: the job's tables and features (``JobSpec.tables`` / ``feature_list``:
            NOTE [tables and features] in herald/contracts/features.py); empty: not known.
        switched_from: the consistency mode of the checkpoint this job resumed under another mode.
        lag: the stream's lag over the job (:meth:`herald.loader.lag.LagHistory.summary`;
            None: the source has no end to be behind, or no lag was sampled).
    """

    cfg: Any
    records: Sequence[StepRecord]
    train_s: float
    metrics: dict[str, Any]
    batches_info: dict[str, Any]
    split_info: dict[str, Any]
    capacity_rows: int
    dispatcher_s: dict[str, float] | None = None
    ps_stats: list[dict] | None = None
    skipped: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    interrupted: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    groups: GroupStreams | None = None
    cpu: CpuTime | None = None
    startup: dict[str, float] = dataclasses.field(default_factory=dict)
    earlier: Sequence[Attempt] = ()
    failovers: Sequence[dict[str, Any]] = ()
    replicated_tables: Sequence[str] = ()
    replica_rows: int = 0
    tables: Sequence[Any] = ()
    features: Sequence[Any] = ()
    switched_from: str | None = None
    lag: dict[str, Any] | None = None

    @property
    def steps(self) -> int:
        """Steps of this attempt."""
        return len(self.records)

    @property
    def batch_rows(self) -> int:
        """Samples in one step: the global batch, or one group's (one dispatcher per group)."""
        return self.groups.batch_rows if self.groups is not None else self.cfg.global_batch

    @property
    def samples(self) -> int:
        """Samples this attempt trained."""
        return self.steps * self.batch_rows

    @property
    def workers_per_step(self) -> int:
        """Workers acking each step: the job's, or one group's."""
        return self.groups.workers if self.groups is not None else self.cfg.workers

    @property
    def shards(self) -> int:
        """PS shards: one ``ps_stats`` entry each, else the job's ``--ps-shards``."""
        return len(self.ps_stats) if self.ps_stats else self.cfg.num_ps_shards

    @functools.cached_property
    def steady_s(self) -> float:
        """Seconds from the first step's ack to the last's (0.0 with fewer than two steps)."""
        return self.records[-1].acked_at - self.records[0].acked_at if self.steps > 1 else 0.0

    @property
    def samples_per_second(self) -> float:
        """Steady throughput: the samples of steps 1..n over :attr:`steady_s` (nan without it)."""
        return (self.steps - 1) * self.batch_rows / self.steady_s if self.steady_s > 0 else float("nan")

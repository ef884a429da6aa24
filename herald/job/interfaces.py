"""What :class:`herald.job.runner.JobRunner` takes besides its parts: the job's data (the
protocols :class:`JobInputs`, :class:`ResumableInputs`, :class:`ReportedInputs`, which
:class:`herald.job.data.JobData` implements), the entry point's callbacks (:class:`JobHooks`)
and how this process runs the job (:class:`RunOptions`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from herald.contracts.job import JobSpec
from herald.dispatch.dispatcher import Dispatcher
from herald.dispatch.records import StepRecord
from herald.loader.batch import SampleBatch, Schema


class JobBatches(Protocol):
    """The global batches a job's dispatcher serves (a :class:`herald.loader.global_batches.GlobalBatches`):
    an iterator of :class:`SampleBatch`, with the bad records ``skipped`` so far per reason and
    its ``info`` (``dropped_samples``: the partial last batch)."""

    skipped: Mapping[str, int]
    info: dict[str, Any]

    def __iter__(self) -> Iterator[SampleBatch]: ...

    def close(self, timeout_s: float = 5.0) -> None: ...


class JobInputs(Protocol):
    """What the runner reads of every job's data: the source's ``schema`` (its tables and dense
    width), its ``dataset`` (format name; ``--model auto`` picks its model; None: none), the
    tables replicated on every worker (``replicated``: table indices; ``replica_rows``: their
    rows), the global ``batches``, the held-out ``eval_source`` (None: none), a factory of
    schedulers (:meth:`scheduler_factory`), :meth:`interrupt` (a signal: a blocked read returns)
    and :meth:`close` (the producer and its source; idempotent)."""

    schema: Schema
    dataset: str | None
    replicated: Sequence[int]
    replica_rows: int
    batches: JobBatches
    eval_source: Any

    def scheduler_factory(self, cfg: Any) -> Callable[[], Any]: ...

    def interrupt(self) -> None: ...

    def close(self, timeout_s: float = 5.0) -> None: ...


class ResumableInputs(JobInputs, Protocol):
    """A job's data its checkpoints resume (with a checkpoint part): the source's JSON-able
    position after a batch (None: a file, the batch index says it all) and its commit (Kafka)."""

    def position(self, batch_index: int) -> Any: ...

    def commit(self, batch_index: int) -> None: ...


class ReportedInputs(JobInputs, Protocol):
    """A job's data its report and progress bar read: the rows of each split
    (``split_info``), the scheduler's settings and adaptive LAIA's k (:meth:`scheduler_stats`)
    and the steps the job will train (:meth:`total_steps`, None: unbounded)."""

    split_info: dict[str, Any]

    def scheduler_stats(self) -> dict[str, Any] | None: ...

    def total_steps(self, cfg: Any) -> int | None: ...


@dataclasses.dataclass(frozen=True)
class JobHooks:
    """The entry point's callbacks into a running job; each one None does nothing.

    Args:
        on_step: ``on_step(record)`` with each step acked by every worker (a
            :class:`~herald.dispatch.records.StepRecord`), after the progress bar; with one
            dispatcher per group the calls are serialised.
        on_serve: ``on_serve(dispatchers)`` once the workers are started, before serving.
        on_finish: ``on_finish(ps_addresses, job)`` after the workers ended, while the PS
            shards are still up (tests read the trained rows there).
    """

    on_step: Callable[[StepRecord], None] | None = None
    on_serve: Callable[[list[Any]], None] | None = None
    on_finish: Callable[[list[str], JobSpec], None] | None = None

    def served(self, dispatchers: list[Any]) -> None:
        """:attr:`on_serve`, if any."""
        if self.on_serve is not None:
            self.on_serve(dispatchers)

    def finished(self, ps_addresses: list[str], job: JobSpec) -> None:
        """:attr:`on_finish`, if any."""
        if self.on_finish is not None:
            self.on_finish(ps_addresses, job)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How this process runs a job.

    Args:
        dispatcher: the dispatcher class (tests wrap it).
        dispatcher_settings: this process's dispatcher settings (``bind``, ``dispatcher_rank``)
            over the job's (:func:`herald.job.runner.dispatcher_config`).
        progress: show the progress bar (False: its progressive validation only); None: no
            progress at all.
        stop_on_signals: SIGINT / SIGTERM stop the job at a step (report written, then
            :class:`~herald.job.runner.JobInterrupted`); False: the signals keep their handlers.
        sample_id_log: append the uint64 sample ids of every acked step to this file (None: no log).
        started_at: ``time.perf_counter()`` when this job's own process started (``herald
            train``): the report's start-up milestones count from it, ``imported`` first;
            None (a job run inside a longer-lived process): from the start of the run.
    """

    dispatcher: Callable[..., Any] = Dispatcher
    dispatcher_settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    progress: bool | None = None
    stop_on_signals: bool = False
    sample_id_log: str | os.PathLike | None = None
    started_at: float | None = None

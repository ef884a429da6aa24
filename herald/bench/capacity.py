"""Dispatcher capacity: samples/s a real :class:`Dispatcher` sustains when workers cost nothing.

``herald bench dispatcher`` and :func:`measure_capacity` run the whole dispatch path
(global batches -> Herald scheduler -> micro-batches -> ZeroMQ) over Criteo-shaped
synthetic rows against fake workers that ack every micro-batch at once
(:mod:`herald.bench.ackpeers`, a child process reading only message headers). The
result is the dispatcher's ceiling: a job cannot train faster than this, whatever its
workers do. The job is run by herald's job runner (NOTE [job runner] in
herald/job/runner.py) with no PS, these fake workers as its worker part
(:class:`AckPeerWorkers`), the rows below as its data, and neither checkpoints nor report.

Rows are generated once and served from memory by default (``materialize=True``): the
synthetic generator makes about 280,000 Criteo rows/s on one core of a small machine,
close to the rates measured here, and a real job reads a file instead. The scheduler
is the job's: ``SchedulerConfig(schedule=..., cache_ratio=0.1)`` sized by a pre-pass
counting the distinct keys of the rows. The first ``warmup_steps`` steps (kernel
loading, caches filling) are not measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from typing import Any

import numpy as np

from herald.bench.options import CAPACITY_ROWS, CAPACITY_SECONDS
from herald.bench.thread_cpu import thread_cpu_seconds
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError, HeraldError
from herald.job.interfaces import JobHooks
from herald.job.parts import NoPS, WorkerLauncher
from herald.job.runner import JobRunner
from herald.loader import open_source
from herald.loader.batch import SampleBatch
from herald.loader.global_batches import GlobalBatches
from herald.loader.source import MemorySource, Source, read_rows
from herald.loader.splits import count_distinct_keys
from herald.procs import child_env
from herald.scheduler import Scheduler, SchedulerConfig


def _read_all(source: Source, rows: int | None) -> SampleBatch:
    data = read_rows(source, rows)
    if data is None:
        raise ConfigError("the capacity source has no rows; pass more --rows or another --source")
    return data


class AckPeerWorkers(WorkerLauncher):
    """The capacity measurement's worker part (NOTE [job runner] in herald/job/runner.py):
    fake workers that ack every micro-batch at once, every rank played by one child process
    (``python -m herald.bench.ackpeers``, at ``nice`` increment ``nice``; a child started with
    -m, not multiprocessing: the caller's __main__ is never re-imported). It must still run
    while the dispatcher serves (:meth:`check`) and exit with status 0 at the end (:meth:`wait`)."""

    def __init__(self, nice: int = 0, idle_timeout_s: int = 60):
        super().__init__()
        self.nice, self.idle_timeout_s = nice, idle_timeout_s
        self.proc: subprocess.Popen | None = None
        self._output: tuple[str, str] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, cfg, job, dispatchers: list[str]) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "herald.bench.ackpeers",
                dispatchers[0],
                str(cfg.workers),
                str(self.idle_timeout_s),
                str(self.nice),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )

    def check(self) -> None:
        """The dispatcher's liveness check: the fake workers' process must still run."""
        code = self.proc.poll() if self.proc is not None else None
        if code is not None:
            err = self.proc.stderr.read() if self.proc.stderr is not None else ""
            raise HeraldError(
                f"the fake workers' process exited with status {code} during the capacity "
                f"measurement: {err.strip()[-2000:]}"
            )

    def wait(self) -> None:
        out, err = self._reap()
        if self.proc is not None and self.proc.returncode != 0:
            raise HeraldError(
                f"the fake workers of the capacity measurement failed (exit status "
                f"{self.proc.returncode}): {(out + err).strip()[-2000:]}"
            )

    def stop(self) -> None:
        self._reap()

    def _reap(self) -> tuple[str, str]:
        """The child's output once it ended (bounded: killed after 10 s)."""
        if self.proc is None:
            return "", ""
        if self._output is None:
            try:
                self._output = self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self._output = self.proc.communicate(timeout=5)
        return self._output


class _Rows:
    """What the capacity measurement reads (the job runner's data part): the rows of
    ``url`` (``rows`` of them; None: all) repeated as epochs, as global batches of
    ``sched_cfg``'s workers x batch size, enough for ``max_steps`` (None: unbounded), from
    memory when ``materialize``; scheduled by ``sched_cfg``'s scheduler sized by a pre-pass
    counting the rows' distinct keys (``distinct_keys``).

    Raises:
        ConfigError: no rows, or fewer than one global batch.
    """

    dataset, eval_source, replicated, replica_rows = None, None, (), 0

    def __init__(
        self, url: str, rows: int | None, sched_cfg: SchedulerConfig, *, max_steps: int | None, materialize: bool
    ):
        workers, batch_size = sched_cfg.num_workers, sched_cfg.batch_size_per_worker
        gb = workers * batch_size
        src = open_source(url)
        data = _read_all(src, rows)
        src.close()
        if len(data) < gb:
            raise ConfigError(
                f"{len(data)} rows are fewer than one global batch ({workers} x {batch_size}); pass more rows"
            )
        self.distinct_keys, self.num_rows = count_distinct_keys([data]), len(data)
        self.steps_per_epoch = len(data) // gb
        epochs = math.ceil(max_steps / self.steps_per_epoch) + 1 if max_steps is not None else 1_000_000
        if materialize:
            train = MemorySource(data)
        else:
            del data
            train = open_source(url)
        self.schema, self._sched_cfg = train.schema, sched_cfg
        self.batches = GlobalBatches(train, gb, epochs=epochs, max_steps=max_steps)

    def scheduler_factory(self, cfg):
        num_tables, sched_cfg, distinct = len(self.schema.table_names), self._sched_cfg, self.distinct_keys
        return lambda: Scheduler(sched_cfg, num_tables=num_tables, distinct_keys=distinct)

    def interrupt(self) -> None:
        """Nothing blocks here (rows in memory or a file)."""

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the producer and its source within ``timeout_s``."""
        self.batches.close(timeout_s)


def _stage_seconds(disp) -> dict[str, float]:
    get = getattr(disp, "stage_seconds", None)
    if get is not None:
        return get()
    return dict(disp.timer.seconds)


#: the settings of a CapacityRun that the job's TrainConfig takes under the same name
_TRAIN_FIELDS = ("workers", "batch_size", "schedule", "cache_ratio", "seed", "max_inflight_steps")


@dataclasses.dataclass(frozen=True)
class CapacityRun:
    """The settings of one :func:`measure_capacity` run.

    Args:
        workers: ranks served; batch_size: samples per micro-batch (global batch
            ``workers * batch_size``); schedule: a :data:`herald.contracts.vocab.SCHEDULES` name.
        rows: rows of data (synthetic Criteo by default), repeated as epochs; None with
            ``source``: all its rows.
        source: a source URL for :func:`herald.loader.open_source` (default
            ``synthetic://criteo?rows=ROWS&seed=SEED``).
        steps: steps measured after the warm-up; seconds: or measure this long
            (default 5 s when neither is given; with both, whichever ends first).
        warmup_steps: steps served before the measurement starts (>= 1: the clock
            starts at the ack of the last of them).
        max_inflight_steps: the dispatcher's credits.
        materialize: read the rows into memory first (the generator's cost left out).
        cache_ratio: worker cache size as a fraction of the rows' distinct keys.
        peers_nice: CPU priority (``nice`` increment, 0-19) of the fake workers' process;
            0: the dispatcher's own. A higher value lets the OS run the dispatcher's
            threads first when the cores are contended (POSIX only).

    Raises:
        ConfigError: ``steps`` < 1, ``seconds`` <= 0, ``warmup_steps`` < 1 or ``peers_nice`` outside 0..19.
    """

    workers: int = 8
    batch_size: int = 256
    schedule: str = "herald"
    rows: int | None = CAPACITY_ROWS
    source: str | None = None
    steps: int | None = None
    seconds: float | None = None
    warmup_steps: int = 30
    max_inflight_steps: int = 2
    materialize: bool = True
    cache_ratio: float = 0.1
    seed: int = 0
    peers_nice: int = 0

    def __post_init__(self) -> None:
        steps, seconds = self.steps, self.seconds
        if (steps is not None and steps < 1) or (seconds is not None and seconds <= 0) or self.warmup_steps < 1:
            raise ConfigError("measure_capacity: steps must be >= 1, seconds > 0 and warmup_steps >= 1")
        if not 0 <= self.peers_nice <= 19:
            raise ConfigError(f"measure_capacity: peers_nice must be in 0..19, got {self.peers_nice}")

    @property
    def limit_seconds(self) -> float | None:
        """Seconds measured at most: ``seconds``, else :data:`CAPACITY_SECONDS` without ``steps``."""
        return CAPACITY_SECONDS if self.steps is None and self.seconds is None else self.seconds

    @property
    def url(self) -> str:
        """The source URL: ``source``, else synthetic Criteo rows."""
        return self.source if self.source is not None else f"synthetic://criteo?rows={self.rows}&seed={self.seed}"

    def scheduler_config(self) -> SchedulerConfig:
        """The job's scheduler: ``schedule`` with caches of ``cache_ratio`` of the distinct keys."""
        return SchedulerConfig(
            self.workers, self.batch_size, self.schedule, cache_ratio=self.cache_ratio, seed=self.seed
        )

    def train_config(self) -> TrainConfig:
        """The job's settings for the runner: its dispatcher (credits, 60 s peer timeout) and JobSpec."""
        shared = {name: getattr(self, name) for name in _TRAIN_FIELDS}
        return TrainConfig.from_flags(source=self.url, timeout_ms=60_000, embedding_dim=16, **shared)


def measure_capacity(
    workers: int = 8,
    batch_size: int = 256,
    schedule: str = "herald",
    rows: int | None = CAPACITY_ROWS,
    source: str | None = None,
    steps: int | None = None,
    seconds: float | None = None,
    *,
    warmup_steps: int = 30,
    max_inflight_steps: int = 2,
    materialize: bool = True,
    cache_ratio: float = 0.1,
    seed: int = 0,
    peers_nice: int = 0,
) -> dict[str, Any]:
    """Samples/s of a real dispatcher serving ``workers`` fake workers that ack at once.

    Args:
        the fields of :class:`CapacityRun`, which says what each is.

    Returns:
        ``{"samples_per_s", "steps" (measured), "seconds", "ms_per_step", "phases"
        ({stage: busy seconds / measured seconds}, stages of
        :data:`herald.phases.DISPATCHER_PHASES` plus the pipeline's own), "cpu" ({thread:
        CPU seconds / measured seconds}, this process's threads and the fake workers'
        process as "peers"; 10 ms resolution, empty without /proc), "machine_cpu" (cores
        busy on the whole machine meanwhile: more than the sum of "cpu" means other
        processes competed), "cpus", "workers",
        "batch_size", "schedule", "rows", "warmup_steps", "global_batch"}``.

    Raises:
        ConfigError: bad settings, or too few rows for one global batch.
        HeraldError: the dispatcher or the fake workers failed.
    """
    return _measure(CapacityRun(**locals()))  # the parameters are CapacityRun's fields


def _measure(run: CapacityRun) -> dict[str, Any]:
    """:func:`measure_capacity` of the settings ``run``."""
    need = run.warmup_steps + (run.steps if run.steps is not None else 0)
    max_steps = need if run.steps is not None else None
    data = _Rows(run.url, run.rows, run.scheduler_config(), max_steps=max_steps, materialize=run.materialize)
    peers = AckPeerWorkers(nice=run.peers_nice)
    clock = _Clock(peers, run.warmup_steps, run.steps, run.limit_seconds)
    # the job runner (NOTE [job runner]) with no PS, the fake workers, no checkpoints, no report
    hooks = JobHooks(on_step=clock.on_step, on_serve=clock.disps.extend)
    JobRunner(ps=NoPS(), workers=peers, data=data, hooks=hooks).run(run.train_config())
    if "t1" not in clock.marks:
        raise ConfigError(
            f"no step measured after {run.warmup_steps} warm-up steps: {data.steps_per_epoch} steps per "
            "epoch of data; pass more rows or fewer warm-up steps"
        )
    gb = run.workers * run.batch_size
    return {
        **clock.figures(gb),
        "cpus": os.cpu_count(),
        "workers": run.workers,
        "batch_size": run.batch_size,
        "schedule": run.schedule,
        "global_batch": gb,
        "rows": data.num_rows,
        "materialized": run.materialize,
        "warmup_steps": run.warmup_steps,
        "peers_nice": run.peers_nice,
        "distinct_keys": int(data.distinct_keys),
        "capacity_rows": int(np.ceil(run.cache_ratio * data.distinct_keys)),
    }


class _Clock:
    """The measurement of :func:`measure_capacity`: the job runner's ``on_step`` starts it at
    the ack of the last warm-up step and stops the dispatcher once ``steps`` steps or
    ``seconds`` seconds are measured (whichever first); the stage and CPU seconds are read
    at both ends."""

    def __init__(self, peers: AckPeerWorkers, warmup_steps: int, steps: int | None, seconds: float | None) -> None:
        self.peers, self.warmup_steps, self.steps, self.seconds = peers, warmup_steps, steps, seconds
        self.disps: list[Any] = []  # the dispatcher, once bound (on_serve)
        self.marks: dict[str, Any] = {}

    def on_step(self, rec) -> None:
        marks, now, disp = self.marks, rec.acked_at, self.disps[0]
        if rec.step == self.warmup_steps - 1:  # the clock starts when the warm-up's last step is acked
            marks["t0"], marks["s0"], marks["step0"] = now, _stage_seconds(disp), rec.step
            marks["c0"] = thread_cpu_seconds(self.peers.pid)
            return
        if "t0" not in marks or "stopped" in marks:
            return
        marks["t1"], marks["s1"], marks["step1"] = now, _stage_seconds(disp), rec.step
        n = rec.step - marks["step0"]
        if (self.steps is not None and n >= self.steps) or (
            self.seconds is not None and now - marks["t0"] >= self.seconds
        ):
            marks["stopped"] = True
            marks["c1"] = thread_cpu_seconds(self.peers.pid)
            disp.stop()

    def figures(self, global_batch: int) -> dict[str, Any]:
        """``samples_per_s``, ``steps``, ``seconds``, ``ms_per_step``, ``phases``, ``cpu`` and
        ``machine_cpu`` of the measured steps (see :func:`measure_capacity`)."""
        marks = self.marks
        wall = marks["t1"] - marks["t0"]
        n = marks["step1"] - marks["step0"]
        s0, s1 = marks["s0"], marks["s1"]
        phases = {k: round((s1.get(k, 0.0) - s0.get(k, 0.0)) / wall, 4) for k in s1}
        c0, c1 = marks.get("c0", {}), marks.get("c1", {})
        cpu = {k: round((c1[k] - c0.get(k, 0.0)) / wall, 3) for k in c1 if c1[k] - c0.get(k, 0.0) > 0}
        machine = cpu.pop("(machine)", None)
        return {
            "samples_per_s": n * global_batch / wall,
            "steps": n,
            "seconds": wall,
            "ms_per_step": wall * 1e3 / n,
            "phases": phases,
            "cpu": cpu,
            "machine_cpu": machine,
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``herald bench dispatcher``: :func:`measure_capacity` with the options in ``args``;
    prints samples/s, each stage's busy fraction and the CPU per thread, and writes the
    result as JSON to ``--out`` when given."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(CapacityRun) if hasattr(args, f.name)}
    res = _measure(CapacityRun(**given, materialize=not args.no_materialize))
    print(
        f"dispatcher capacity: {res['samples_per_s']:,.0f} samples/s  ({res['workers']} workers x "
        f"{res['batch_size']}, {res['schedule']}, {res['steps']} steps in {res['seconds']:.2f} s, "
        f"{res['ms_per_step']:.2f} ms/step)"
    )
    print("busy fraction of the measured time per stage (stages on different threads overlap):")
    for stage, frac in res["phases"].items():
        print(f"  {stage:<12} {frac:6.1%}   {frac * res['ms_per_step']:7.2f} ms/step")
    if res.get("cpu"):
        print(
            f"CPU per thread (cores; {sum(res['cpu'].values()):.2f} in all): "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(res["cpu"].items(), key=lambda kv: -kv[1]))
        )
    if res.get("machine_cpu") is not None:
        print(f"machine: {res['machine_cpu']:.2f} of {res['cpus']} cores busy during the measurement")
        others = res["machine_cpu"] - sum(res.get("cpu", {}).values())
        if others > 0.1:
            print(
                f"warning: other processes used {others:.2f} cores meanwhile: this measurement is low; "
                "rerun on an idle machine"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {args.out}")
    return res

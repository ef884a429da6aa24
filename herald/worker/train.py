"""``herald train``: PS shards, the dispatcher and N workers as local processes.

The dispatcher runs in this process (so progress and the report come from one
place); each PS shard and each worker is a child process started with
``python -m herald serve ...``. A child that exits early is reported by name and
the whole job stops (children are terminated with a bounded wait: no orphans).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from herald.config import require
from herald.errors import HeraldError
from herald.procs import die_with_parent
from herald.ps import LocalShards, OptimizerConfig, PSClient, TableConfig
from herald.scheduler import Scheduler, SchedulerConfig
from herald.worker.dispatcher import Dispatcher, DispatcherConfig, StepRecord
from herald.worker import checkpoints, splits
from herald.worker.stream import KafkaGlobalBatches

DEFAULT_SOURCE = "synthetic://criteo?rows=600000&seed=0"
#: Worker cache rows for a kafka:// stream without --cache-rows: a stream has no known
#: set of keys to take --cache-ratio of.
STREAM_CACHE_ROWS = 100_000


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of one ``herald train`` job (see ``herald train --help``)."""

    source: str = DEFAULT_SOURCE
    schedule: str = "herald"
    workers: int = 2
    batch_size: int = 128
    cache_ratio: float = 0.1
    cache_rows: int | None = None
    cache_policy: str = "lru"
    embedding_dim: int = 16
    optimizer: str = "rowwise_adagrad"
    lr: float = 0.05
    dense_optimizer: str = "adam"
    dense_lr: float = 0.001
    model: str = "auto"
    epochs: int = 1
    steps: int | None = None
    eval_fraction: float = 0.1
    ps_shards: int = 1
    seed: int = 0
    run_dir: str = "runs/latest"
    max_inflight_steps: int = 2
    timeout_ms: int = 120_000
    checkpoint_every: int = 0
    resume: bool = False
    eval_every: int = 100
    log_sample_ids: bool = False
    replicate_below: int = 0
    source_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        require(self.workers >= 1, f"--workers must be >= 1, got {self.workers}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        require(0 <= self.eval_fraction < 1, f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        require(self.ps_shards >= 1, "--ps-shards must be >= 1")
        require(self.epochs >= 1, "--epochs must be >= 1")
        require(self.steps is None or self.steps >= 1, "--steps must be >= 1")
        require(self.workers <= 255, "at most 255 workers per dispatcher")
        require(self.checkpoint_every >= 0, "--checkpoint-every must be >= 0")
        require(self.eval_every >= 1, "--eval-every must be >= 1")
        require(self.replicate_below >= 0, "--replicate-below must be >= 0")
        require(not (self.replicate_below and self.is_stream),
                "--replicate-below needs the distinct ids of each table from a pre-pass; a kafka:// stream has none")
        require(not self.resume or self.is_stream,
                "--resume continues a kafka:// stream from its latest checkpoint; file sources are re-run")

    @property
    def is_stream(self) -> bool:
        return self.source.startswith("kafka://")

    def tables(self, schema) -> list[TableConfig]:
        """One table config per table of ``schema`` (same dim and sparse optimizer)."""
        opt = OptimizerConfig(name=self.optimizer, lr=self.lr)
        return [TableConfig(name=n, dim=self.embedding_dim, optimizer=opt) for n in schema.table_names]

    @property
    def global_batch(self) -> int:
        return self.workers * self.batch_size


def build_job(cfg: TrainConfig, data: "JobData", ps_addresses: list[str]) -> dict[str, Any]:
    """The job dict every worker receives in the dispatcher's config message."""
    job = {
        "tables": [t.to_dict() for t in cfg.tables(data.schema)],
        "table_names": list(data.schema.table_names),
        "dense_dim": data.schema.dense_dim,
        "model": cfg.model,
        "seed": cfg.seed,
        "dense_optimizer": {"name": cfg.dense_optimizer, "lr": cfg.dense_lr},
        "ps": ps_addresses,
        "run_dir": str(pathlib.Path(cfg.run_dir).resolve()),
        "ps_timeout_ms": cfg.timeout_ms,
    }
    if data.replicated:  # NOTE [replicated tables] (herald/worker/replicas.py)
        job["replicated_tables"], job["replica_rows"] = data.replicated, data.replica_rows
    return job


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Children:
    """Worker processes, checked for liveness while the dispatcher waits."""

    def __init__(self, run_dir: pathlib.Path):
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str]) -> None:
        log = open(self.run_dir / f"{name}.log", "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "herald", *args], stdout=log,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                            preexec_fn=die_with_parent)
        log.close()

    def check(self) -> None:
        """Raise naming the first child that exited (with the tail of its log)."""
        failure = self.failure()
        if failure:
            raise HeraldError(failure)

    def failure(self, grace_s: float = 0.0) -> str | None:
        """A message naming the first child that exited with an error, waiting up to
        ``grace_s`` for one to exit (a worker's error is often the echo of a peer's death)."""
        deadline = time.monotonic() + grace_s
        while True:
            for name, p in self.procs.items():
                code = p.poll()
                if code is not None and code != 0:
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    return f"{name} {how}; last lines of {self.run_dir / (name + '.log')}:\n{self.tail(name)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join((self.run_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for name, p in self.procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise HeraldError(f"{name} did not exit within {timeout_s:.0f} s after the end of training") from None
        self.check()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate every child still running (SIGTERM, then SIGKILL); bounded."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(2)


def run_train(cfg: TrainConfig, *, progress: bool = True, on_finish=None) -> dict[str, Any]:
    """Run a whole training job; returns the report dict (also written to ``run_dir``).

    ``on_finish(ps_addresses, job)``, if given, runs after the final flush while the PS
    shards are still up (tests read the trained rows there). SIGINT / SIGTERM end the
    job cleanly at the next step (with a final checkpoint when checkpointing is on).

    Raises:
        ConfigError: bad settings; HeraldError: a child process failed (named).
    """
    from herald.worker import report as report_mod

    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    data = JobData(cfg)
    resume = checkpoints.latest(run_dir / "checkpoints") if cfg.resume else None
    if resume is not None:
        data.seek(resume.meta["source_position"])
    new_scheduler = data.scheduler_factory(cfg)

    children = _Children(run_dir)
    records: list[StepRecord] = []
    id_log = open(run_dir / "trained_sample_ids.u64", "ab") if cfg.log_sample_ids else None
    t_start = time.perf_counter()
    # ipc: every process is local, and ZeroMQ over Unix sockets moves ~2x the bytes of
    # TCP loopback here (docs/ps.md, benchmark)
    with LocalShards(num_shards=cfg.ps_shards, tables=cfg.tables(data.schema), seed=cfg.seed,
                     transport="ipc") as shards, \
            PSClient(list(shards.addresses), tables=cfg.tables(data.schema), timeout_ms=cfg.timeout_ms) as ps:
        if resume is not None:
            ps.restore(str(resume.path / "ps"))
        job = build_job(cfg, data, list(shards.addresses))
        job["dist_init"] = f"tcp://127.0.0.1:{_free_port()}"
        if resume is not None:
            job["resume_dense"] = str(resume.path)
        ckpt = checkpoints.Checkpointer(run_dir / "checkpoints", lambda path: ps.checkpoint(path),
                                        position=data.position, commit=data.commit)
        use_ckpt = bool(cfg.checkpoint_every or cfg.is_stream)
        bar = report_mod.Progress(cfg, enabled=progress, total_steps=data.total_steps(cfg))
        disp_cfg = DispatcherConfig(num_workers=cfg.workers, max_inflight_steps=cfg.max_inflight_steps,
                                    peer_timeout_ms=cfg.timeout_ms, checkpoint_every_steps=cfg.checkpoint_every,
                                    first_step=resume.step + 1 if resume else 0)
        try:
            with Dispatcher(disp_cfg, data.batches, new_scheduler, job, on_step=bar.update,
                            on_checkpoint=ckpt.save if use_ckpt else None,
                            checkpoint_path=ckpt.staging_path if use_ckpt else None,
                            liveness=children.check, sample_id_log=id_log) as disp, \
                    _stop_on_signals(disp, data):
                for rank in range(cfg.workers):
                    children.start(f"worker-{rank}", ["serve", "worker", "--dispatcher", disp.address, "--rank",
                                                      str(rank), "--world-size", str(cfg.workers),
                                                      "--timeout-ms", str(cfg.timeout_ms)])
                records = disp.serve()
                capacity_rows = disp.scheduler.capacity_rows
            children.wait(timeout_s=60)
        except HeraldError as exc:
            cause = children.failure(grace_s=2.0)
            children.stop()
            if cause and cause not in str(exc):
                raise HeraldError(f"{cause}\n(then: {exc})") from exc
            raise
        except BaseException:
            children.stop()
            raise
        finally:
            bar.close()
            if id_log is not None:
                id_log.close()
        train_s = time.perf_counter() - t_start
        if on_finish is not None:
            on_finish(list(shards.addresses), job)
        metrics = (report_mod.evaluate(job, data.eval_source, run_dir, shards.addresses)
                   if data.eval_source is not None else {})
        data.close()
    rep = report_mod.build(cfg, records, train_s, metrics, batches_info=data.batches.info, split_info=data.split_info,
                           capacity_rows=capacity_rows)
    rep["replicated_tables"] = [data.schema.table_names[t] for t in data.replicated]
    rep["replica_rows_per_worker"] = data.replica_rows
    report_mod.write(rep, records, run_dir)
    return rep


class JobData:
    """What a job reads: schema, global batches, held-out split, replicated tables,
    the cache size of its schedulers, and (Kafka) position and commit."""

    def __init__(self, cfg: TrainConfig):
        options = dict(cfg.source_options)
        self.source = None
        if cfg.is_stream:
            from herald.loader import open_source

            self.source = open_source(cfg.source, **options)
            self.schema = self.source.schema
            self.batches = KafkaGlobalBatches(self.source, cfg.global_batch, cfg.steps)
            self.eval_source, self.distinct_keys = None, None
            self.replicated, self.replica_rows = [], 0
            self.split_info = {"total_rows": None, "train_rows": None, "eval_rows": 0}
            return
        train, self.eval_source, self.split_info = splits.open_train_eval(cfg.source, cfg.eval_fraction, options)
        self.schema = train.schema
        train.close()
        self.replicated, self.replica_rows, self.distinct_keys = [], 0, None
        if cfg.cache_rows is None or cfg.replicate_below:
            per_table = splits.distinct_keys_per_table(cfg.source, options, self.split_info["train_rows"])
            # NOTE [replicated tables] (herald/worker/replicas.py): small tables live on every worker
            self.replicated = [t for t, n in enumerate(per_table) if n <= cfg.replicate_below]
            self.replica_rows = sum(per_table[t] for t in self.replicated)
            self.distinct_keys = max(1, sum(n for t, n in enumerate(per_table) if t not in self.replicated))
        self.batches = splits.global_batches(cfg.source, options, self.split_info["train_rows"], cfg.global_batch,
                                             cfg.epochs, cfg.steps)

    def scheduler_factory(self, cfg: TrainConfig):
        """A callable returning a fresh :class:`Scheduler` for this job (the dispatcher
        makes one at the start and one after every checkpoint barrier)."""
        cache_rows = cfg.cache_rows if cfg.cache_rows or not cfg.is_stream else STREAM_CACHE_ROWS
        sched_cfg = SchedulerConfig(num_workers=cfg.workers, batch_size_per_worker=cfg.batch_size,
                                    schedule=cfg.schedule, cache_policy=cfg.cache_policy,
                                    cache_capacity_rows=cache_rows, cache_ratio=cfg.cache_ratio, seed=cfg.seed)
        num_tables, distinct = self.schema.num_tables, self.distinct_keys
        return lambda: Scheduler(sched_cfg, num_tables=num_tables, distinct_keys=distinct)

    def total_steps(self, cfg: TrainConfig) -> int | None:
        """Steps the job will train, when known (None for an unbounded stream)."""
        rows = self.split_info["train_rows"]
        steps = None if rows is None else (rows // cfg.global_batch) * cfg.epochs
        if cfg.steps is not None:
            steps = cfg.steps if steps is None else min(steps, cfg.steps)
        return steps

    def position(self, batch_index: int):
        return self.batches.position(batch_index).to_dict() if self.source is not None else None

    def commit(self, batch_index: int) -> None:
        if self.source is not None:
            self.source.commit(self.batches.position(batch_index))
            self.batches.release(batch_index)

    def seek(self, position: dict | None) -> None:
        if self.source is not None and position is not None:
            self.source.load_state_dict({"format": self.source.format_name, "rows": 0, **position})

    def interrupt(self) -> None:
        if self.source is not None:
            self.source.interrupt()

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


class _stop_on_signals:
    """While active, SIGINT and SIGTERM stop the dispatcher at the next step boundary."""

    def __init__(self, disp: Dispatcher, data: JobData):
        self.disp, self.data, self.saved = disp, data, {}

    def _handler(self, signum, frame) -> None:
        print(f"herald train: {signal.Signals(signum).name}: stopping after the current step", file=sys.stderr)
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


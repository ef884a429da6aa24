"""``herald train``: PS shards, the dispatcher and N workers as local processes.

The dispatcher runs in this process (so progress and the report come from one
place); each PS shard and each worker is a child process started with
``python -m herald serve ...``. A child that exits early is reported by name and
the whole job stops (children are terminated with a bounded wait: no orphans).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

from herald.config import require
from herald.errors import ConfigError, HeraldError
from herald.loader.batch import SampleBatch
from herald.ps import LocalShards, OptimizerConfig, TableConfig
from herald.scheduler import Scheduler, SchedulerConfig
from herald.worker.dispatcher import Dispatcher, DispatcherConfig, StepRecord
from herald.worker import splits

DEFAULT_SOURCE = "synthetic://criteo?rows=60000&seed=0"


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
    optimizer: str = "adagrad"
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
    source_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        require(self.workers >= 1, f"--workers must be >= 1, got {self.workers}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        require(0 <= self.eval_fraction < 1, f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        require(self.ps_shards >= 1, "--ps-shards must be >= 1")
        require(self.epochs >= 1, "--epochs must be >= 1")
        require(self.steps is None or self.steps >= 1, "--steps must be >= 1")
        require(self.workers <= 255, "at most 255 workers per dispatcher")

    @property
    def global_batch(self) -> int:
        return self.workers * self.batch_size


def build_job(cfg: TrainConfig, schema, ps_addresses: list[str]) -> dict[str, Any]:
    """The job dict every worker receives in the dispatcher's config message."""
    opt = OptimizerConfig(name=cfg.optimizer, lr=cfg.lr)
    tables = [TableConfig(name=n, dim=cfg.embedding_dim, optimizer=opt) for n in schema.table_names]
    return {
        "tables": [t.to_dict() for t in tables],
        "table_names": list(schema.table_names),
        "dense_dim": schema.dense_dim,
        "model": cfg.model,
        "seed": cfg.seed,
        "dense_optimizer": {"name": cfg.dense_optimizer, "lr": cfg.dense_lr},
        "ps": ps_addresses,
        "run_dir": str(pathlib.Path(cfg.run_dir).resolve()),
        "ps_timeout_ms": cfg.timeout_ms,
    }


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
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()

    def check(self) -> None:
        """Raise naming the first child that exited (with the tail of its log)."""
        for name, p in self.procs.items():
            code = p.poll()
            if code is not None and code != 0:
                raise HeraldError(f"{name} exited with code {code}; last lines of {self.run_dir / (name + '.log')}:\n"
                                  + self.tail(name))

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
    shards are still up (tests read the trained rows there).

    Raises:
        ConfigError: bad settings; HeraldError: a child process failed (named).
    """
    from herald.worker import report as report_mod

    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    options = dict(cfg.source_options)
    train_source, eval_source, split_info = splits.open_train_eval(cfg.source, cfg.eval_fraction, options)
    schema = train_source.schema
    distinct = None
    if cfg.cache_rows is None:
        distinct = splits.count_distinct_keys(cfg.source, options, split_info["train_rows"], progress=progress)
    sched_cfg = SchedulerConfig(num_workers=cfg.workers, batch_size_per_worker=cfg.batch_size,
                                schedule=cfg.schedule, cache_policy=cfg.cache_policy,
                                cache_capacity_rows=cfg.cache_rows,
                                cache_ratio=cfg.cache_ratio, seed=cfg.seed)
    scheduler = Scheduler(sched_cfg, num_tables=schema.num_tables, distinct_keys=distinct)
    batches = splits.global_batches(cfg.source, options, split_info["train_rows"], cfg.global_batch, cfg.epochs,
                                    cfg.steps)
    children = _Children(run_dir)
    records: list[StepRecord] = []
    t_start = time.perf_counter()
    with LocalShards(num_shards=cfg.ps_shards, tables=_tables(cfg, schema), seed=cfg.seed) as shards:
        job = build_job(cfg, schema, list(shards.addresses))
        job["dist_init"] = f"tcp://127.0.0.1:{_free_port()}"
        bar = report_mod.Progress(cfg, enabled=progress)
        disp_cfg = DispatcherConfig(num_workers=cfg.workers, max_inflight_steps=cfg.max_inflight_steps,
                                    peer_timeout_ms=cfg.timeout_ms)
        try:
            with Dispatcher(disp_cfg, batches, scheduler, job, on_step=bar.update, liveness=children.check) as disp:
                for rank in range(cfg.workers):
                    children.start(f"worker-{rank}", ["serve", "worker", "--dispatcher", disp.address, "--rank",
                                                      str(rank), "--world-size", str(cfg.workers),
                                                      "--timeout-ms", str(cfg.timeout_ms)])
                records = disp.serve()
            children.wait(timeout_s=60)
        except BaseException:
            children.stop()
            raise
        finally:
            bar.close()
        train_s = time.perf_counter() - t_start
        if on_finish is not None:
            on_finish(list(shards.addresses), job)
        metrics = report_mod.evaluate(job, eval_source, run_dir, shards.addresses) if eval_source is not None else {}
    rep = report_mod.build(cfg, records, train_s, metrics, batches_info=batches.info, split_info=split_info,
                           scheduler=scheduler)
    report_mod.write(rep, records, run_dir)
    return rep


def _tables(cfg: TrainConfig, schema) -> list[TableConfig]:
    opt = OptimizerConfig(name=cfg.optimizer, lr=cfg.lr)
    return [TableConfig(name=n, dim=cfg.embedding_dim, optimizer=opt) for n in schema.table_names]

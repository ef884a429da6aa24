"""The parts every job runner of this host shares (``herald train`` with one dispatcher
or one per group: herald/job/launcher.py, herald/job/group_dispatch.py).

- :class:`LocalProcesses`: the job's processes on this host: PS shards as local
  processes, the PS client, the supervisor of the worker processes and the file store of
  their dense process group; :meth:`LocalProcesses.start_worker` starts one worker.
- :func:`dispatcher_config`: the one place a job's :class:`DispatcherConfig` is built.
- :func:`raise_job_failure`, :class:`ShardFailed`, :class:`JobInterrupted`: what a failed
  or interrupted job raises; :class:`StopOnSignals`: SIGINT / SIGTERM stop at a step.
- :func:`finish_job`: the PS stats, the held-out evaluation and the skipped records.

Security (docs/operations.md, "Securing a multi-host job"): with ``--keys DIR`` every
role's ZeroMQ traffic is CURVE (NOTE [transport security] in herald/auth.py); the PS
shards take admin ops (checkpoint, restore, shutdown) only with this job's token and
only inside ``RUN_DIR/checkpoints`` (NOTE [ps admin ops]); the workers' dense process
group rendezvous through a file in the run folder (no listening store) and gloo is kept
on the loopback interface (:func:`dense_store`, :func:`worker_env`).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import signal
import sys
from typing import Any, Iterator, NoReturn

from herald.auth import load_client_keys, load_server_keys, loopback_interface
from herald.dispatch.dispatcher import DispatcherConfig
from herald.errors import HeraldError
from herald.job import report as report_mod
from herald.job.data import JobData
from herald.procs import Supervisor
from herald.ps import LocalShards, PSClient
from herald.ps.config import ShardLimits
from herald.spec.flags import flag_errors
from herald.spec.job import JobSpec
from herald.spec.train import TrainConfig


@contextlib.contextmanager
def dense_store(run_dir: pathlib.Path) -> Iterator[str]:
    """The workers' ``torch.distributed`` init method: ``file://`` a fresh file in the run
    folder (torch's FileStore: no listening socket, unlike rank 0's TCPStore, which binds
    every interface); the file is removed when the job ends."""
    path = run_dir.resolve() / f".dist-store-{secrets.token_hex(8)}"
    try:
        yield f"file://{path}"
    finally:
        path.unlink(missing_ok=True)


def worker_env() -> dict[str, str]:
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
    one attempt of :func:`herald.job.launcher.run_train` so that NOTE [ps failover] can roll the job back."""


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


class LocalProcesses:
    """The processes of a job on this host, as a context manager: ``cfg.num_ps_shards`` PS
    shards (local processes over ipc, their logs and checkpoints in the run folder), the
    :class:`PSClient` of the launcher, the worker processes' :class:`Supervisor` and their
    dense process group's file store. Leaving it stops every process (bounded waits).

    Attributes (while entered):
        shards: :class:`LocalShards`; ps: :class:`PSClient`; children: :class:`Supervisor`;
        dist_init: the workers' ``torch.distributed`` init method; ps_alive: the shards'
        liveness check (NOTE [ps liveness] in herald/ps/watch.py).

    Raises:
        ConfigError: unreadable ``--keys`` (before anything starts); HeraldError: a shard
            that does not start (named).
    """

    def __init__(self, cfg: TrainConfig, data: JobData):
        self.cfg, self.data = cfg, data
        self.run_dir = pathlib.Path(cfg.run_dir)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "LocalProcesses":
        cfg, run_dir = self.cfg, self.run_dir
        tables = cfg.tables(self.data.schema)
        try:
            self.children = Supervisor(run_dir, new_session=True, env=worker_env())
            # ipc: every process is local, and ZeroMQ over Unix sockets moves ~2x the bytes of
            # TCP loopback here (docs/ps.md, benchmark). NOTE [ps liveness]: shard logs in the
            # run folder (ps-shard-I.log); an aggregation a dead worker leaves open is aborted
            # within the job's timeout
            self.shards = self._stack.enter_context(LocalShards(
                num_shards=cfg.num_ps_shards, tables=tables, seed=cfg.seed, transport="ipc", log_dir=run_dir,
                limits=ShardLimits(aggregation_timeout_ms=cfg.timeout_ms, max_rows=cfg.ps_max_rows),
                keys_dir=cfg.keys_dir, checkpoint_root=run_dir / "checkpoints"))
            self.ps = self._stack.enter_context(PSClient(
                list(self.shards.addresses), tables=tables, timeout_ms=cfg.timeout_ms, num_workers=cfg.workers,
                keys_dir=cfg.keys_dir, admin_token=self.shards.admin_token))
            self.dist_init = self._stack.enter_context(dense_store(run_dir))
            # a dead shard is named at the next check, a silent one after half the job's timeout
            self.ps_alive = self.shards.watch(silent_ms=max(1, cfg.timeout_ms // 2))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def liveness(self) -> None:
        """Raise naming a dead or silent PS shard or a dead worker (the dispatcher's check)."""
        self.ps_alive()
        self.children.check()

    def start_worker(self, rank: int, dispatcher: str, dispatcher_rank: int, world_size: int, job: JobSpec) -> None:
        """Start worker process ``rank`` (of ``cfg.workers`` on this host, as torchrun would
        number it: NOTE [worker devices]) as rank ``dispatcher_rank`` of the ``world_size``
        ranks the dispatcher at ``dispatcher`` serves."""
        cfg = self.cfg
        self.children.env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(cfg.workers))
        self.children.start(f"worker-{rank}", [sys.executable, "-m", "herald", "serve", "worker",
                                               "--dispatcher", dispatcher, "--rank", str(dispatcher_rank),
                                               "--world-size", str(world_size),
                                               "--device", cfg.device, "--cache-device", cfg.cache_device,
                                               "--timeout-ms", str(cfg.timeout_ms),
                                               *(["--keys", job.keys_dir] if job.keys_dir else [])])

    def fail(self, exc: HeraldError) -> NoReturn:
        """:func:`raise_job_failure` of this job's shards and workers."""
        raise_job_failure(exc, self.ps_alive, self.children)


def prepare_run(cfg: TrainConfig) -> pathlib.Path:
    """Check ``--keys`` (bad keys stop the job before anything starts: NOTE [transport
    security]) and create the run folder with its ``checkpoints`` root (the shards'
    admin-op root, NOTE [ps admin ops]). Returns the run folder."""
    if cfg.keys_dir is not None:
        load_server_keys(cfg.keys_dir)
        load_client_keys(cfg.keys_dir)
    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    return run_dir


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
    ps_stats = ps.stats()
    if on_finish is not None:
        on_finish(list(addresses), job)
    metrics = report_mod.evaluate(job, data.eval_source, run_dir, addresses) if data.eval_source is not None else {}
    data.close()
    skipped = {"train": dict(data.batches.skipped),
               "eval": dict(data.eval_source.stats["skipped"]) if data.eval_source is not None else {}}
    return ps_stats, metrics, skipped


class StopOnSignals:
    """While active, SIGINT and SIGTERM stop ``disp`` (a dispatcher, or anything with
    ``stop()``) at the next step boundary and interrupt ``data``'s reader; ``signum`` is the
    first signal received (None: none)."""

    def __init__(self, disp: Any, data: JobData):
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

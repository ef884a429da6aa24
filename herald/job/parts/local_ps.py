"""``herald train``'s PS shards as local processes (:class:`LocalPS`), and the run folder
every local job prepares first (:func:`prepare_run`)."""

from __future__ import annotations

import contextlib
import pathlib
from typing import Any, NoReturn

from herald.auth import load_client_keys, load_server_keys
from herald.contracts.train import TrainConfig
from herald.dispatch.peers import Silence
from herald.errors import HeraldError
from herald.files import private_dir
from herald.job.parts.base import PSProvider, WorkerLauncher, job_client
from herald.job.recovery import leftovers
from herald.job.recovery.failure import raise_job_failure
from herald.procs import pin_to_cores
from herald.ps import LocalShards
from herald.ps.config import ShardLimits, host_shard_bytes


def prepare_run(cfg: TrainConfig) -> pathlib.Path:
    """Check ``--keys`` (bad keys stop the job before anything starts: NOTE [transport
    security]), create the run folder with its ``checkpoints`` root (the shards'
    admin-op root, NOTE [ps admin ops]; mode 0700, NOTE [private files]) and remove what
    a killed job left there (NOTE [run leftovers] in herald/job/recovery/leftovers.py). Returns the
    run folder."""
    if cfg.security.keys_dir is not None:
        load_server_keys(cfg.security.keys_dir)
        load_client_keys(cfg.security.keys_dir)
    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    private_dir(run_dir / "checkpoints")
    leftovers.clean(run_dir)
    return run_dir


class LocalPS(PSProvider):
    """``cfg.num_ps_shards`` PS shards as local processes over ipc (``herald train``), their
    logs (``ps-shard-I.log``) and checkpoint root (``checkpoints``) in the run folder; a
    lost shard is :class:`~herald.job.recovery.rollback.ShardFailed` (NOTE [ps failover] rolls the job back), a lost
    worker :class:`~herald.job.recovery.rollback.WorkerFailed` (NOTE [worker failover]): :func:`raise_job_failure`.

    Attributes (once opened): shards: :class:`LocalShards`; watch: their liveness check
    (NOTE [ps liveness] in herald/ps/watch.py).

    Raises:
        ConfigError: unreadable ``--keys`` (:meth:`prepare`, before anything starts);
        HeraldError: a shard that does not start (named).
    """

    def prepare(self, cfg: TrainConfig) -> None:
        prepare_run(cfg)

    def local_processes(self, cfg: TrainConfig) -> int:
        return cfg.num_ps_shards

    def open(self, cfg: TrainConfig, data: Any, stack: contextlib.ExitStack) -> None:
        """Start the shards; with :attr:`cores`, pin each once it is ready (every thread of it:
        :func:`~herald.procs.pin_to_cores`; LocalShards starts them all before any is ready)."""
        run_dir, tables = pathlib.Path(cfg.run_dir), cfg.tables(data.schema)
        # their folder (ipc sockets), named in the run folder until removed: NOTE [run leftovers]
        workdir = leftovers.private_folder(run_dir, leftovers.PS_PREFIX, stack)
        # ipc: every process is local, and ZeroMQ over Unix sockets moves ~2x the bytes of
        # TCP loopback here (docs/ps.md, benchmark). NOTE [ps liveness]: an aggregation a
        # dead worker leaves open is aborted within the job's timeout
        self.shards = stack.enter_context(
            LocalShards(
                num_shards=cfg.num_ps_shards,
                tables=tables,
                seed=cfg.seed,
                transport="ipc",
                log_dir=run_dir,
                limits=ShardLimits(
                    aggregation_timeout_ms=cfg.timeout_ms,
                    max_rows=cfg.ps_max_rows,
                    max_shard_bytes=host_shard_bytes(cfg.num_ps_shards),  # NOTE [ps limits]: this host's share
                ),
                keys_dir=cfg.security.keys_dir,
                checkpoint_root=run_dir / "checkpoints",
                workdir=workdir,
            )
        )
        self.addresses = list(self.shards.addresses)
        for i, cores in enumerate(self.cores or ()):
            pin_to_cores(cores, self.shards.pid(i))
        self.client = stack.enter_context(job_client(cfg, self.addresses, tables, self.shards.admin_token))
        # a dead shard is named at the next check, a silent one after half the job's timeout
        self.watch = self.shards.watch(silent_ms=max(1, cfg.timeout_ms // 2))

    def check(self) -> None:
        self.watch()

    def fail(self, exc: HeraldError, workers: WorkerLauncher, silence: Silence | None = None) -> NoReturn:
        """:func:`raise_job_failure` of these shards and ``workers``."""
        raise_job_failure(exc, self.watch, workers, silence)

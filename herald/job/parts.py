"""The pluggable parts of a job, which :class:`herald.job.runner.JobRunner` puts together
(NOTE [job runner] in herald/job/runner.py):

- a **PS provider** (:class:`PSProvider`): where the PS shards are. :class:`LocalPS`
  starts them as local processes (``herald train``); :class:`RemotePS` dials shards
  started elsewhere and watches them (``herald serve dispatcher``, the test bed); the
  base class itself (:class:`NoPS`) is no PS at all (the capacity bench's fake workers
  never dial one).
- a **worker launcher** (:class:`WorkerLauncher`): who starts the workers.
  :class:`LocalWorkers` starts them as local processes (``herald train``);
  :class:`ExternalWorkers` starts none and says where to connect (``herald serve
  dispatcher``; the test bed's torchruns: :class:`herald.testbed.dispatcher.TestBedWorkers`);
  the capacity bench's fake workers are :class:`herald.bench.capacity.AckPeerWorkers`.
  Each part says how many processes it starts on this host (``local_processes``): with
  ``--pin-cores`` the runner gives them their cores (``cores``) before it opens them.
- the **checkpoints** (:class:`Checkpointing`): which
  :class:`~herald.job.checkpoints.DispatcherCheckpoints` the dispatcher writes and resumes from.

Security (docs/operations.md, "Securing a multi-host job"): with ``--keys DIR`` every
role's ZeroMQ traffic is CURVE (NOTE [transport security] in herald/auth.py); local PS
shards take admin ops (checkpoint, restore, shutdown) only with this job's token and
only inside ``RUN_DIR/checkpoints`` (NOTE [ps admin ops]); local workers' dense process
group rendezvous through a file in the run folder (no listening store) and gloo is kept
on the loopback interface (:func:`dense_store`, :func:`worker_env`). Remote shards'
admin token comes from ``HERALD_PS_TOKEN`` in the environment, never from a command line.

NOTE [local job sockets] (docs/operations.md, "What each mode exposes")
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every process of a ``herald train`` job runs on this host as this user, so none of its
ZeroMQ sockets listens where another user can connect: the PS shards bind ``ipc://``
sockets in their folder (:class:`LocalPS`), the dispatchers in another
(:meth:`LocalWorkers.dispatcher_bind`), both ``$TMPDIR/herald-*-XXXX`` made mode 0700 by
``tempfile.mkdtemp``. Connecting to a Unix socket needs search permission on its folder,
so another user's connect fails with EACCES (root's excepted), whatever the socket's own
mode; with loopback TCP, the old default, any local user could say ``hello`` first and
take a worker's rank, its job and its data. The workers' rendezvous is a file of mode
0600 in the run folder (:func:`dense_store`). The one listener left is gloo's (the dense
all-reduce between the workers): torch has no transport for it but TCP, so it listens on
the loopback interface (:func:`worker_env`), where any local user can connect, and
torch.distributed authenticates nobody; ``--keys`` does not cover it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import zmq

from herald.auth import load_client_keys, load_server_keys, loopback_interface
from herald.contracts.job import JobSpec
from herald.contracts.train import TrainConfig
from herald.dispatch.peers import Silence
from herald.errors import ConfigError, HeraldError
from herald.files import private_dir
from herald.job import leftovers
from herald.job.checkpoints import DispatcherCheckpoints
from herald.job.failover import shard_lost, watch_shards
from herald.job.rollback import ShardFailed, WorkerFailed
from herald.job.silence import killed_ranks, process_state, silent_culprits, silent_headline
from herald.procs import Supervisor, pin_to_cores, signal_words
from herald.ps import LocalShards, PSClient
from herald.ps.config import ShardLimits
from herald.worker.cli import worker_args

#: Longest path of a Unix socket (``sockaddr_un.sun_path`` less its NUL; 107 on Linux).
IPC_PATH_MAX_LEN = getattr(zmq, "IPC_PATH_MAX_LEN", 107)


def prepare_run(cfg: TrainConfig) -> pathlib.Path:
    """Check ``--keys`` (bad keys stop the job before anything starts: NOTE [transport
    security]), create the run folder with its ``checkpoints`` root (the shards'
    admin-op root, NOTE [ps admin ops]; mode 0700, NOTE [private files]) and remove what
    a killed job left there (NOTE [run leftovers] in herald/job/leftovers.py). Returns the
    run folder."""
    if cfg.security.keys_dir is not None:
        load_server_keys(cfg.security.keys_dir)
        load_client_keys(cfg.security.keys_dir)
    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    private_dir(run_dir / "checkpoints")
    leftovers.clean(run_dir)
    return run_dir


def raise_job_failure(exc: HeraldError, ps_alive: Any, children: Any, silence: Silence | None = None) -> NoReturn:
    """Stop the children and raise what a failed job reports: ``exc`` naming its cause.

    ``ps_alive``: the shards' liveness check (``failure()``); ``children``: the worker
    launcher (``failure(grace_s)``, ``exit_codes()``, ``describe(rank)``, ``stop()``);
    ``silence``: the dispatchers' view of the wait that failed. A dead or silent PS shard
    is the cause of whatever the workers report next (:class:`ShardFailed`: ``run_train``
    decides whether to roll back, NOTE [ps failover]); a worker's ``TrainingDiverged``
    says it all (step, rank, cause); a worker that went silent is named before the
    workers that timed out waiting on it (NOTE [silent workers] in herald/job/silence.py)
    and a worker a signal ended is put first: both are :class:`WorkerFailed` (lost, not
    failed: NOTE [worker failover] in herald/job/rollback.py); else a dead child's failure
    is put first (a worker's own error: the job ends).
    """
    seen = time.time()  # the loss seen (NOTE [worker failover]: the report's recovery time counts from here)
    cause = ps_alive.failure() or children.failure(grace_s=2.0)
    codes = children.exit_codes()  # before the stop: which still run, which a signal ended
    silent, killed = silent_culprits(silence, codes), killed_ranks(codes)
    head = silent_headline(silent, silence, children.describe) if silent else None
    children.stop()
    if "TrainingDiverged: " in str(exc):
        raise HeraldError(str(exc).split("TrainingDiverged: ", 1)[1]) from None
    shard_cause = ps_alive.failure()
    if shard_cause:
        raise ShardFailed(
            shard_cause if shard_cause in str(exc) else f"{shard_cause}\n(then: {exc})", seen_unix_s=seen
        ) from exc
    if head is not None:
        then = [cause] if cause else []
        then += [str(exc)] if not cause or cause not in str(exc) else []
        raise WorkerFailed(
            "\n".join([head, *(f"(then: {t})" for t in then)]),
            ranks=silent,
            cause=f"{', '.join(f'worker-{r}' for r in silent)} went silent",
            seen_unix_s=seen,
        ) from exc
    if killed:  # cause: children.failure() names a killed worker first, with its log's tail
        words = "; ".join(f"worker-{r} was killed by {signal_words(codes[r])}" for r in killed)
        raise WorkerFailed(
            cause if cause and cause in str(exc) else f"{cause or words}\n(then: {exc})",
            ranks=killed,
            cause=words,
            seen_unix_s=seen,
        ) from exc
    if cause and cause not in str(exc):
        raise HeraldError(f"{cause}\n(then: {exc})") from exc
    raise exc


# ------------------------------------------------------------------ PS providers
class PSProvider:
    """The PS part of a job: where its shards are. This base is no PS at all
    (:class:`NoPS`); the runner calls, in this order:

    - :meth:`prepare` before anything is read or started (checks, folders);
    - :meth:`open` once the job's data is open (its schema gives the tables): start or
      dial the shards, registering their cleanup on ``stack`` (left when the job ends);
      then :attr:`addresses` (shard order) and :attr:`client` (a :class:`PSClient`
      holding the admin token where there is one, or None) are set;
    - :meth:`check` as part of the dispatcher's liveness check (about every 0.5 s);
    - :meth:`fail` when the job failed: stop the workers and raise the job's error.

    ``cores``: with ``--pin-cores``, set before :meth:`open`: shard ``i``'s cores
    (``cores[i]``, one list per :meth:`local_processes`); None: not pinned.
    """

    cores: list[list[int]] | None = None

    def __init__(self, addresses: Sequence[str] = ()):
        self.addresses = list(addresses)
        self.client: PSClient | None = None

    def local_processes(self, cfg: TrainConfig) -> int:
        """How many processes :meth:`open` starts on this host (none here)."""
        return 0

    def prepare(self, cfg: TrainConfig) -> None:
        """Checks and folders before anything is read or started (none here)."""

    def open(self, cfg: TrainConfig, data: Any, stack: contextlib.ExitStack) -> None:
        """Start or dial the shards of ``cfg``'s tables (``data.schema``) (nothing here)."""

    def check(self) -> None:
        """Raise naming a dead or silent shard (nothing to check here)."""

    def fail(self, exc: HeraldError, workers: WorkerLauncher, silence: Silence | None = None) -> NoReturn:
        """Stop ``workers`` and raise ``exc`` (the job failed; no shard to blame here).
        ``silence``: the dispatchers' view of the wait that failed (NOTE [silent workers])."""
        workers.stop()
        raise exc


class NoPS(PSProvider):
    """No PS: workers that never dial one (the capacity bench's fake workers). The job names
    ``addresses`` (default: one that is never dialled) as its PS."""

    def __init__(self, addresses: Sequence[str] = ("tcp://127.0.0.1:1",)):
        super().__init__(addresses)


class LocalPS(PSProvider):
    """``cfg.num_ps_shards`` PS shards as local processes over ipc (``herald train``), their
    logs (``ps-shard-I.log``) and checkpoint root (``checkpoints``) in the run folder; a
    lost shard is :class:`ShardFailed` (NOTE [ps failover] rolls the job back), a lost
    worker :class:`WorkerFailed` (NOTE [worker failover]): :func:`raise_job_failure`.

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
        workdir = tempfile.mkdtemp(prefix=leftovers.PS_PREFIX)
        stack.callback(_drop, run_dir, workdir)
        leftovers.record(run_dir, workdir)
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
                limits=ShardLimits(aggregation_timeout_ms=cfg.timeout_ms, max_rows=cfg.ps_max_rows),
                keys_dir=cfg.security.keys_dir,
                checkpoint_root=run_dir / "checkpoints",
                workdir=workdir,
            )
        )
        self.addresses = list(self.shards.addresses)
        for i, cores in enumerate(self.cores or ()):
            pin_to_cores(cores, self.shards.pid(i))
        self.client = stack.enter_context(
            PSClient(
                self.addresses,
                tables=tables,
                timeout_ms=cfg.timeout_ms,
                num_workers=cfg.workers,
                keys_dir=cfg.security.keys_dir,
                admin_token=self.shards.admin_token,
            )
        )
        # a dead shard is named at the next check, a silent one after half the job's timeout
        self.watch = self.shards.watch(silent_ms=max(1, cfg.timeout_ms // 2))

    def check(self) -> None:
        self.watch()

    def fail(self, exc: HeraldError, workers: WorkerLauncher, silence: Silence | None = None) -> NoReturn:
        """:func:`raise_job_failure` of these shards and ``workers``."""
        raise_job_failure(exc, self.watch, workers, silence)


def _drop(run_dir: pathlib.Path, workdir: str) -> None:
    """Remove a local part's folder (the shards', the dispatchers' sockets) and its name in
    the run folder (NOTE [run leftovers])."""
    shutil.rmtree(workdir, ignore_errors=True)
    leftovers.forget(run_dir, workdir)


class RemotePS(PSProvider):
    """PS shards started elsewhere, at ``addresses`` (``herald serve dispatcher --ps``, the
    test bed): dialled with the admin token of ``HERALD_PS_TOKEN`` (if set, for checkpoint
    and restore), every shard pinged before the job starts (bounded by ``--timeout-ms``) and
    watched during it (:func:`herald.job.failover.watch_shards`). A lost shard ends the job
    with :class:`~herald.job.failover.ShardLost` (exit status 75, NOTE [ps failover across
    hosts]) naming the latest checkpoint of ``run_dir`` (None: the job writes none).
    """

    def __init__(self, addresses: Sequence[str], *, run_dir: str | None = None):
        super().__init__(addresses)
        self.run_dir = run_dir

    def open(self, cfg: TrainConfig, data: Any, stack: contextlib.ExitStack) -> None:
        self.watch = watch_shards(self.addresses, cfg.timeout_ms, cfg.security.keys_dir)  # NOTE [ps liveness]
        stack.callback(self.watch.close)
        self.client = stack.enter_context(
            PSClient(
                self.addresses,
                tables=cfg.tables(data.schema),
                timeout_ms=cfg.timeout_ms,
                num_workers=cfg.workers,
                keys_dir=cfg.security.keys_dir,
                admin_token=os.environ.get("HERALD_PS_TOKEN"),
            )
        )
        self.client.ping()  # every shard up (bounded by --timeout-ms) before the watch starts its clock

    def check(self) -> None:
        self.watch()

    def fail(self, exc: HeraldError, workers: WorkerLauncher, silence: Silence | None = None) -> NoReturn:
        """``exc`` as it was, or :func:`~herald.job.failover.shard_lost` when the watch saw a
        shard go silent (the symptom replaced by its cause)."""
        workers.stop()
        if self.watch.failure() is None:
            raise exc
        raise shard_lost(self.watch.failure(), self.run_dir) from exc


# ------------------------------------------------------------------ worker launchers
class WorkerLauncher:
    """The worker part of a job: who starts its workers. This base starts none and has
    nothing to check or stop. The runner calls, in this order:

    - :meth:`prepare` before anything is read or started;
    - :meth:`open` after the PS part (registering cleanups on ``stack``); then
      :attr:`dist_init` is the workers' ``torch.distributed`` init method for the job
      (None: ``env://``, e.g. under torchrun), and :meth:`dispatcher_bind` says where
      each dispatcher binds for these workers;
    - :meth:`start` once the dispatchers are bound: ``dispatchers[g]`` is group ``g``'s
      address (one dispatcher: a list of one); only a launcher whose
      :attr:`places_groups` is true is given one dispatcher per group (NOTE [independent
      groups]): it must tell each rank its group's dispatcher;
    - :meth:`check` in the dispatcher's liveness check; :meth:`wait` after the last step;
      :meth:`failure` and :meth:`stop` when the job failed;
    - :meth:`replicas_written` before the held-out evaluation (the report's), which reads
      every rank's ``dense-rank<r>.pt`` in the run folder.

    ``cores``: with ``--pin-cores``, set before :meth:`open`: rank ``r``'s cores
    (``cores[r]``, one list per :meth:`local_processes`); None: not pinned.
    """

    places_groups = False
    cores: list[list[int]] | None = None

    def __init__(self, dist_init: str | None = None):
        self.dist_init = dist_init

    def local_processes(self, cfg: TrainConfig) -> int:
        """How many processes :meth:`start` starts on this host (none here)."""
        return 0

    def prepare(self, cfg: TrainConfig) -> None:
        """Checks and folders before anything is read or started (none here)."""

    def open(self, cfg: TrainConfig, stack: contextlib.ExitStack) -> None:
        """What the workers need before they start (nothing here)."""

    def dispatcher_bind(self, group: int) -> str | None:
        """Where dispatcher ``group`` binds so that these workers reach it; None (here): its
        own ``bind`` setting (``herald serve dispatcher --bind``, the test bed's address)."""
        return None

    def start(self, cfg: TrainConfig, job: JobSpec, dispatchers: list[str]) -> None:
        """Start the ``cfg.workers`` workers of ``job`` against ``dispatchers`` (none here)."""

    def check(self) -> None:
        """Raise naming a worker that failed (nothing to check here)."""

    def wait(self) -> None:
        """After the dispatchers ended the job: wait for the workers to end (nothing here)."""

    def failure(self, grace_s: float = 0.0) -> str | None:
        """A message naming a worker that failed, or None."""
        return None

    def exit_codes(self) -> dict[int, int | None] | None:
        """Each worker's exit code by rank (None while it runs, negative: killed by that
        signal); None (here): the processes are not known (NOTE [silent workers])."""
        return None

    def describe(self, rank: int) -> str:
        """Rank ``rank``'s process and log, in words (a failure's headline)."""
        return "not started by this job"

    def stop(self) -> None:
        """Stop every worker still running (bounded)."""

    def replicas_written(self, cfg: TrainConfig) -> None:
        """Return once every rank's dense replica is in ``cfg.run_dir`` (already so here)."""


class ExternalWorkers(WorkerLauncher):
    """Workers started elsewhere (``herald serve worker`` on other hosts, torchrun): nothing
    is started here; :meth:`start` prints where they connect (``dispatcher listening on
    ADDRESS``, one line per dispatcher) and ``dist_init`` is what the job tells them
    (``herald serve dispatcher --dist-init``; None: ``env://``)."""

    def start(self, cfg: TrainConfig, job: JobSpec, dispatchers: list[str]) -> None:
        for address in dispatchers:
            print(f"dispatcher listening on {address}", flush=True)


@contextlib.contextmanager
def dense_store(run_dir: pathlib.Path) -> Iterator[str]:
    """The workers' ``torch.distributed`` init method: ``file://`` a fresh file in the run
    folder (torch's FileStore: no listening socket, unlike rank 0's TCPStore, which binds
    every interface); the file is removed when the job ends, or by the next job in the run
    folder when this one is killed (NOTE [run leftovers]). The file is made here, mode 0600
    (torch would make it 0644 under umask 022): it holds the workers' rendezvous (NOTE
    [local job sockets])."""
    path = run_dir.resolve() / f"{leftovers.STORE_PREFIX}{secrets.token_hex(8)}"
    leftovers.record(run_dir, path)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        yield f"file://{path}"
    finally:
        path.unlink(missing_ok=True)
        leftovers.forget(run_dir, path)


def worker_env() -> dict[str, str]:
    """Environment of the local workers: their intra-op threads, and gloo's interface
    (``GLOO_SOCKET_IFNAME``) on loopback unless the user chose one: the workers share
    this host, so their all-reduce connections need not listen on any other interface."""
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    lo = loopback_interface()
    if "GLOO_SOCKET_IFNAME" not in os.environ and lo is not None:
        env["GLOO_SOCKET_IFNAME"] = lo
    return env


class LocalWorkers(WorkerLauncher):
    """``cfg.workers`` worker processes on this host (``python -m herald serve worker``,
    supervised by :class:`~herald.procs.Supervisor`: they die with the job, a failed one is
    named with the tail of its log ``worker-R.log`` in the run folder), their dense process
    group's store a file in the run folder (:func:`dense_store`), their dispatchers' sockets
    ``ipc://`` in a private folder (:meth:`dispatcher_bind`, NOTE [local job sockets]).
    Places groups: rank ``R`` is rank ``R mod k`` of group ``R // k``'s dispatcher (k
    workers per dispatcher).

    With :attr:`cores`, rank ``R`` is pinned to ``cores[R]`` from its start and its torch
    intra-op threads are one per core (``OMP_NUM_THREADS``, unless set for the job).

    Attributes (once opened): children: the :class:`Supervisor`.
    """

    places_groups = True

    def local_processes(self, cfg: TrainConfig) -> int:
        return cfg.workers

    def prepare(self, cfg: TrainConfig) -> None:
        """Refuse a ``--device`` the workers of this host cannot train on (CUDA asked for
        and no GPU visible, ``cuda:N`` beyond them) before anything starts:
        :func:`~herald.worker.devices.check_device`, what each worker would raise."""
        if cfg.device.startswith("cuda"):  # on use: torch (1.2 s) stays off the launcher's start-up otherwise
            from herald.worker.devices import check_device

            check_device(cfg.device, cfg.workers)

    def open(self, cfg: TrainConfig, stack: contextlib.ExitStack) -> None:
        run_dir = pathlib.Path(cfg.run_dir)
        self.children = Supervisor(run_dir, new_session=True, env=worker_env())
        self.dist_init = stack.enter_context(dense_store(run_dir))
        # the dispatchers' sockets: a folder of mode 0700, named in the run folder until removed
        self.sockets = tempfile.mkdtemp(prefix=leftovers.DISPATCH_PREFIX)
        stack.callback(_drop, run_dir, self.sockets)
        leftovers.record(run_dir, self.sockets)
        longest = self.dispatcher_bind(max(cfg.groups.count, 1) - 1)[len("ipc://") :]
        if len(longest) > IPC_PATH_MAX_LEN:
            raise ConfigError(
                f"the dispatcher's socket {longest} would be longer than the {IPC_PATH_MAX_LEN} "
                "characters a Unix socket's path may have: set TMPDIR to a shorter folder "
                "(e.g. TMPDIR=/tmp)"
            )

    def dispatcher_bind(self, group: int) -> str:
        """``ipc://`` socket ``<group>.ipc`` in this job's private folder (NOTE [local job
        sockets]); short, as a Unix socket's whole path holds at most 107 characters."""
        return f"ipc://{self.sockets}/{group}.ipc"

    def start(self, cfg: TrainConfig, job: JobSpec, dispatchers: list[str]) -> None:
        """Start worker process ``rank`` for every rank (numbered as torchrun would: NOTE
        [worker devices]) as rank ``rank mod k`` of the ``k`` ranks its group's dispatcher serves."""
        k = cfg.workers // len(dispatchers)
        for rank in range(cfg.workers):
            group, group_rank = divmod(rank, k)
            cores = self.cores[rank] if self.cores else None
            self.children.env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(cfg.workers))
            if cores is not None and "OMP_NUM_THREADS" not in os.environ:
                self.children.env["OMP_NUM_THREADS"] = str(len(cores))
            self.children.start(
                f"worker-{rank}",
                [
                    sys.executable,
                    *worker_args(
                        dispatchers[group],
                        rank=group_rank,
                        world_size=k,
                        device=cfg.device,
                        cache_device=cfg.cache.device,
                        timeout_ms=cfg.timeout_ms,
                        keys_dir=job.keys_dir,
                    ),
                ],
                cores=cores,
            )

    def check(self) -> None:
        self.children.check()

    def wait(self) -> None:
        self.children.wait(timeout_s=60, context=" after the end of training")

    def failure(self, grace_s: float = 0.0) -> str | None:
        return self.children.failure(grace_s=grace_s)

    def exit_codes(self) -> dict[int, int | None]:
        return {int(name.rsplit("-", 1)[1]): p.poll() for name, p in self.children.procs.items()}

    def describe(self, rank: int) -> str:
        name = f"worker-{rank}"
        pid = self.children.procs[name].pid
        return f"pid {pid}, {process_state(pid)}; log {self.children.log_path(name)}"

    def stop(self) -> None:
        self.children.stop()


# ------------------------------------------------------------------ checkpoints
@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """The checkpoint part: the dispatcher resumes from ``RUN_DIR/checkpoints`` with
    ``--resume`` and, when ``enabled``, writes a checkpoint at each barrier
    (:class:`~herald.job.checkpoints.DispatcherCheckpoints`; ``who`` names the command in
    its messages). ``check_config``: write the job's hyper-parameters and consistency
    mode into every checkpoint and check them on resume (``herald train``)."""

    who: str
    enabled: bool
    check_config: bool = False

    def open(self, cfg: TrainConfig) -> DispatcherCheckpoints:
        """The job's checkpoints (finds the resume point; raises early on a bad one)."""
        return DispatcherCheckpoints(
            cfg.run_dir,
            resume=cfg.resume,
            enabled=self.enabled,
            who=self.who,
            config=cfg if self.check_config else None,
        )

"""``herald train``'s workers as local processes (:class:`LocalWorkers`), their dense
process group's store (:func:`dense_store`) and environment (:func:`worker_env`).

NOTE [local job sockets] (docs/operations.md, "What each mode exposes")
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every process of a ``herald train`` job runs on this host as this user, so none of its
ZeroMQ sockets listens where another user can connect: the PS shards bind ``ipc://``
sockets in their folder (:class:`~herald.job.parts.local_ps.LocalPS`), the dispatchers in another
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
import os
import pathlib
import secrets
import sys
from collections.abc import Iterator

import zmq

from herald.auth import loopback_interface
from herald.contracts.job import JobSpec
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.job.parts.base import WorkerLauncher
from herald.job.recovery import leftovers
from herald.job.recovery.silence import process_state
from herald.procs import Supervisor
from herald.worker.cli import worker_args
from herald.worker.script import script_failure, script_launch

#: Longest path of a Unix socket (``sockaddr_un.sun_path`` less its NUL; 107 on Linux).
IPC_PATH_MAX_LEN = getattr(zmq, "IPC_PATH_MAX_LEN", 107)


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

    With ``--script FILE`` each rank runs FILE instead of ``herald serve worker`` (NOTE [own
    script] in herald/worker/script.py).

    Attributes (once opened): children: the :class:`Supervisor`.
    """

    places_groups = True
    script: str | None = None  # --script's file (NOTE [own script] in herald/worker/script.py), once opened

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
        self.script = cfg.script.path
        self.children = Supervisor(run_dir, new_session=True, env=worker_env())
        self.dist_init = stack.enter_context(dense_store(run_dir))
        # the dispatchers' sockets: a folder of mode 0700, named in the run folder until removed
        self.sockets = leftovers.private_folder(run_dir, leftovers.DISPATCH_PREFIX, stack)
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
            settings = dict(
                rank=group_rank,
                world_size=k,
                device=cfg.device,
                cache_device=cfg.cache.device,
                timeout_ms=cfg.timeout_ms,
                keys_dir=job.keys_dir,
            )
            if cfg.script.path is None:
                args = worker_args(dispatchers[group], **settings)
            else:  # NOTE [own script] in herald/worker/script.py
                script = os.path.abspath(cfg.script.path)
                args, env = script_launch(script, cfg.script.args, dispatchers[group], **settings)
                self.children.env.update(env)
            self.children.start(f"worker-{rank}", [sys.executable, *args], cores=cores)

    def check(self) -> None:
        self.children.check()

    def wait(self) -> None:
        self.children.wait(timeout_s=60, context=" after the end of training")

    def failure(self, grace_s: float = 0.0) -> str | None:
        """The failed worker, with its log's end; with ``--script``, the first rank whose script
        raised, the script and its traceback's end (:func:`~herald.worker.script.script_failure`)."""
        cause = self.children.failure(grace_s=grace_s)
        if cause is None or self.script is None or "was killed by" in cause.split(";", 1)[0]:
            return cause
        logs = {int(name.rsplit("-", 1)[1]): self.children.log_path(name) for name in self.children.procs}
        return script_failure(logs, self.script) or cause

    def exit_codes(self) -> dict[int, int | None]:
        return {int(name.rsplit("-", 1)[1]): p.poll() for name, p in self.children.procs.items()}

    def describe(self, rank: int) -> str:
        name = f"worker-{rank}"
        pid = self.children.procs[name].pid
        return f"pid {pid}, {process_state(pid)}; log {self.children.log_path(name)}"

    def stop(self) -> None:
        self.children.stop()

"""``herald train --launcher ray``: the job's PS shards and workers as Ray actors placed over
the nodes of a Ray cluster (:class:`RayPS`, :class:`RayWorkers`, sharing one
:class:`~herald.job.ray.cluster.RayCluster`); the dispatcher stays in this process (NOTE [ray
job]).

NOTE [ray job] (docs/cluster.md)
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The job runner (NOTE [job runner]) composes the Ray parts as it does the local ones; what
differs is who starts each role and where:

- **The dispatcher stays in this process.** It reads the source, owns the progress bar,
  the signals, the checkpoints and the report, as under the local launcher; as an actor
  it would have to send every step's record back for them, and it is one process either
  way. So ``herald train`` runs on a node of the cluster (``ray job
  submit``, a KubeRay RayJob), never through Ray Client (``ray://``: refused).
- **Ray.** ``--ray-address`` (else ``RAY_ADDRESS``, which ``ray job submit`` sets):
  that cluster; neither: a local Ray instance started for the job (as many logical CPUs
  as the roles ask, at least this host's cores; no dashboard) and stopped after it. A
  connection this process already had is used and kept.
- **Placement.** One bundle per role (:func:`herald.job.ray.plan.role_requests`): a
  worker asks for ``OMP_NUM_THREADS`` CPUs (1 when unset) and, with ``--device cuda`` (or
  ``auto`` on a cluster with a GPU per worker), one GPU; a PS shard one CPU and its memory
  (rows of ``--ps-max-rows``, or its share of the training split's distinct keys, plus
  its base). Two placement groups, the workers' first: spread over the nodes, one worker
  per node (STRICT_SPREAD) when enough nodes can each hold one, else SPREAD (Ray's best
  effort: one SPREAD group of 2 workers and a shard over 2 nodes put both workers on one
  node in 9 of 12 tries); then the shards' (SPREAD), kept off the workers' nodes by a label selector
  (``ray.io/node-id``) when some other node can hold a shard, else beside the workers
  (:func:`herald.job.ray.plan.worker_strategy`, :func:`~herald.job.ray.plan.shard_selector`).
  Both are waited for (at least 60 s, or ``--timeout-ms``); a cluster that cannot hold
  them is named with what it has.
- **Roles.** One actor per bundle (:class:`herald.job.ray.role.RoleHost`) runs the same
  ``python -m herald serve ps|worker`` command line as the local parts, with its log in
  the run folder (``ps-shard-I.log``, ``worker-R.log``): the protocol code is the same.
- **Transport.** Every role on this process's node: ipc sockets in private folders, as
  NOTE [local job sockets]. Roles on several nodes: each PS shard binds TCP on its node's
  IP and the dispatcher on this node's, which NOTE [transport security] allows only with
  ``--keys`` or ``--insecure``: refused before any role starts otherwise.
- **What travels through Ray** (actor arguments and returns, never a command line):
  the shards' bound addresses, the tables, each role's half of the keys (shards: the
  servers' key pair and the authorised clients' keys; workers: the clients' key pair and
  the servers' public key), the PS admin token (the shard's environment: NOTE [ps admin
  ops]) and rank 0's address and port. A role writes what it is given into a private
  folder of its node (0700, files 0600), removed when it stops.
- **Dense group**, as torchrun sets it up: ``MASTER_ADDR`` (rank 0's node), ``MASTER_PORT``
  (a port free there), ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``;
  torch's TCP store on rank 0's node (it listens on every interface, whatever the host);
  on one node no ``MASTER_*`` but a FileStore in the run folder, as under the local
  launcher (:func:`herald.job.parts.local_workers.dense_store`: no listening socket);
  gloo on the interface of the node's IP (loopback on one node); NCCL when each worker
  has a GPU of its own (NOTE [worker devices]).
- **Files.** The run folder must be the same folder on every node that runs a role
  (PS checkpoints, dense replicas and logs are written there): the launcher writes a
  random token into ``RUN_DIR/.ray-run-check`` and every role reads it before anything
  starts; ``--storage-path`` names a shared folder for it (the run folder is then
  ``STORAGE_PATH/RUN_DIR``).
- **Liveness and failures** as under the local launcher: each check asks every role's
  actor how its child is (an actor that died, with its node, is a dead role), the PS
  shards are pinged too (NOTE [ps liveness]); a lost shard or worker is what it is under
  the local launcher (:func:`herald.job.recovery.failure.raise_job_failure`: a worker whose actor
  was lost counts as killed), so a rollback (NOTE [ps failover]) runs the next attempt
  with a fresh connection, placement and actors.
- **End** (also on a failure): every child stopped (SIGTERM, SIGKILL after 5 s), every
  actor killed, the placement groups removed, the Ray instance stopped if this job
  started it: no actor or process of the job is left.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from typing import Any, NoReturn

from herald.auth import loopback_interface
from herald.contracts.job import JobSpec
from herald.contracts.tables import tables_to_json
from herald.contracts.train import TrainConfig
from herald.dispatch.peers import Silence
from herald.errors import HeraldError, PeerLost, PeerTimeout
from herald.job.parts.base import PSProvider, WorkerLauncher, job_client
from herald.job.parts.local_ps import prepare_run
from herald.job.parts.local_workers import dense_store
from herald.job.ray.cluster import CallFailed, RayCluster
from herald.job.ray.plan import KEYS, dense_env, local_ranks, script_file, split_keys, worker_cpus
from herald.job.ray.role import FOLDER
from herald.job.recovery import leftovers
from herald.job.recovery.failure import raise_job_failure
from herald.ps.admin import TOKEN_ENV
from herald.ps.cli import shard_args
from herald.ps.config import ShardLimits
from herald.ps.watch import ShardWatch
from herald.worker.cli import worker_args
from herald.worker.script import script_failure, script_launch

#: How often the job's own PS client asks the shards' actors whether they live while it waits (s).
ACTOR_CHECK_S = 0.5


# ------------------------------------------------------------------ the PS part
class RayPS(PSProvider):
    """``cfg.num_ps_shards`` PS shards as Ray actors (NOTE [ray job]), each running ``python -m
    herald serve ps`` on its node; dialled with this job's admin token, watched (NOTE [ps
    liveness]); a lost shard fails the job as a local one does
    (:func:`~herald.job.recovery.failure.raise_job_failure`: NOTE [ps failover] may roll it back)."""

    def __init__(self, cluster: RayCluster):
        super().__init__()
        self.cluster = cluster

    def prepare(self, cfg: TrainConfig) -> None:
        """Keys checked, the run folder made, a killed job's leftovers removed (as :class:`LocalPS`)."""
        prepare_run(cfg)

    def open(self, cfg: TrainConfig, data: Any, stack: contextlib.ExitStack) -> None:
        cluster = self.cluster
        cluster.open(cfg, data, stack)
        self.roles = list(range(cfg.workers, cfg.workers + cfg.num_ps_shards))
        tables, token = cfg.tables(data.schema), secrets.token_hex(32)
        server_keys = split_keys(cfg.security.keys_dir)[0] if cfg.security.keys_dir else {}
        limits = ShardLimits(aggregation_timeout_ms=cfg.timeout_ms, max_rows=cfg.ps_max_rows)
        files = {"tables.json": tables_to_json(tables).encode(), **server_keys}

        def spec(i: int) -> tuple[list[str], dict[str, str], dict[str, bytes], str]:
            shard = i - cfg.workers
            bind = f"ipc://{FOLDER}/shard.ipc" if cluster.single else f"tcp://{cluster.nodes[i]['ip']}:*"
            args = shard_args(
                shard,
                cfg.num_ps_shards,
                bind,
                seed=cfg.seed,
                tables_file=f"{FOLDER}/tables.json",
                ready_file=f"{FOLDER}/ready",
                keys_dir=f"{FOLDER}/{KEYS}" if cfg.security.keys_dir else None,
                insecure=cfg.security.insecure,
                checkpoint_root=str(cluster.run_dir / "checkpoints"),
                limits=limits,
            )
            return args, {TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}, files, leftovers.PS_PREFIX

        cluster.start(self.roles, spec)  # their folders: named in the run folder (NOTE [run leftovers])
        self.addresses = self._wait_ready(cfg)
        self._looked = 0.0
        self.client = stack.enter_context(job_client(cfg, self.addresses, tables, token, self._alive))
        self.watch = ShardWatch(
            self.addresses,
            max(1, cfg.timeout_ms // 2),
            describe=self._describe,
            dead=self.failure,
            keys_dir=cfg.security.keys_dir,
        )
        stack.callback(self.watch.close)

    def _wait_ready(self, cfg: TrainConfig) -> list[str]:
        """Each shard's bound address, from its ready file (as :class:`herald.ps.LocalShards`).

        Raises:
            PeerTimeout: a shard not ready within the start-up wait; HeraldError: a shard ended.
        """
        deadline = time.monotonic() + self.cluster.startup_s
        while True:
            failed = self.failure()
            if failed:
                raise HeraldError(failed)
            addresses = self.cluster.call(self.roles, "read", "ready")
            if all(isinstance(a, str) and not isinstance(a, CallFailed) for a in addresses):
                return list(addresses)
            if time.monotonic() > deadline:
                late = next(i for i, a in zip(self.roles, addresses) if a is None or isinstance(a, CallFailed))
                raise PeerTimeout(
                    f"{self.cluster.requests[late].name} did not become ready within "
                    f"{self.cluster.startup_s:.0f} s ({self.cluster.describe(late)}); "
                    f"{self.cluster.log_tail(late)}",
                    peer=self.cluster.requests[late].name,
                    op="start",
                )
            time.sleep(0.05)

    def _describe(self, shard: int) -> str:
        i = self.roles[shard]
        return f"{self.cluster.describe(i)}; {self.cluster.log_tail(i)}"

    def failure(self) -> str | None:
        """A message naming the first shard whose process ended (or whose actor was lost),
        with its address, node and the end of its log; None while every shard runs."""
        for i, how in self.cluster.ended(self.roles).items():
            shard = i - self.roles[0]
            address = self.addresses[shard] if shard < len(self.addresses) else "(not ready)"
            return f"PS shard {shard} at {address} ({self.cluster.describe(i)}) {how}; {self.cluster.log_tail(i)}"
        return None

    def _alive(self, shard: int) -> None:
        """The job client's liveness check (NOTE [death notices]): a shard whose actor died, or
        whose child ended, fails the client's wait, asked at most every :data:`ACTOR_CHECK_S`
        (each question is a call to every shard's actor)."""
        now = time.monotonic()
        if now - self._looked < ACTOR_CHECK_S:
            return
        self._looked = now
        failed = self.failure()
        if failed:
            raise PeerLost(failed, peer=self.addresses[shard], op="request")

    def check(self) -> None:
        self.watch()

    def fail(self, exc: HeraldError, workers: WorkerLauncher, silence: Silence | None = None) -> NoReturn:
        """:func:`~herald.job.recovery.failure.raise_job_failure` of these shards and ``workers``."""
        raise_job_failure(exc, self.watch, workers, silence)


# ------------------------------------------------------------------ the worker part
class RayWorkers(WorkerLauncher):
    """``cfg.workers`` workers as Ray actors (NOTE [ray job]), each running ``python -m herald
    serve worker`` (or ``--script``'s file) on its node with torchrun's environment for its dense group; rank ``R``
    is rank ``R mod k`` of group ``R // k``'s dispatcher (k workers per dispatcher), as
    :class:`~herald.job.parts.LocalWorkers` places groups."""

    places_groups = True
    script: str | None = None  # --script's file (NOTE [own script] in herald/worker/script.py), once opened

    def __init__(self, cluster: RayCluster):
        super().__init__()
        self.cluster = cluster
        self.stopped = False

    def open(self, cfg: TrainConfig, stack: contextlib.ExitStack) -> None:
        """On one node: the dispatchers' private ipc folder (NOTE [local job sockets]) and the
        dense group's FileStore in the run folder, as under the local launcher: torch's
        TCPStore listens on every interface whatever ``MASTER_ADDR`` says."""
        self.roles = list(range(cfg.workers))
        self.script = cfg.script.path
        if self.cluster.single:
            run_dir = self.cluster.run_dir
            self.sockets = leftovers.private_folder(run_dir, leftovers.DISPATCH_PREFIX, stack)
            self.dist_init = stack.enter_context(dense_store(run_dir))

    def dispatcher_bind(self, group: int) -> str:
        """One node: ``ipc://`` in a private folder; several: TCP on this node's address, any port."""
        return f"ipc://{self.sockets}/{group}.ipc" if self.cluster.single else f"tcp://{self.cluster.driver_ip}:*"

    def start(self, cfg: TrainConfig, job: JobSpec, dispatchers: list[str]) -> None:
        cluster = self.cluster
        k = cfg.workers // len(dispatchers)
        client_keys = split_keys(cfg.security.keys_dir)[1] if cfg.security.keys_dir else {}
        threads = worker_cpus()
        local = local_ranks([cluster.nodes[r]["node_id"] for r in self.roles], cluster.gpus)
        master = None  # one node: the FileStore of open() (dist_init), no TCPStore
        if not cluster.single:
            master_port = cluster.call([0], "free_port")[0]
            if isinstance(master_port, CallFailed):
                raise HeraldError(f"worker-0 on {cluster.nodes[0]['ip']} could not start: {master_port}")
            master = (cluster.nodes[0]["ip"], master_port)

        def spec(rank: int) -> tuple[list[str], dict[str, str], dict[str, bytes], str]:
            group, group_rank = divmod(rank, k)
            ifname = loopback_interface() if cluster.single else cluster.nodes[rank]["ifname"]
            env = dense_env(
                rank, cfg.workers, local[rank], master, threads, os.environ.get("GLOO_SOCKET_IFNAME", ifname)
            )
            settings = dict(
                rank=group_rank,
                world_size=k,
                device="cuda" if cluster.gpus else "cpu",
                cache_device=cfg.cache.device,
                timeout_ms=cfg.timeout_ms,
                keys_dir=f"{FOLDER}/{KEYS}" if cfg.security.keys_dir else None,
            )
            if cfg.script.path is None:
                return worker_args(dispatchers[group], **settings), env, client_keys, leftovers.WORKER_PREFIX
            # NOTE [own script] in herald/worker/script.py; on several nodes its file travels with the role
            path, files = script_file(cfg.script.path, cluster.single, FOLDER)
            args, script_vars = script_launch(path, cfg.script.args, dispatchers[group], **settings)
            return args, {**env, **script_vars}, {**client_keys, **files}, leftovers.WORKER_PREFIX

        cluster.start(self.roles, spec)

    def failure(self, grace_s: float = 0.0) -> str | None:
        """A message naming a worker that failed (a lost actor or a child killed by a signal
        before one that exited with an error: the error is often the echo of that death),
        waiting up to ``grace_s`` for one; None when none did."""
        deadline = time.monotonic() + grace_s
        while not self.stopped:
            failed = {r: how for r, how in self.cluster.ended(self.roles).items() if how != "exited with code 0"}
            if failed:
                rank = min(
                    failed, key=lambda r: ("signal" not in failed[r] and not isinstance(failed[r], CallFailed), r)
                )
                cause = f"worker-{rank} {failed[rank]} ({self.cluster.describe(rank)}); {self.cluster.log_tail(rank)}"
                if self.script is None or "signal" in str(failed[rank]) or isinstance(failed[rank], CallFailed):
                    return cause
                logs = {r: self.cluster.run_dir / f"worker-{r}.log" for r in failed}  # the run folder: on every node
                return script_failure(logs, self.script) or cause
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        return None

    def check(self) -> None:
        failure = self.failure()
        if failure:
            raise HeraldError(failure)

    def wait(self) -> None:
        """Every worker ended (at most 60 s after the end of training), then :meth:`check`."""
        deadline = time.monotonic() + 60
        while True:
            codes = self.exit_codes()
            if all(code is not None for code in codes.values()):
                break
            if time.monotonic() > deadline:
                rank = next(r for r, code in codes.items() if code is None)
                raise HeraldError(
                    f"worker-{rank} did not exit within 60 s after the end of training "
                    f"({self.cluster.describe(rank)}); {self.cluster.log_tail(rank)}"
                )
            time.sleep(0.1)
        self.check()

    def exit_codes(self) -> dict[int, int | None]:
        """Each worker's exit code by rank (None while it runs; -9: its actor was lost)."""
        return {
            r: -9 if isinstance(code, CallFailed) else code
            for r, code in zip(self.roles, self.cluster.call(self.roles, "poll"))
        }

    def describe(self, rank: int) -> str:
        return f"{self.cluster.describe(rank)}; log {self.cluster.run_dir / f'worker-{rank}.log'}"

    def stop(self) -> None:
        self.stopped = True
        self.cluster.stop(self.roles)


def ray_parts(cfg: TrainConfig) -> tuple[RayPS, RayWorkers]:
    """The PS and worker parts of ``herald train --launcher ray`` (NOTE [ray job]), sharing one
    :class:`RayCluster`. Ray itself is imported once the job opens its PS part."""
    cluster = RayCluster()
    return RayPS(cluster), RayWorkers(cluster)

"""A herald job across the test bed's hosts: real processes, real TCP between namespaces.

NOTE [test bed job]: host ``ps`` runs the PS shards (``herald serve ps``, shard ``i``
on port ``6000 + i``); host ``dispatcher`` runs torchrun's rendezvous store (port
29400, :mod:`herald.testbed.store`) and the dispatcher (port 5555,
:mod:`herald.testbed.dispatcher`: ``herald serve dispatcher`` plus the report); every
worker host runs ``torchrun --nnodes H --nproc-per-node P --rdzv-backend c10d
--rdzv-endpoint <dispatcher>:29400 -m herald serve worker`` (the rank and world size
from torchrun's ``RANK`` / ``WORLD_SIZE``). Every address is the host's bed address, so all
traffic (ZeroMQ to the PS and the dispatcher, gloo's all-reduce, which is pinned to
``eth0``) crosses the shaped links. The hosts share the file system: the run folder
holds the settings, the workers' dense replicas, the report and
(``save_ps``) a final PS checkpoint. Security (NOTE [transport security]): with
``keys_dir`` every role gets ``--keys``; without, the bed is a private network and the
binding roles get ``--insecure``. The PS admin token is made per job and passed in the
environment of the PS and the dispatcher only.

NOTE [test bed failover]: NOTE [ps failover across hosts] (herald/job/recovery/failover.py) with
this module as the supervisor. With ``cfg.recovery.ps_restarts`` N > 0 and
``cfg.checkpoint_every`` > 0, a PS shard process that ends during training (seen at
once: the bed started it), or a dispatcher that exits with status 75 (it lost a shard),
starts a failover, decided and recorded by the failover policy (NOTE [failover policy] in
herald/job/recovery/policy.py): the dispatcher and the torchruns are stopped (SIGTERM, SIGKILL after
5 s) and every process left on the worker hosts is killed; every PS shard is started
afresh on the PS host; the dispatcher is started again with ``resume`` (it restores the
shards from the latest checkpoint through the admin op, gives the workers that
checkpoint's dense state and continues from its position); the workers join a new
rendezvous (``--rdzv-id ...-<attempt>``). At most N times; without a checkpoint, or
beyond N, the job fails naming the shard. Every wait is bounded by the job's
``timeout_s``. The report gets ``failovers``: per failover the policy's record (the cause,
when it was seen, the checkpoint rolled back to: ``rolled_back_to``, ``checkpoint_step``; the
last step every worker had acked before: ``last_acked_step``, ``steps_rolled_back`` = the
difference, trained twice; ``resumed_unix_s`` and ``recovered_s``: the first step acked past
the checkpoint, and the seconds to it from the loss seen) and the seconds to restart the roles
(``restart_s``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any

from herald.errors import ConfigError, HeraldError, PeerTimeout
from herald.job.recovery.failover import SHARD_FAILED_EXIT
from herald.job.recovery.policy import Budget, FailoverPolicy, RollbackRefused
from herald.ps.cli import shard_args
from herald.ps.config import ShardLimits
from herald.testbed.dispatcher import last_step, save_config
from herald.testbed.netns import TestBed
from herald.worker.cli import worker_args

PS_HOST, DISPATCHER_HOST = "ps", "dispatcher"
PS_PORT, DISPATCHER_PORT, RENDEZVOUS_PORT = 6000, 5555, 29400
_REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def bed_hosts(worker_hosts: int) -> list[str]:
    """Host names of a bed for :func:`run_job`: ``ps``, ``dispatcher``, ``worker0`` .. ``worker<H-1>``."""
    if not (isinstance(worker_hosts, int) and 1 <= worker_hosts <= 64):
        raise ConfigError(f"worker hosts must be an integer in 1..64, got {worker_hosts!r}")
    return [PS_HOST, DISPATCHER_HOST] + [f"worker{i}" for i in range(worker_hosts)]


def worker_hosts_of(bed: TestBed) -> list[str]:
    return [h for h in bed.names if h not in (PS_HOST, DISPATCHER_HOST)]


def run_job(
    bed: TestBed,
    cfg,
    *,
    procs_per_host: int = 1,
    save_ps: str | None = None,
    timeout_s: float = 600.0,
    tag: str = "job",
    role_args: dict[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Train ``cfg`` across ``bed`` (NOTE [test bed job]); returns the report dict, with
    ``failovers`` (NOTE [test bed failover]: ``cfg.recovery.ps_restarts`` with ``cfg.checkpoint_every``).

    Args:
        bed: an open :class:`TestBed` whose hosts are :func:`bed_hosts`.
        cfg: the :class:`~herald.contracts.train.TrainConfig`; ``cfg.workers`` must equal
            worker hosts x ``procs_per_host``; ``cfg.run_dir`` is shared by every host.
        procs_per_host: workers per worker host (torchrun ``--nproc-per-node``).
        save_ps: checkpoint the PS into this folder (inside ``cfg.run_dir``) after training.
        timeout_s: bound on the whole job; tag: prefix of the roles' names and logs.
        role_args: extra command-line arguments per role (``"ps"``, ``"dispatcher"``,
            ``"worker"``), e.g. to test a failing role.

    Raises:
        ConfigError: worker count mismatch, a missing host, ``worker_restarts`` (``ps_restarts``
            without ``checkpoint_every`` is refused by the TrainConfig itself). HeraldError: a role
            failed (named, with the end of its log), or a PS shard was lost beyond ``ps_restarts``.
            PeerTimeout: the job ran past ``timeout_s``.
    """
    workers = worker_hosts_of(bed)
    _check_job(cfg, len(workers), procs_per_host)
    run_dir = pathlib.Path(cfg.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "report.json").unlink(missing_ok=True)
    if cfg.security.keys_dir is None:
        cfg = cfg.with_flags(insecure=True)  # a private network: no keys needed
    (run_dir / ".dispatcher-step").unlink(missing_ok=True)
    launch = _Launch(bed, cfg, run_dir, tag, dict(role_args or {}))
    deadline = time.monotonic() + timeout_s
    try:
        # all at once: ZeroMQ connects when the peer comes up, torchrun retries its store
        launch.start_ps()
        launch.start_rendezvous()
        launch.start_dispatcher(save_ps)
        launch.start_workers(workers, procs_per_host)
        while (lost := launch.wait_done(deadline)) is not None:  # NOTE [test bed failover]
            launch.fail_over(lost, save_ps, deadline)
    finally:
        launch.stop()  # the bed may run another job next
    report_path = run_dir / "report.json"
    rep = json.loads(report_path.read_text())
    rep["failovers"] = launch.policy.failovers
    report_path.write_text(json.dumps(rep, indent=2))
    return rep


def _check_job(cfg, worker_hosts: int, procs_per_host: int) -> None:
    """Refuse what the test bed cannot run (:func:`run_job`).

    Raises:
        ConfigError: ``worker_restarts`` set, or ``cfg.workers`` not worker hosts x ``procs_per_host``.
    """
    if cfg.recovery.worker_restarts:
        raise ConfigError(
            f"--worker-restarts {cfg.recovery.worker_restarts}: the test bed rolls a job back for a lost PS "
            "shard (--ps-restarts), not for a lost worker (herald train does: NOTE [worker failover] in "
            "herald/job/recovery/rollback.py); leave it out"
        )
    if cfg.workers != worker_hosts * procs_per_host:
        raise ConfigError(
            f"--workers {cfg.workers} must equal the bed's {worker_hosts} worker hosts x "
            f"{procs_per_host} processes per host"
        )


class _Launch:
    """The roles of one job on a bed (NOTE [test bed job]); each method starts or waits."""

    def __init__(self, bed: TestBed, cfg, run_dir: pathlib.Path, tag: str, role_args: dict):
        self.bed, self.cfg, self.run_dir, self.tag, self.role_args = bed, cfg, run_dir, tag, role_args
        self.token = secrets.token_hex(32)
        self.env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": _REPO_ROOT}
        self.ps_addresses = [f"tcp://{bed.address(PS_HOST)}:{PS_PORT + i}" for i in range(cfg.num_ps_shards)]
        self.dispatcher = f"tcp://{bed.address(DISPATCHER_HOST)}:{DISPATCHER_PORT}"
        self.services: list[str] = []  # roles that serve until stopped: PS shards, rendezvous store
        self.finishing: list[str] = []  # roles that end with the job: dispatcher, torchrun per host
        # NOTE [test bed failover]: a lost PS shard rolls the job back, --ps-restarts times at most
        self.policy = FailoverPolicy(
            run_dir, {"ps": Budget(cfg.recovery.ps_restarts, "--ps-restarts")}, resumed=cfg.resume
        )
        self.worker_hosts: list[str] = []
        self.procs_per_host = 1
        self._seen_step: int | None = None  # the step last read from the dispatcher's step file

    def _start(self, host: str, role: str, argv: list[str], env: dict | None = None) -> str:
        """Start a role (a restart reuses its name: its log goes on in the same file)."""
        name = f"{self.tag}-{role}"
        self.bed.run(host, argv, name=name, env={**self.env, **(env or {})})
        return name

    @staticmethod
    def _track(names: list[str], name: str) -> None:
        if name not in names:
            names.append(name)

    def start_ps(self) -> None:
        for i, address in enumerate(self.ps_addresses):
            name = self._start(
                PS_HOST,
                f"ps-{i}",
                [
                    sys.executable,
                    *shard_args(
                        i,
                        len(self.ps_addresses),
                        address,
                        seed=self.cfg.seed,
                        keys_dir=self.cfg.security.keys_dir,
                        insecure=not self.cfg.security.keys_dir,
                        checkpoint_root=str(self.run_dir),
                        limits=ShardLimits(
                            aggregation_timeout_ms=self.cfg.timeout_ms, max_contributors=self.cfg.workers
                        ),
                    ),
                    *self.role_args.get("ps", ()),
                ],
                env={"HERALD_PS_TOKEN": self.token},
            )
            self._track(self.services, name)

    def start_rendezvous(self) -> None:
        self.services.append(
            self._start(
                DISPATCHER_HOST,
                "rendezvous",
                [
                    sys.executable,
                    "-m",
                    "herald.testbed.store",
                    "--host",
                    self.bed.address(DISPATCHER_HOST),
                    "--port",
                    str(RENDEZVOUS_PORT),
                ],
            )
        )

    def start_dispatcher(self, save_ps: str | None, resume: bool = False) -> None:
        cfg = dataclasses.replace(self.cfg, resume=True) if resume else self.cfg
        config = save_config(cfg, self.run_dir / f".{self.tag}-job.json")
        name = self._start(
            DISPATCHER_HOST,
            "dispatcher",
            [
                sys.executable,
                "-m",
                "herald.testbed.dispatcher",
                "--config",
                str(config),
                "--bind",
                self.dispatcher,
                "--ps",
                ",".join(self.ps_addresses),
                *(["--save-ps", str(save_ps)] if save_ps else []),
                *self.role_args.get("dispatcher", ()),
            ],
            env={"HERALD_PS_TOKEN": self.token},
        )
        self._track(self.finishing, name)

    def start_workers(self, hosts: list[str], procs_per_host: int) -> None:
        self.worker_hosts, self.procs_per_host = list(hosts), procs_per_host
        done = len(self.policy.failovers)
        attempt = f"-{done}" if done else ""  # a fresh rendezvous per attempt
        rendezvous = f"{self.bed.address(DISPATCHER_HOST)}:{RENDEZVOUS_PORT}"
        join_s = max(30, self.cfg.timeout_ms // 1000)
        for host in hosts:
            name = self._start(
                host,
                f"workers@{host}",
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    str(len(hosts)),
                    "--nproc-per-node",
                    str(procs_per_host),
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    rendezvous,
                    "--rdzv-id",
                    f"{self.bed.uid}-{self.tag}{attempt}",
                    "--rdzv-conf",
                    f"is_host=false,join_timeout={join_s}",
                    "--local-addr",
                    self.bed.address(host),
                    "--max-restarts",
                    "0",
                    "--monitor-interval",
                    "0.2",
                    *worker_args(
                        self.dispatcher,
                        device=self.cfg.device,
                        cache_device=self.cfg.cache.device,
                        timeout_ms=self.cfg.timeout_ms,
                        keys_dir=self.cfg.security.keys_dir,
                    ),
                    *self.role_args.get("worker", ()),
                ],
                env={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": self.bed.hosts[host].interface},
            )
            self._track(self.finishing, name)

    def wait_done(self, deadline: float) -> str | None:
        """Wait until the dispatcher and every torchrun have exited; raise on the first
        failure. Returns None when the job ended, or (failover allowed: ``cfg.recovery.ps_restarts``)
        the cause of a lost PS shard (NOTE [test bed failover])."""
        procs = self.bed.children.procs
        while any(procs[n].poll() is None for n in self.finishing):
            lost = self._lost_shard()
            if lost:
                return lost
            self._note_recovery()
            self._check()
            if any(procs[n].poll() is not None for n in self.services):
                raise HeraldError(
                    f"{next(n for n in self.services if procs[n].poll() is not None)} stopped during training"
                )
            if time.monotonic() > deadline:
                late = [n for n in self.finishing if procs[n].poll() is None]
                raise PeerTimeout(
                    f"the job on the test bed ran past its time limit; still running: {late}; "
                    f"last lines of {self.bed.log_path(late[0])}:\n{self.bed.children.tail(late[0])}",
                    peer=late[0],
                )
            time.sleep(0.1)
        lost = self._lost_shard()
        if lost:
            return lost
        self._note_recovery()
        self._check()
        return None

    def _lost_shard(self) -> str | None:
        """A PS shard process that ended, or a dispatcher that exited with 75 (it lost a
        shard), as a message; None when neither, when failover is off, or once the
        dispatcher has finished the job (exit status 0: the PS is no longer needed)."""
        children = self.bed.children
        if not self.cfg.recovery.ps_restarts or children.procs[f"{self.tag}-dispatcher"].poll() == 0:
            return None
        for name in self.services:
            if name.startswith(f"{self.tag}-ps-") and children.procs[name].poll() is not None:
                return f"PS shard {name.rsplit('-', 1)[1]} ({name} on host {PS_HOST}) {children.exit_status(name)}"
        name = f"{self.tag}-dispatcher"
        if children.procs[name].poll() == SHARD_FAILED_EXIT:
            said = [line for line in children.tail(name, 5).splitlines() if "PS shard" in line]
            return said[-1] if said else f"{name} lost a PS shard (exit status {SHARD_FAILED_EXIT})"
        return None

    def fail_over(self, cause: str, save_ps: str | None, deadline: float) -> None:
        """Roll the job back to its latest checkpoint (NOTE [test bed failover]).

        Raises:
            HeraldError: no checkpoint of this job yet, or ``cfg.recovery.ps_restarts`` failovers already done.
        """
        seen = time.time()
        try:
            latest = self.policy.check("ps")
        except RollbackRefused as refused:
            raise HeraldError(f"the job on the test bed lost a PS shard: {cause} ({_why(refused)})") from None
        print(
            f"herald test bed: {cause}\nrolling the job back to checkpoint {latest.path.name} (failover "
            f"{self.policy.used('ps') + 1} of at most {self.cfg.recovery.ps_restarts})",
            file=sys.stderr,
            flush=True,
        )
        for name in self.finishing + [n for n in self.services if n.startswith(f"{self.tag}-ps-")]:
            self.bed.children.terminate(name, timeout_s=5.0)
        self.bed.empty_hosts(self.worker_hosts, timeout_s=max(1.0, min(10.0, deadline - time.monotonic())))
        record = self.policy.record_rollback("ps", cause, seen, last_acked=last_step(self.run_dir), restart_s=None)
        (self.run_dir / ".dispatcher-step").unlink(missing_ok=True)
        self._seen_step = None
        self.start_ps()
        self.start_dispatcher(save_ps, resume=True)
        self.start_workers(self.worker_hosts, self.procs_per_host)
        record["restart_s"] = round(time.time() - seen, 3)

    def _note_recovery(self) -> None:
        """Tell the policy each new step the dispatcher saw acked: the first past the checkpoint
        after a failover is when training went on (``recovered_s``)."""
        step = last_step(self.run_dir)
        if step is not None and step != self._seen_step:
            self._seen_step = step
            self.policy.acked(step)

    def _check(self) -> None:
        failure = self.bed.children.failure()
        if failure:
            raise HeraldError(f"the job on the test bed failed: role {failure}")

    def stop(self) -> None:
        """Stop this job's roles still running (SIGTERM, SIGKILL after 5 s)."""
        for name in self.finishing + self.services:
            self.bed.children.terminate(name, timeout_s=5.0)


def _why(refused: RollbackRefused) -> str:
    """Why the test bed does not roll back, in its words (NOTE [test bed failover])."""
    if refused.reason == "no checkpoint":
        return "no checkpoint to roll back to yet"
    if refused.reason == "unreadable":
        return f"cannot read the latest checkpoint: {refused.detail}"
    return f"{refused.used} failover(s) done, {refused.budget.flag} {refused.budget.allowed}"

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
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import secrets
import sys
import time
from typing import Any, Sequence

from herald.errors import ConfigError, HeraldError, PeerTimeout
from herald.testbed.dispatcher import save_config
from herald.testbed.netns import TestBed

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


def run_job(bed: TestBed, cfg, *, procs_per_host: int = 1, save_ps: str | None = None, timeout_s: float = 600.0,
            tag: str = "job", role_args: dict[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """Train ``cfg`` across ``bed`` (NOTE [test bed job]); returns the report dict.

    Args:
        bed: an open :class:`TestBed` whose hosts are :func:`bed_hosts`.
        cfg: the :class:`~herald.job.spec.TrainConfig`; ``cfg.workers`` must equal
            worker hosts x ``procs_per_host``; ``cfg.run_dir`` is shared by every host.
        procs_per_host: workers per worker host (torchrun ``--nproc-per-node``).
        save_ps: checkpoint the PS into this folder (inside ``cfg.run_dir``) after training.
        timeout_s: bound on the whole job; tag: prefix of the roles' names and logs.
        role_args: extra command-line arguments per role (``"ps"``, ``"dispatcher"``,
            ``"worker"``), e.g. to test a failing role.

    Raises:
        ConfigError: worker count mismatch, a missing host. HeraldError: a role failed
            (named, with the end of its log). PeerTimeout: the job ran past ``timeout_s``.
    """
    workers = worker_hosts_of(bed)
    if cfg.workers != len(workers) * procs_per_host:
        raise ConfigError(f"--workers {cfg.workers} must equal the bed's {len(workers)} worker hosts x "
                          f"{procs_per_host} processes per host")
    run_dir = pathlib.Path(cfg.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "report.json").unlink(missing_ok=True)
    if cfg.keys_dir is None:
        cfg = dataclasses.replace(cfg, insecure=True)   # a private network: no keys needed
    launch = _Launch(bed, cfg, run_dir, tag, dict(role_args or {}))
    deadline = time.monotonic() + timeout_s
    try:
        # all at once: ZeroMQ connects when the peer comes up, torchrun retries its store
        launch.start_ps()
        launch.start_rendezvous()
        launch.start_dispatcher(save_ps)
        launch.start_workers(workers, procs_per_host)
        launch.wait_done(deadline)
    finally:
        launch.stop()   # the bed may run another job next
    return json.loads((run_dir / "report.json").read_text())


class _Launch:
    """The roles of one job on a bed (NOTE [test bed job]); each method starts or waits."""

    def __init__(self, bed: TestBed, cfg, run_dir: pathlib.Path, tag: str, role_args: dict):
        self.bed, self.cfg, self.run_dir, self.tag, self.role_args = bed, cfg, run_dir, tag, role_args
        self.token = secrets.token_hex(32)
        self.env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": _REPO_ROOT}
        self.security = ["--keys", str(cfg.keys_dir)] if cfg.keys_dir else ["--insecure"]
        self.ps_addresses = [f"tcp://{bed.address(PS_HOST)}:{PS_PORT + i}" for i in range(cfg.num_ps_shards)]
        self.dispatcher = f"tcp://{bed.address(DISPATCHER_HOST)}:{DISPATCHER_PORT}"
        self.services: list[str] = []    # roles that serve until stopped: PS shards, rendezvous store
        self.finishing: list[str] = []   # roles that end with the job: dispatcher, torchrun per host

    def _start(self, host: str, role: str, argv: list[str], env: dict | None = None) -> str:
        name = f"{self.tag}-{role}"
        self.bed.run(host, argv, name=name, env={**self.env, **(env or {})})
        return name

    def start_ps(self) -> None:
        for i, address in enumerate(self.ps_addresses):
            name = self._start(PS_HOST, f"ps-{i}", [
                sys.executable, "-m", "herald", "serve", "ps", "--shard", str(i), "--num-shards",
                str(len(self.ps_addresses)), "--bind", address, "--seed", str(self.cfg.seed),
                "--aggregation-timeout-ms", str(self.cfg.timeout_ms),
                "--max-contributors", str(self.cfg.workers), "--checkpoint-root", str(self.run_dir),
                *self.security, *self.role_args.get("ps", ())], env={"HERALD_PS_TOKEN": self.token})
            self.services.append(name)

    def start_rendezvous(self) -> None:
        self.services.append(self._start(DISPATCHER_HOST, "rendezvous", [
            sys.executable, "-m", "herald.testbed.store", "--host", self.bed.address(DISPATCHER_HOST),
            "--port", str(RENDEZVOUS_PORT)]))

    def start_dispatcher(self, save_ps: str | None) -> None:
        config = save_config(self.cfg, self.run_dir / f".{self.tag}-job.json")
        name = self._start(DISPATCHER_HOST, "dispatcher", [
            sys.executable, "-m", "herald.testbed.dispatcher", "--config", str(config), "--bind", self.dispatcher,
            "--ps", ",".join(self.ps_addresses), *(["--save-ps", str(save_ps)] if save_ps else []),
            *self.role_args.get("dispatcher", ())], env={"HERALD_PS_TOKEN": self.token})
        self.finishing.append(name)

    def start_workers(self, hosts: list[str], procs_per_host: int) -> None:
        rendezvous = f"{self.bed.address(DISPATCHER_HOST)}:{RENDEZVOUS_PORT}"
        join_s = max(30, self.cfg.timeout_ms // 1000)
        for host in hosts:
            name = self._start(host, f"workers@{host}", [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)),
                "--nproc-per-node", str(procs_per_host), "--rdzv-backend", "c10d", "--rdzv-endpoint", rendezvous,
                "--rdzv-id", f"{self.bed.uid}-{self.tag}", "--rdzv-conf", f"is_host=false,join_timeout={join_s}",
                "--local-addr", self.bed.address(host), "--max-restarts", "0", "--monitor-interval", "0.2",
                "-m", "herald", "serve", "worker", "--dispatcher", self.dispatcher, "--timeout-ms",
                str(self.cfg.timeout_ms), "--device", self.cfg.device, "--cache-device", self.cfg.cache_device,
                *(["--keys", str(self.cfg.keys_dir)] if self.cfg.keys_dir else []),
                *self.role_args.get("worker", ())],
                env={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": self.bed.hosts[host].interface})
            self.finishing.append(name)

    def wait_done(self, deadline: float) -> None:
        """Wait until the dispatcher and every torchrun have exited; raise on the first failure."""
        procs = self.bed.children.procs
        while any(procs[n].poll() is None for n in self.finishing):
            self._check()
            if any(procs[n].poll() is not None for n in self.services):
                raise HeraldError(f"{next(n for n in self.services if procs[n].poll() is not None)} stopped "
                                  "during training")
            if time.monotonic() > deadline:
                late = [n for n in self.finishing if procs[n].poll() is None]
                raise PeerTimeout(f"the job on the test bed ran past its time limit; still running: {late}; "
                                  f"last lines of {self.bed.log_path(late[0])}:\n{self.bed.children.tail(late[0])}",
                                  peer=late[0])
            time.sleep(0.1)
        self._check()

    def _check(self) -> None:
        failure = self.bed.children.failure()
        if failure:
            raise HeraldError(f"the job on the test bed failed: role {failure}")

    def stop(self) -> None:
        """Stop this job's roles still running (SIGTERM, SIGKILL after 5 s)."""
        for name in self.finishing + self.services:
            self.bed.children.terminate(name, timeout_s=5.0)

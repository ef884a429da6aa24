"""Run PS shards as local processes (``herald serve ps``) for tests, benchmarks and
``herald train``; their liveness (NOTE [ps liveness] in :mod:`herald.ps.watch`)."""

from __future__ import annotations

import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from herald.contracts.tables import TableConfig, check_tables, tables_to_json
from herald.contracts.vocab import DEFAULT_TIMEOUT_MS
from herald.deaths import notice_path, write_notice
from herald.errors import ConfigError, HeraldError, PeerTimeout, StorageError
from herald.procs import Supervisor
from herald.ps.admin import TOKEN_ENV, check_token
from herald.ps.cli import shard_args
from herald.ps.config import ShardLimits
from herald.ps.watch import ShardWatch

_REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


class LocalShards:
    """``num_shards`` shard processes on loopback, bound to free ports.

    Args:
        num_shards: shards to start (>= 1).
        tables: declared at start through ``--tables``.
        seed: initialiser seed passed to every shard.
        host: interface to bind (loopback by default).
        transport: ``"tcp"`` (``tcp://host:PORT``, free ports) or ``"ipc"`` (a Unix socket
            in :attr:`workdir`: same host only, ~2.7x the bandwidth of TCP loopback).
        startup_timeout_ms: how long a shard may take to become ready (kernel
            compilation on a cold numba cache included).
        limits: NOTE [ps limits] of every shard (``herald serve ps --max-*`` options);
            None: the :class:`~herald.ps.config.ShardLimits` defaults.
        log_dir: folder of the shard logs (``ps-shard-I.log``; kept after :meth:`close`),
            e.g. the run folder of a job; None: :attr:`workdir` (deleted by :meth:`close`).
        keys_dir: CURVE keys folder (``--keys``, NOTE [transport security]); clients then
            need it too (``PSClient(keys_dir=...)``). None: plain ZeroMQ on loopback.
        checkpoint_root: the shards' ``--checkpoint-root`` (NOTE [ps admin ops]); None:
            checkpoint and restore are refused.
        admin_token: the shards' admin token, given to them in their environment (never
            on the command line); None: a fresh ``secrets.token_hex(32)``.
        workdir: an empty folder of the caller's to use as :attr:`workdir` (``herald
            train`` names it in its run folder: NOTE [run leftovers] in
            herald/job/recovery/leftovers.py), removed by :meth:`close` likewise; None: a fresh
            temporary folder ``herald-ps-*``.

    Attributes:
        addresses: list of shard endpoints (``tcp://127.0.0.1:PORT``), index = shard.
        admin_token: what a client's checkpoint, restore and shutdown must carry
            (``PSClient(admin_token=shards.admin_token)``).
        workdir: temporary folder with the tables file, ready files and IPC sockets.
        procs: the shard processes (``subprocess.Popen``), index = shard.

    Raises:
        PeerTimeout: a shard did not become ready in time (the message quotes its log).
        ConfigError: bad arguments.
    """

    def __init__(
        self,
        num_shards: int,
        tables: Sequence[TableConfig],
        seed: int = 0,
        host: str = "127.0.0.1",
        startup_timeout_ms: int = DEFAULT_TIMEOUT_MS,
        transport: str = "tcp",
        limits: ShardLimits | None = None,
        log_dir: str | os.PathLike | None = None,
        *,
        keys_dir: str | os.PathLike | None = None,
        checkpoint_root: str | os.PathLike | None = None,
        admin_token: str | None = None,
        workdir: str | os.PathLike | None = None,
    ):
        if num_shards < 1:
            raise ConfigError(f"num_shards must be >= 1, got {num_shards}")
        if transport not in ("tcp", "ipc"):
            raise ConfigError(f"transport must be 'tcp' or 'ipc', got {transport!r}")
        self.num_shards, self.seed, self.host = int(num_shards), int(seed), host
        self.tables = check_tables(tables)
        self.limits = limits if limits is not None else ShardLimits()
        if not isinstance(self.limits, ShardLimits):
            raise ConfigError(f"limits must be a ShardLimits, got {type(self.limits).__name__}")
        for t in self.tables:
            self.limits.check_table(t)
        self.startup_timeout_ms = startup_timeout_ms
        self.keys_dir = str(pathlib.Path(keys_dir).resolve()) if keys_dir is not None else None
        self.checkpoint_root = str(pathlib.Path(checkpoint_root).resolve()) if checkpoint_root is not None else None
        self.admin_token = check_token(admin_token, "admin_token") or secrets.token_hex(32)
        self._tmp: tempfile.TemporaryDirectory | None = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="herald-ps-")
            workdir = self._tmp.name
        self.workdir = pathlib.Path(workdir)
        self._tables_file = self.workdir / "tables.json"
        self._tables_file.write_text(tables_to_json(self.tables))
        env = {
            "PYTHONPATH": _REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            TOKEN_ENV: self.admin_token,
        }  # NOTE [ps admin ops]: not on the command line
        # NOTE [death notices]: a shard that dies is reaped at once and its notice written
        self._children = Supervisor(self.workdir if log_dir is None else log_dir, env=env, on_death=self._on_death)
        self.addresses: list[str] = [""] * self.num_shards
        self._binds: list[str] = [""] * self.num_shards
        self._watches: list[ShardWatch] = []
        self._closed = False
        try:
            for i in range(self.num_shards):
                self._spawn(i, f"tcp://{host}:*" if transport == "tcp" else f"ipc://{self.workdir}/shard-{i}.ipc")
            for i in range(self.num_shards):
                self.addresses[i] = self._wait_ready(i)
        except BaseException:
            self.close()
            raise

    @property
    def procs(self) -> list[subprocess.Popen | None]:
        return [self._children.procs.get(_name(i)) for i in range(self.num_shards)]

    def _ready_file(self, i: int) -> pathlib.Path:
        return self.workdir / f"shard-{i}.ready"

    def _spawn(self, i: int, bind: str) -> None:
        self._ready_file(i).unlink(missing_ok=True)
        self._binds[i] = bind
        notice = notice_path(bind)
        if notice is not None:  # a restart: the notice named the shard before it
            notice.unlink(missing_ok=True)
        args = shard_args(
            i,
            self.num_shards,
            bind,
            seed=self.seed,
            tables_file=str(self._tables_file),
            ready_file=str(self._ready_file(i)),
            keys_dir=self.keys_dir,
            checkpoint_root=self.checkpoint_root,
            limits=self.limits,
        )
        self._children.start(_name(i), [sys.executable, *args])

    def _wait_ready(self, i: int) -> str:
        deadline = time.monotonic() + self.startup_timeout_ms / 1000.0
        path = self._ready_file(i)
        p = self._children.procs[_name(i)]
        while time.monotonic() < deadline:
            if path.exists():
                return path.read_text().strip()
            if p.poll() is not None:
                break
            time.sleep(0.02)
        raise PeerTimeout(
            f"PS shard {i} did not become ready within {self.startup_timeout_ms} ms "
            f"(exit code {p.poll()}); its log ends with:\n{self._children.tail(_name(i), 30)}",
            peer=f"shard {i} pid {p.pid}",
            op="start",
        )

    def log_path(self, i: int) -> pathlib.Path:
        """Shard ``i``'s log file (stdout and stderr)."""
        return self._children.log_path(_name(i))

    def describe(self, i: int, lines: int = 15) -> str:
        """Where shard ``i`` logs and the last ``lines`` lines of that log."""
        return f"its log {self.log_path(i)} ends with:\n{self._children.tail(_name(i), lines)}"

    def failure(self) -> str | None:
        """A message naming the first shard process that ended without :meth:`kill`,
        :meth:`terminate` or :meth:`close` (index, address, pid, how, log path and tail);
        None while every shard runs. Non-blocking."""
        for i in range(self.num_shards):
            message = self._death(i)
            if message is not None:
                return message
        return None

    def died_at(self) -> float | None:
        """When the first shard :meth:`failure` names ended (Unix seconds: the moment its
        supervisor reaped it, NOTE [death notices]); None while every shard runs."""
        for i in range(self.num_shards):
            when = self._children.died_at(_name(i))
            if when is not None:
                return when
        return None

    def _death(self, i: int) -> str | None:
        how = self._children.exit_status(_name(i))
        if how is None:
            return None
        return f"PS shard {i} at {self.addresses[i] or '(not ready)'} (pid {self.pid(i)}) {how}; {self.describe(i)}"

    def _on_death(self, name: str) -> None:
        """The supervisor saw shard ``name`` end: write its notice beside its ipc socket (NOTE
        [death notices]; a TCP shard has none: clients in this process learn from :meth:`failure`)."""
        i = int(name.rsplit("-", 1)[1])
        message, notice = self._death(i), notice_path(self._binds[i])
        if message is None or notice is None or self._closed:
            return
        try:
            write_notice(notice, message, self._children.died_at(name) or time.time())
        except StorageError as exc:  # the waits' own deadlines and the liveness check remain
            print(f"herald: {exc}", file=sys.stderr, flush=True)

    def check(self) -> None:
        """Raise :class:`HeraldError` naming a shard process that ended (see :meth:`failure`)."""
        failure = self.failure()
        if failure:
            raise HeraldError(failure)

    def watch(self, silent_ms: int) -> ShardWatch:
        """A liveness check of these shards (NOTE [ps liveness]): call it every ~0.5 s; it
        raises naming a shard process that ended, or a shard that left a ping unanswered
        for ``silent_ms``. Closed by :meth:`close`."""
        w = ShardWatch(
            self.addresses,
            silent_ms,
            describe=self.describe,
            dead=self.failure,
            keys_dir=self.keys_dir,
            died_at=self.died_at,
        )
        self._watches.append(w)
        return w

    def pid(self, i: int) -> int:
        return self._children.procs[_name(i)].pid

    def kill(self, i: int) -> None:
        """SIGKILL shard ``i`` (no shutdown, no flush: a crash) and reap it."""
        if _name(i) in self._children.procs:
            self._children.kill(_name(i))

    def terminate(self, i: int, timeout_ms: int = 5000) -> int | None:
        """SIGTERM shard ``i`` (graceful), SIGKILL after ``timeout_ms``; returns its exit code."""
        return self._children.terminate(_name(i), timeout_ms / 1000.0)

    def restart(self, i: int) -> None:
        """Start a fresh shard ``i`` on the same address (after :meth:`kill`/:meth:`terminate`);
        it comes up empty (tables declared) until restored."""
        self.terminate(i)
        self._spawn(i, self.addresses[i])
        self.addresses[i] = self._wait_ready(i)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every shard (SIGTERM, then SIGKILL at ``timeout_s`` seconds); idempotent, bounded."""
        if self._closed:
            return
        self._closed = True
        for w in self._watches:
            w.close(timeout_s)
        self._children.close(timeout_s)
        if self._tmp is not None:
            self._tmp.cleanup()
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalShards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _name(i: int) -> str:
    return f"ps-shard-{i}"  # its log: log_dir / "ps-shard-I.log"

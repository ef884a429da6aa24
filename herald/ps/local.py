"""Run PS shards as local processes (``herald serve ps``) for tests, benchmarks and
``herald train``."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from herald.errors import ConfigError, PeerTimeout
from herald.procs import Supervisor
from herald.ps.config import TableConfig, check_tables, tables_to_json

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

    Attributes:
        addresses: list of shard endpoints (``tcp://127.0.0.1:PORT``), index = shard.
        workdir: folder with the tables file and each shard's log (``shard-I.log``).
        procs: the shard processes (``subprocess.Popen``), index = shard.

    Raises:
        PeerTimeout: a shard did not become ready in time (the message quotes its log).
        ConfigError: bad arguments.
    """

    def __init__(self, num_shards: int, tables: Sequence[TableConfig], seed: int = 0,
                 host: str = "127.0.0.1", startup_timeout_ms: int = 120_000, transport: str = "tcp"):
        if num_shards < 1:
            raise ConfigError(f"num_shards must be >= 1, got {num_shards}")
        if transport not in ("tcp", "ipc"):
            raise ConfigError(f"transport must be 'tcp' or 'ipc', got {transport!r}")
        self.num_shards, self.seed, self.host = int(num_shards), int(seed), host
        self.tables = check_tables(tables)
        self.startup_timeout_ms = startup_timeout_ms
        self._tmp = tempfile.TemporaryDirectory(prefix="herald-ps-")
        self.workdir = pathlib.Path(self._tmp.name)
        self._tables_file = self.workdir / "tables.json"
        self._tables_file.write_text(tables_to_json(self.tables))
        env = {"PYTHONPATH": _REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self._children = Supervisor(self.workdir, env=env)
        self.addresses: list[str] = [""] * self.num_shards
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
        self._children.start(_name(i), [
            sys.executable, "-m", "herald", "serve", "ps", "--shard", str(i), "--num-shards",
            str(self.num_shards), "--bind", bind, "--tables", str(self._tables_file),
            "--seed", str(self.seed), "--ready-file", str(self._ready_file(i))])

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
        raise PeerTimeout(f"PS shard {i} did not become ready within {self.startup_timeout_ms} ms "
                          f"(exit code {p.poll()}); its log ends with:\n{self._children.tail(_name(i), 30)}",
                          peer=f"shard {i} pid {p.pid}", op="start")

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

    def close(self, timeout_ms: int = 5000) -> None:
        """Stop every shard (SIGTERM, then SIGKILL at ``timeout_ms``); idempotent, bounded."""
        if self._closed:
            return
        self._closed = True
        self._children.close(timeout_ms / 1000.0)
        self._tmp.cleanup()

    def __enter__(self) -> "LocalShards":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _name(i: int) -> str:
    return f"shard-{i}"  # its log: workdir / "shard-I.log"

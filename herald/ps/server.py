"""One PS shard: a single-threaded ZeroMQ ROUTER loop over :class:`EmbeddingTable` s.

:class:`ShardServer` is the shard's composition root: it builds the shard's context
(:class:`~herald.ps.context.ShardContext`: store, tables, limits, counters, part parser,
the job's state), its op handlers (herald/ps/handler.py: the op sets of every consistency
mode, herald/ps/modes.py, and the admin ops), the registry of its ops and its request loop
(:class:`~herald.ps.loop.RequestLoop`: framing, NOTE [reply cache], busy time, error
replies, ticks, serving). Implements NOTE [ps wire protocol] (docs/ps.md), NOTE [ps
aggregation] (herald/ps/aggregate.py) and NOTE [ps limits] (docs/ps.md,
:class:`~herald.ps.config.ShardLimits`); admin ops are NOTE [ps admin ops]
(herald/ps/admin.py); with a keys folder the socket is a CURVE server: NOTE [transport
security] (herald/auth.py).
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from herald.auth import check_bind
from herald.contracts.tables import OptimizerConfig, TableConfig, check_tables
from herald.contracts.vocab import SPARSE_OPTIMIZERS
from herald.errors import ConfigError, ProtocolError
from herald.ps.admin import AdminGate
from herald.ps.config import ShardLimits
from herald.ps.context import JobState, ShardContext
from herald.ps.gba import GradientBuffer
from herald.ps.handler import Peer, registry
from herald.ps.kernels import shard_of_jit
from herald.ps.loop import RequestLoop
from herald.ps.modes import ShardOps
from herald.ps.ops_admin import AdminOps
from herald.ps.parts import PartParser
from herald.ps.store import TableSet, frozen
from herald.ps.table import EmbeddingTable


class ShardServer:
    """Shard ``shard`` of ``num_shards``: owns the keys with ``shard_of(...) == shard``.

    Args:
        shard, num_shards: this shard's position (0 <= shard < num_shards).
        bind: ZeroMQ endpoint, e.g. ``tcp://127.0.0.1:5555`` (``*`` picks a free port).
        tables: tables declared at start (more may come by the ``declare`` op).
        seed: initialiser seed, equal on every shard and worker.
        reply_cache: replies of mutating requests remembered for retries.
        limits: what a request and a table may hold (NOTE [ps limits]); defaults:
            :class:`ShardLimits`.
        keys_dir: CURVE keys folder (NOTE [transport security] in herald/auth.py): the
            shard then answers only clients holding the client key; refused handshakes
            are counted (``handshakes_refused*`` in :meth:`stats`). None: plain ZeroMQ.
        insecure: allow a non-loopback ``bind`` without keys (one warning line).
        checkpoint_root, admin_token: NOTE [ps admin ops] (herald/ps/admin.py).

    Attributes:
        store, tables, counters, limits: the shard's (its :class:`~herald.ps.context.ShardContext`).
        op_sets: the handlers of its op sets (:class:`~herald.ps.modes.ShardOps`).
        rows, steps, gba_ops: those of the row ops, the step messages and GBA.
        admin_ops: the handler of its admin ops (:class:`~herald.ps.ops_admin.AdminOps`).
        loop: its :class:`~herald.ps.loop.RequestLoop`.

    Raises:
        ConfigError: bad shard numbers, limits, tables or token; a non-loopback
            ``bind`` without keys or ``insecure``; bad keys.
    """

    def __init__(
        self,
        shard: int,
        num_shards: int,
        bind: str = "tcp://127.0.0.1:*",
        tables: Sequence[TableConfig] = (),
        seed: int = 0,
        reply_cache: int = 4096,
        limits: ShardLimits | None = None,
        *,
        keys_dir: str | None = None,
        insecure: bool = False,
        checkpoint_root: str | None = None,
        admin_token: str | None = None,
    ):
        if not (0 <= shard < num_shards):
            raise ConfigError(f"shard {shard} is not in [0, {num_shards}); pass --shard below --num-shards")
        self.shard, self.num_shards, self.seed = int(shard), int(num_shards), int(seed)
        self.bind, self.keys_dir = bind, keys_dir
        check_bind(bind, keys_dir, insecure, f"ps shard {shard}")
        self.limits = limits if limits is not None else ShardLimits()
        if not isinstance(self.limits, ShardLimits):
            raise ConfigError(f"limits must be a ShardLimits, got {type(self.limits).__name__}")
        #: every table's arrays reachable from one kernel call (NOTE [table directory]),
        #: within NOTE [ps limits]' max_shard_bytes
        self.store = TableSet(self.shard, self.num_shards, max_bytes=self.limits.max_shard_bytes)
        self.tables: list[EmbeddingTable] = []
        self.counters: collections.Counter = collections.Counter()
        self.ctx = ShardContext(
            self.shard,
            self.num_shards,
            self.seed,
            self.limits,
            self.store,
            self.tables,
            self.counters,
            PartParser(self.tables, self.store.directory, self.limits),
            JobState(self.limits.max_contributors),
        )
        self.op_sets = ShardOps(self.ctx)  # every mode's (herald/ps/modes.py)
        self.rows, self.steps, self.gba_ops = self.op_sets.rows, self.op_sets.steps, self.op_sets.gba
        handlers = self.op_sets.handlers()
        gate = AdminGate(checkpoint_root, admin_token, self.counters)
        self.admin_ops = AdminOps(self.ctx, gate, self.stats, self.stop, [h.restored for h in handlers])
        name = f"herald ps shard {self.shard}/{self.num_shards}"
        self.loop = RequestLoop(
            registry([*handlers, self.admin_ops]), self.counters, reply_cache, [h.tick for h in handlers], name
        )
        self.declare(tables)

    def declare(self, tables: Sequence[TableConfig]) -> None:
        """Declare tables: the known list must be a prefix of ``tables`` (idempotent;
        appending is allowed, a different config at an existing index is rejected)."""
        self.admin_ops.declare(check_tables(tables))

    @property
    def gba(self) -> GradientBuffer | None:
        """GBA's buffer (NOTE [gba tokens]): made by the first GBA request, None before."""
        return self.gba_ops.buffer

    @property
    def workers(self) -> int | None:
        """The job's worker count, once a declare carried it."""
        return self.ctx.job.workers

    @property
    def busy_s(self) -> collections.defaultdict[str, float]:
        """Seconds spent handling each op (``busy_s[op] / wall time`` = busy fraction)."""
        return self.loop.busy_s

    @property
    def endpoint(self) -> str | None:
        """The bound endpoint, once :meth:`serve` bound it."""
        return self.loop.endpoint

    def handle(self, frames: Sequence) -> list:
        """Reply frames (header + arrays) for one request's frames (no routing id); the
        time taken is added to :attr:`busy_s` under the request's op. A ``step`` request
        needs :meth:`receive` (its reply may wait for other peers' messages).

        Raises:
            ProtocolError: the request got no reply now, or several (a step message).
        """
        replies = self.receive(None, frames)
        if len(replies) != 1:
            raise ProtocolError("handle() answers one request at once; a step message needs receive()")
        return replies[0][1]

    def receive(self, peer: Peer, frames: Sequence) -> list[tuple[Peer, list]]:
        """The replies ``[(peer, frames)]`` due after one request from ``peer`` (its routing
        id) arrived: its own, or none while a step message is held, or every held one of its
        step (NOTE [step messages] in herald/ps/stepped.py). Busy time as :meth:`handle`."""
        return self.loop.receive(peer, frames)

    def expire_aggregations(self, now: float | None = None) -> list[dict]:
        """Abort every aggregation open longer than ``aggregation_timeout_ms`` (NOTE [ps
        aggregation]); the reports of this call (:meth:`RowOps.expire_aggregations`)."""
        return self.rows.expire_aggregations(now)

    def stats(self) -> dict[str, Any]:
        """Counters and per-table sizes (plain types, msgpack-able)."""
        self.loop.count_handshakes()
        return {
            "shard": self.shard,
            "num_shards": self.num_shards,
            "pid": os.getpid(),
            "counters": dict(self.counters),
            "busy_s": {op: round(s, 6) for op, s in self.loop.busy_s.items()},
            "uptime_s": round(time.monotonic() - self.loop.started, 6),
            "open_aggregations": self.store.open_total,
            "replies_kept": len(self.loop.replies),  # NOTE [reply cache]
            "step_barrier": self.steps.stats(),  # NOTE [step barrier timing] in herald/ps/stepped.py
            "aborted": list(self.ctx.job.aborted),
            "limits": self.limits.to_dict(),
            "workers": self.workers,
            "pull_pending_keys": self.counters["pull_pending_keys"],
            "gba": self.gba.stats() if self.gba is not None else None,
            "tables": {
                t.cfg.name: {
                    "index": t.index,
                    "rows": t.n_rows,
                    "row_width": t.width,
                    "capacity_rows": int(t.rows.shape[0]),
                    "bytes": int(t.rows.nbytes),
                    "evicted_rows": t.evicted,
                    "evicted_rows_read_again": t.evicted_read_again,
                }
                for t in self.tables
            },
        }

    def stop(self, *_args) -> None:
        """Ask the loop to end (safe from a signal handler)."""
        self.loop.stop()

    def serve(self, ready_file: str | None = None, poll_ms: int = 100) -> None:
        """Bind and serve until :meth:`stop`, SIGTERM or a ``shutdown`` request.

        Writes the bound endpoint to ``ready_file`` (atomically) once serving.
        """
        warm_up()
        banner = f"{len(self.tables)} tables, seed {self.seed}"
        self.loop.serve(self.bind, self.keys_dir, self.limits, ready_file, poll_ms, banner)


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel variant the server uses."""
    keys = frozen(np.arange(4, dtype=np.uint64))
    for name in SPARSE_OPTIMIZERS:
        store = TableSet()
        t = EmbeddingTable(TableConfig("warm", 2, OptimizerConfig(name=name)), 0, 0, 16, tableset=store)
        t.pull(keys)
        grads = np.ones((4, 2), np.float32)
        t.push_grad(keys, grads, np.ones(4, np.uint16), 0, 0)
        t.push_grad(keys, grads, np.full(4, 2, np.uint16), 1, 0)
        t.push_grad(keys, grads, np.full(4, 2, np.uint16), 1, 1)
        tables, two = store.directory.positions(0, 4), frozen(np.full(4, 2, np.uint16))
        slots, _ = store.check_grad(tables, keys, frozen(grads), two, 2, 0, store.next_stamp())  # a request of 2 parts
        store.reserve_step(2, 4, 2)
        store.apply_grad(tables, keys, frozen(grads), two, 2, 0, slots)
        rows = np.ones((4, t.width), np.float32)
        t.push_rows(keys, rows)
        t.push_rows(keys, rows, np.ones(4, np.uint64))
        t.pull_clocked(keys, np.zeros(2, np.uint64), 0)
        t.pull(keys)
    shard_of_jit(np.uint64(0), keys, 1, np.empty(4, np.int64))


def run_shard(
    shard: int,
    num_shards: int,
    bind: str,
    tables=(),
    seed: int = 0,
    ready_file: str | None = None,
    limits: ShardLimits | None = None,
    **security,
) -> int:
    """Entry of ``herald serve ps``: serve until SIGTERM/SIGINT or a shutdown request
    (``security``: ``keys_dir``, ``insecure``, ``checkpoint_root``, ``admin_token`` of
    :class:`ShardServer`)."""
    server = ShardServer(shard, num_shards, bind, tables, seed, limits=limits, **security)
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, server.stop)
    t0 = time.monotonic()
    server.serve(ready_file=ready_file)
    print(f"herald ps shard {shard}/{num_shards}: stopped after {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return 0

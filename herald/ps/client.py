"""Client of the PS shards: routes keys with :func:`shard_of`, talks NOTE [ps wire
protocol] (docs/ps.md; framing: NOTE [wire format]) over one DEALER socket per shard.

:class:`PSClient` is the public front; its parts do the work:

- :class:`~herald.ps.link.ShardLink`: the sockets, request ids, retries and deadlines
  (NOTE [ps client deadline] in herald/ps/link.py), the traffic counts;
- :class:`~herald.ps.router.KeyRouter`: flat ``(table, key)`` arrays to one request per
  shard (split by NOTE [ps limits]' ``max_keys_per_request``) and the replies' rows back
  in key order;
- the op fronts: :class:`~herald.ps.front_rows.RowFront` (pull, push_grad, push_rows),
  :class:`~herald.ps.front_clocked.ClockFront` (NOTE [clock frames]),
  :class:`~herald.ps.front_step.StepFront` (NOTE [step messages]),
  :class:`~herald.ps.front_admin.AdminFront` (declare, stats, ping, checkpoint, restore,
  shutdown) and :class:`~herald.ps.front_admin.GbaFront` (NOTE [gba tokens]).

ps-lite style: every operation has a non-blocking ``*_async`` form returning a
:class:`Handle`; requests to several shards go out at once and ``wait()`` collects them.
A client is not thread-safe: use one per thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from herald.auth import load_client_keys
from herald.contracts.tables import TableConfig, check_tables
from herald.contracts.vocab import DEFAULT_TIMEOUT_MS
from herald.deaths import NoticeCheck
from herald.errors import ConfigError
from herald.ps import compress
from herald.ps.admin import check_token
from herald.ps.config import MAX_TABLES
from herald.ps.front_admin import AdminFront, GbaFront
from herald.ps.front_clocked import ClockFront
from herald.ps.front_rows import RowFront
from herald.ps.front_step import StepFront
from herald.ps.link import Handle, ShardLink
from herald.ps.router import KeyRouter

__all__ = ["Handle", "PSClient"]


class PSClient:
    """Talks to every shard of one PS.

    Args:
        addresses: shard endpoints, index = shard number (e.g. ``LocalShards.addresses``).
        tables: the table list; a table is named by its index in it or its name.
        timeout_ms: longest wait for one request, its retries included (NOTE [ps client
            deadline]: each of the ``retries + 1`` attempts gets ``timeout_ms / (retries + 1)``).
        retries: reconnect-and-resend attempts after an attempt expired (Lazy Pirate).
        declare: send the tables to every shard now (idempotent; a conflicting
            declaration raises :class:`ConfigError`); the replies give the shards'
            ``max_keys_per_request``.
        num_workers: the job's worker count, sent with the declaration: the shards then
            refuse a ``contributors`` above it or a ``rank`` at or above it, and name the
            missing ranks of an aborted aggregation (NOTE [ps aggregation]). None: not sent.
        keys_dir: CURVE keys folder (NOTE [transport security] in herald/auth.py): its
            client key pair and the servers' public key; needed when the shards run with
            ``--keys``. A client without the right keys is never answered (PeerTimeout).
        admin_token: the shards' admin token, sent with checkpoint, restore and shutdown
            (NOTE [ps admin ops]); e.g. :attr:`LocalShards.admin_token`.
        wire_dtype: ``fp32`` (default), ``fp16``, ``bf16`` or ``int8``: gradients and the
            embedding part of rows travel compressed (NOTE [wire compression]).
        liveness: ``liveness(shard)``, asked while waiting on ``shard`` besides its death
            notice (NOTE [death notices] in herald/deaths.py: every wait on an ipc shard
            checks it); it raises naming the shard when it is known dead (e.g. a Ray
            actor's death). None: the notices only.

    Attributes:
        link, router: its :class:`ShardLink` and :class:`KeyRouter`.
        rows, clocked, steps, admin, gba: its op fronts.

    Raises:
        ConfigError: bad settings, tables or keys; a shard refused the declaration.
        PeerTimeout: a shard did not answer the declaration within ``timeout_ms``.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        tables: Sequence[TableConfig],
        timeout_ms: int = 5000,
        retries: int = 3,
        declare: bool = True,
        num_workers: int | None = None,
        *,
        keys_dir: str | os.PathLike | None = None,
        admin_token: str | None = None,
        wire_dtype: str = "fp32",
        liveness: Callable[[int], None] | None = None,
    ):
        if not addresses:
            raise ConfigError("PSClient needs at least one shard address")
        if timeout_ms <= 0 or retries < 0:
            raise ConfigError(f"timeout_ms must be > 0 and retries >= 0, got {timeout_ms}, {retries}")
        if num_workers is not None and (type(num_workers) is not int or num_workers < 1):
            raise ConfigError(f"num_workers must be an int >= 1 or None, got {num_workers!r}")
        self.num_workers = num_workers
        self.wire_dtype = compress.check_wire_dtype(wire_dtype)
        keys = load_client_keys(keys_dir) if keys_dir is not None else None
        token = check_token(admin_token, "admin_token")
        self.addresses = list(addresses)
        self.tables = check_tables(tables)
        if len(self.tables) > MAX_TABLES:
            raise ConfigError(f"PSClient takes at most {MAX_TABLES} tables, got {len(self.tables)}")
        self.timeout_ms, self.retries = int(timeout_ms), int(retries)
        self.router = KeyRouter(self.tables, len(self.addresses))
        self.link = ShardLink(self.addresses, self.timeout_ms, self.retries, keys)
        self.link.liveness = _either(NoticeCheck.of(self.addresses), liveness)  # NOTE [death notices]
        self.rows = RowFront(self.link, self.router, self.wire_dtype)
        self.clocked = ClockFront(self.link, self.router, self.wire_dtype)
        self.steps = StepFront(self.link, self.router, self.rows)
        self.admin = AdminFront(self.link, self.router, self.tables, num_workers, token)
        self.gba = GbaFront(self.link)
        if declare:
            self.declare()

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    @property
    def max_keys_per_request(self) -> int:
        """Keys per request (NOTE [ps limits]); lowered to the shards' limit by :meth:`declare`."""
        return self.router.max_keys_per_request

    @max_keys_per_request.setter
    def max_keys_per_request(self, n: int) -> None:
        self.router.max_keys_per_request = int(n)

    @property
    def traffic(self) -> dict[str, int]:
        """What went over the sockets since :meth:`take_traffic`: requests issued, and the
        bytes of every frame sent (retries included) and received."""
        return self.link.traffic

    def table_index(self, table: int | str) -> int:
        """Index of ``table`` (an index or a name). Raises ConfigError if unknown."""
        return self.router.table_index(table)

    def declare(self, timeout_ms: int | None = None) -> None:
        """Declare the tables on every shard: :meth:`AdminFront.declare`."""
        self.admin.declare(timeout_ms)

    # ------------------------------------------------------------------ rows: RowFront
    def pull_flat_async(self, tables, keys) -> Handle:
        """:meth:`RowFront.pull_flat_async`: float32 [n, row_width] in key order."""
        return self.rows.pull_flat_async(tables, keys)

    def pull_async(self, batch: Mapping[int | str, np.ndarray]) -> Handle:
        """:meth:`RowFront.pull_async`: ``{table: rows}``."""
        return self.rows.pull_async(batch)

    def pull(self, table: int | str, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` in ``table``: float32 [n, row_width]. See :meth:`pull_async`."""
        return self.pull_async({table: keys}).wait()[table]

    def push_grad_flat_async(self, tables, keys, grads, contributors, step: int, rank: int) -> Handle:
        """:meth:`RowFront.push_grad_flat_async`: the rows the shards updated."""
        return self.rows.push_grad_flat_async(tables, keys, grads, contributors, step, rank)

    def push_grad_async(self, batch: Mapping, step: int, rank: int) -> Handle:
        """:meth:`RowFront.push_grad_async`: the rows the shards updated."""
        return self.rows.push_grad_async(batch, step, rank)

    def push_grad(self, table: int | str, keys, grads, step: int, contributors, rank: int = 0) -> int:
        """Push one table's gradients and wait for the acks; see :meth:`push_grad_async`."""
        return self.push_grad_async({table: (keys, grads, contributors)}, step, rank).wait()

    def push_rows_flat_async(self, tables, keys, rows) -> Handle:
        """:meth:`RowFront.push_rows_flat_async`."""
        return self.rows.push_rows_flat_async(tables, keys, rows)

    def push_rows_async(self, batch: Mapping) -> Handle:
        """:meth:`RowFront.push_rows_async`."""
        return self.rows.push_rows_async(batch)

    def push_rows(self, table: int | str, keys, rows) -> None:
        """Write back one table's rows and wait for the acks."""
        self.push_rows_async({table: (keys, rows)}).wait()

    # ------------------------------------------------------------------ clocks: ClockFront
    def pull_clocked_flat_async(self, tables, keys, checked, c_c, staleness: int):
        """:meth:`ClockFront.pull_clocked_flat_async`: ``(Handle, clock bytes sent)``."""
        return self.clocked.pull_clocked_flat_async(tables, keys, checked, c_c, staleness)

    def pull_clocked_async(self, batch: Mapping, staleness: int):
        """:meth:`ClockFront.pull_clocked_async`: ``(Handle, clock bytes sent)``."""
        return self.clocked.pull_clocked_async(batch, staleness)

    def push_rows_clocked_flat_async(self, tables, keys, rows, advance, read_clocks: bool = False):
        """:meth:`ClockFront.push_rows_clocked_flat_async`: ``(Handle, clock bytes sent)``."""
        return self.clocked.push_rows_clocked_flat_async(tables, keys, rows, advance, read_clocks)

    def push_rows_clocked_async(self, batch: Mapping, read_clocks: bool = False):
        """:meth:`ClockFront.push_rows_clocked_async`: ``(Handle, clock bytes sent)``."""
        return self.clocked.push_rows_clocked_async(batch, read_clocks)

    # ------------------------------------------------------------------ steps, GBA, admin
    def step_async(self, step: int, rank: int, workers: int, *, rows=None, grads=None, pull=None, dense=None):
        """:meth:`StepFront.step_async`: this rank's step message to every shard (NOTE [step messages])."""
        return self.steps.step_async(step, rank, workers, rows=rows, grads=grads, pull=pull, dense=dense)

    def request_async(self, shard: int, op: str, header: dict, arrays=()) -> Handle:
        """One ``op`` request to ``shard`` (NOTE [gba tokens]); ``wait()`` -> reply ``(header, arrays)``."""
        return self.gba.request_async(shard, op, header, arrays)

    def stats(self) -> list[dict]:
        """Per-shard statistics (counters, open aggregations, rows per table)."""
        return self.admin.stats()

    def ping(self) -> None:
        self.admin.ping()

    def checkpoint(self, path: str, timeout_ms: int = DEFAULT_TIMEOUT_MS, clocks: bool = False) -> list[str]:
        """Every shard writes its checkpoint under ``path`` (with ``clocks``, the rows' clocks
        too): :meth:`AdminFront.checkpoint`."""
        return self.admin.checkpoint(path, timeout_ms, clocks)

    def restore(self, path: str, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        """Every shard replaces its rows by its checkpoint under ``path``: :meth:`AdminFront.restore`."""
        self.admin.restore(path, timeout_ms)

    def shutdown(self, timeout_ms: int | None = None) -> None:
        """Ask every shard to exit: :meth:`AdminFront.shutdown`."""
        self.admin.shutdown(timeout_ms)

    def take_traffic(self) -> dict[str, int]:
        """:attr:`traffic` since the last call (then reset to 0)."""
        return self.link.take_traffic()

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the sockets (idempotent); unanswered requests are dropped. Returns at once
        (``timeout_s``: nothing here waits; docs/design.md, "Timeouts and units")."""
        self.link.close(timeout_s)

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _either(first: Callable[[int], None] | None, second: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """One liveness check asking ``first`` then ``second`` (either may be None; both None: None)."""
    if first is None or second is None:
        return first or second

    def check(shard: int) -> None:
        first(shard)
        second(shard)

    return check

"""The client's admin ops: declare, stats, ping, and NOTE [ps admin ops]' checkpoint,
restore and shutdown (every shard at once); and the one-request form GBA's worker uses."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from herald.contracts.tables import TableConfig
from herald.contracts.vocab import DEFAULT_TIMEOUT_MS
from herald.ps.link import Handle, ShardLink
from herald.ps.router import KeyRouter


class AdminFront:
    """Admin ops over ``link``: the ``tables`` to declare (and ``num_workers``), the
    ``router`` whose ``max_keys_per_request`` the declaration sets, the shards'
    ``admin_token`` (checked, or None)."""

    def __init__(
        self,
        link: ShardLink,
        router: KeyRouter,
        tables: Sequence[TableConfig],
        num_workers: int | None,
        admin_token: str | None,
    ):
        self.link, self.router, self.tables = link, router, list(tables)
        self.num_workers, self._token = num_workers, admin_token

    def _all(self, op: str, header: dict | None = None, timeout_ms: int | None = None) -> list[dict]:
        """One ``op`` request to every shard; their reply headers."""
        rids = [self.link.send(s, op, header or {}, timeout_ms=timeout_ms) for s in range(self.link.num_shards)]
        return [h for h, _ in self.link.collect(rids)]

    def _admin(self, fields: dict) -> dict:
        """Header of an admin op: ``fields`` and the admin token (NOTE [ps admin ops])."""
        return dict(fields, token=self._token) if self._token is not None else fields

    def declare(self, timeout_ms: int | None = None) -> None:
        """Declare the tables (and ``num_workers``) on every shard (idempotent); adopt the
        smallest ``max_keys_per_request`` the shards announce, and the smallest ``max_rows``
        of a bounded shard (NOTE [bounded ps]: a request never inserts more new keys of a
        table than the shard may hold, so a large pull is split, not refused).

        Raises:
            ConfigError: a shard refused the declaration. PeerTimeout: a shard did not answer.
        """
        header: dict[str, Any] = {"tables": [t.to_dict() for t in self.tables]}
        if self.num_workers is not None:
            header["workers"] = self.num_workers
        for h in self._all("declare", header, timeout_ms):
            limits = h.get("limits") or {}
            for limit in (limits.get("max_keys_per_request"), limits.get("max_rows")):
                if type(limit) is int and limit >= 1:
                    self.router.max_keys_per_request = min(self.router.max_keys_per_request, limit)

    def stats(self) -> list[dict]:
        """Per-shard statistics (counters, open aggregations, rows per table)."""
        return [h["stats"] for h in self._all("stats")]

    def ping(self) -> None:
        """Every shard answers a ping (PeerTimeout names one that does not)."""
        self._all("ping")

    def checkpoint(self, path: str, timeout_ms: int = DEFAULT_TIMEOUT_MS, clocks: bool = False) -> list[str]:
        """Every shard writes its checkpoint under ``path`` (atomic per shard; a relative
        path is made absolute here, so shards on this host use the caller's folder); with
        ``clocks`` the rows' clocks too (herald/ps/checkpoint.py).

        Call between steps: a shard with open aggregations refuses (ProtocolError).

        Raises:
            AdminRefused: ``path`` is outside the shards' checkpoint root, or a wrong or
                missing admin token (NOTE [ps admin ops]).
        """
        header = {"dir": os.path.abspath(path), **({"clocks": True} if clocks else {})}
        return [h["path"] for h in self._all("checkpoint", self._admin(header), timeout_ms)]

    def restore(self, path: str, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        """Every shard replaces its rows by its checkpoint under ``path``.

        Raises:
            CheckpointError: missing, torn or corrupt checkpoint, or another layout.
            AdminRefused: as :meth:`checkpoint`.
        """
        self._all("restore", self._admin({"dir": os.path.abspath(path)}), timeout_ms)

    def shutdown(self, timeout_ms: int | None = None) -> None:
        """Ask every shard to exit (after acknowledging).

        Raises:
            AdminRefused: a wrong or missing admin token, or a shard started without one
                (stop it with SIGTERM).
        """
        self._all("shutdown", self._admin({}), timeout_ms=timeout_ms)


class GbaFront:
    """GBA's requests (NOTE [gba tokens] in herald/ps/gba.py): one op to one shard, its
    header and frames built by the worker (herald/worker/consistency_gba.py)."""

    def __init__(self, link: ShardLink):
        self.link = link

    def request_async(self, shard: int, op: str, header: dict, arrays=()) -> Handle:
        """One ``op`` request to ``shard``; ``wait()`` -> reply ``(header, arrays)``."""
        return self.link.handle([self.link.send(shard, op, header, list(arrays))], lambda replies: replies[0])

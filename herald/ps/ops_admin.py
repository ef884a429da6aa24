"""A shard's admin ops: ``ping``, ``declare``, ``stats``, ``checkpoint``, ``restore``, ``shutdown``.

The tables a shard serves come by ``declare`` (NOTE [ps limits] checked before any
change); checkpoint, restore and shutdown are NOTE [ps admin ops] (herald/ps/admin.py),
their checkpoints herald/ps/checkpoint.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from herald.contracts.tables import TableConfig, check_tables
from herald.errors import ConfigError, ProtocolError
from herald.ps import checkpoint
from herald.ps.admin import AdminGate
from herald.ps.context import ShardContext
from herald.ps.handler import Handler, Op, answering
from herald.ps.table import FIRST_ROWS, EmbeddingTable, first_capacity, rows_within, table_bytes


class AdminOps(Handler):
    """The admin ops of one shard.

    Args:
        ctx: the shard's :class:`~herald.ps.context.ShardContext`.
        gate: who may checkpoint, restore and stop it, and where (NOTE [ps admin ops]).
        stats: the shard's ``stats`` (plain types).
        stop: asks the shard's loop to end (``shutdown``).
        on_restore: called after a restore: state of the rolled-back run is dropped (the
            held step messages, GBA's buffer).
    """

    def __init__(
        self,
        ctx: ShardContext,
        gate: AdminGate,
        stats: Callable[[], dict],
        stop: Callable[[], None],
        on_restore: Sequence[Callable[[], None]] = (),
    ):
        self.ctx, self.gate, self._stats, self._stop = ctx, gate, stats, stop
        self._on_restore = tuple(on_restore)

    def ops(self) -> dict[str, Op]:
        return {
            "ping": answering(lambda header, arrays: ({}, [])),
            "declare": answering(self._declare_op),
            "stats": answering(lambda header, arrays: ({"stats": self._stats()}, [])),
            "checkpoint": answering(self._checkpoint),
            "restore": answering(self._restore),
            "shutdown": answering(self._shutdown),
        }

    def declare(self, tables: Sequence[TableConfig]) -> None:
        """Declare tables: the known list must be a prefix of ``tables`` (idempotent;
        appending is allowed, a different config at an existing index is rejected).

        Raises:
            ConfigError: a bad table, a conflicting redeclaration, NOTE [ps limits] passed.
        """
        ctx = self.ctx
        tables = check_tables(tables)
        new = tables[len(ctx.tables) :]
        for t in new:
            ctx.limits.check_table(t)
        first = sum(  # NOTE [ps limits], before any change
            table_bytes(first_capacity(FIRST_ROWS, rows_within(ctx.limits.max_table_bytes, t.row_width)), t.row_width)
            for t in new
        )
        ctx.limits.check_declare(len(tables), ctx.store.nbytes() + first)
        for i, t in enumerate(tables[: len(ctx.tables)]):
            if t != ctx.tables[i].cfg:
                raise ConfigError(
                    f"table {i} is declared as {ctx.tables[i].cfg} on shard {ctx.shard}; "
                    f"conflicting redeclaration {t} rejected (restart the shard to change it)"
                )
        for i in range(len(ctx.tables), len(tables)):
            ctx.tables.append(
                EmbeddingTable(
                    tables[i],
                    i,
                    ctx.seed,
                    capacity_rows=FIRST_ROWS,
                    max_bytes=ctx.limits.max_table_bytes,
                    max_resident_rows=ctx.limits.max_rows or None,
                    tableset=ctx.store,
                )
            )

    def _declare_op(self, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
        """``declare {tables, workers?}``: reply ``{n_tables, limits}``."""
        ctx, job = self.ctx, self.ctx.job
        decl = header.get("tables")
        if not isinstance(decl, list):
            raise ProtocolError("declare: header 'tables' must be a list of table maps")
        workers = header.get("workers")
        if workers is not None:
            bound = ctx.limits.max_contributors
            if type(workers) is not int or not 1 <= workers <= bound:
                raise ConfigError(
                    f"declare: workers must be an int in [1, {bound}] (this shard's "
                    f"max_contributors; raise --max-contributors), got {workers!r:.40}"
                )
            if job.workers is not None and workers != job.workers:
                raise ConfigError(
                    f"declare: this shard serves a job of {job.workers} workers; a declare of "
                    f"{workers} is rejected (restart the shards for another job)"
                )
        self.declare([TableConfig.from_dict(d) for d in decl])
        if workers is not None:
            job.workers = workers
        return {"n_tables": len(ctx.tables), "limits": ctx.limits.to_dict()}, []

    def _checkpoint(self, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
        """``checkpoint {dir, token, clocks?}``: reply ``{path}`` (NOTE [ps admin ops]; ``clocks``
        true: the rows' clocks too, herald/ps/checkpoint.py)."""
        ctx = self.ctx
        path = self.gate.check("checkpoint", header)
        open_aggs = ctx.store.open_total
        if open_aggs:
            raise ProtocolError(
                f"checkpoint refused: {open_aggs} gradient aggregations are open; "
                "checkpoint between steps (after every push of the step is acked); an "
                "aggregation whose contributors never come is aborted after "
                f"aggregation_timeout_ms={ctx.limits.aggregation_timeout_ms}"
            )
        final = checkpoint.save(
            path, ctx.shard, ctx.num_shards, ctx.seed, ctx.tables, clocks=header.get("clocks") is True
        )
        return {"path": str(final)}, []

    def _restore(self, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
        """``restore {dir, token}``: reply ``{rows}`` restored (NOTE [ps admin ops])."""
        ctx = self.ctx
        path = self.gate.check("restore", header)
        data = checkpoint.load(path, ctx.shard, ctx.num_shards, ctx.seed, ctx.tables, with_clocks=True)
        # NOTE [ps limits]: room to grow (power-of-two arrays) where max_shard_bytes allows, else the rows alone
        caps = [t.load_capacity(k.shape[0]) for t, (k, *_) in zip(ctx.tables, data)]
        if sum(table_bytes(c, t.width) for t, c in zip(ctx.tables, caps)) > ctx.limits.max_shard_bytes:
            caps = [max(16, k.shape[0]) for k, *_ in data]
        total = sum(table_bytes(c, t.width) for t, c in zip(ctx.tables, caps))
        ctx.store.directory.check_bytes(total, f"restoring {path}")
        for table, (keys, rows, clocks), cap in zip(ctx.tables, data, caps):
            table.load(keys, rows, cap, clocks=clocks)
        for forget in self._on_restore:  # the rolled-back run's (NOTE [gba tokens], NOTE [step messages])
            forget()
        return {"rows": int(sum(k.shape[0] for k, *_ in data))}, []

    def _shutdown(self, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
        """``shutdown {token}``: acknowledged, then the loop ends (NOTE [ps admin ops])."""
        self.gate.check("shutdown", header)
        self._stop()
        return {}, []

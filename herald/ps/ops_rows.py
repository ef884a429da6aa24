"""A shard's row ops: ``pull``, ``push_grad`` and ``push_rows`` (NOTE [ps wire protocol]).

Each part of a request is served by one kernel call over every table of the part (flat
parts: NOTE [table directory] in herald/ps/kernels/directory.py); a gradient push follows
NOTE [ps aggregation] (herald/ps/aggregate.py) within NOTE [ps limits]. A pull with
``staleness`` and a push_rows with ``advance`` frames are the clocked ops' (NOTE [clock
frames]: :class:`~herald.ps.ops_clocked.ClockedOps`). The step messages (herald/ps/stepped.py)
apply their sections through the public methods here.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from herald.errors import ProtocolError
from herald.ps import compress, wire
from herald.ps.context import ShardContext
from herald.ps.handler import Handler, Op, Reply, answering
from herald.ps.ops_clocked import ClockedOps
from herald.ps.parts import Part


class RowOps(Handler):
    """The row ops of one shard.

    Args:
        ctx: the shard's :class:`~herald.ps.context.ShardContext`.
        clocked: the clocked variants of ``pull`` and ``push_rows``.
    """

    def __init__(self, ctx: ShardContext, clocked: ClockedOps):
        self.ctx, self.clocked = ctx, clocked

    def ops(self) -> dict[str, Op]:
        return {
            "pull": answering(self.pull),
            "push_grad": answering(self.push_grad),
            "push_rows": answering(self.push_rows),
        }

    def pull(self, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
        """``pull {parts}`` [tables, keys per part]: the rows of every key (NOTE [wire
        compression] by the header's ``wire``); with ``staleness``: a conditional pull.

        Raises:
            ProtocolError: a bad part, a table of another shape, a key of another shard, a bound.
        """
        if "staleness" in header:  # NOTE [clock frames]: a conditional pull
            return self.clocked.pull(header, arrays)
        wire_dtype = compress.wire_of(header)  # NOTE [wire compression]
        return self.read_pull(self.resolve_pull(header, arrays), wire_dtype)

    def resolve_pull(self, header: dict[str, Any], arrays: list) -> list[tuple[Part, np.ndarray]]:
        """The first half of a pull: its parts checked, with the slots of their keys' rows
        (int64 [n]; unseen keys inserted), for :meth:`read_pull`. A step message's pull is
        resolved when the message comes and read at the release (NOTE [pulls resolved on
        arrival] in herald/ps/stepped.py), so the release only copies rows.

        Raises:
            ProtocolError: a bad part, a table of another shape, a key of another shard, a bound.
        """
        parts = self.ctx.parts.parse(header, arrays, "pull")
        return [(p, self.ctx.store.slots(p.tables, p.keys, p.dim, p.width, "pull")) for p in parts]

    def read_pull(self, resolved: list[tuple[Part, np.ndarray]], wire_dtype: str) -> tuple[dict, list]:
        """The reply ``(header, frames)`` of a pull :meth:`resolve_pull` resolved: its rows as
        they are now, in ``wire_dtype`` (NOTE [wire compression])."""
        ctx = self.ctx
        out = []
        for p, slots in resolved:
            rows, pending = ctx.store.rows_at(p.tables, slots, p.width)
            ctx.counters["pull_keys"] += p.keys.shape[0]
            ctx.counters["pull_pending_keys"] += pending
            out += compress.encode_rows(rows, p.dim, wire_dtype)
        reply = {"parts": [p.echo for p, _ in resolved]}
        return (dict(reply, wire=wire_dtype) if wire_dtype != "fp32" else reply), out

    def push_grad(self, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
        """``push_grad {step, rank, parts}`` [tables, keys, grads, contributors per part]:
        one rank's gradients of ``step`` (NOTE [ps aggregation]); reply ``{applied}``, the
        rows updated. Every part is checked before any is applied.

        Raises:
            ProtocolError: a rank or contributors above the bound, a non-finite gradient, a
                repeated key, a broken aggregation rule (nothing applied then).
        """
        ctx, store, job = self.ctx, self.ctx.store, self.ctx.job
        step = wire.get_int(header, "step", -(1 << 62), 1 << 62)
        bound = job.contributor_bound
        rank = wire.get_int(header, "rank", 0, 1 << 30)
        if rank >= bound:
            raise ProtocolError(
                f"push_grad: rank {rank} is not below {job.bound_name()}; ranks run from 0 to workers - 1"
            )
        parts = ctx.parts.parse(header, arrays, "push_grad", wire_dtype=compress.wire_of(header))
        stamp = store.next_stamp()  # a key twice in the request, in any part, is refused
        name = job.bound_name()
        if len(parts) == 1:  # checked and applied in one kernel call
            p = parts[0]
            applied = store.push_grad(
                p.tables, p.keys, p.rest[0], p.rest[1], step, rank, stamp, bound=bound, bound_name=name
            )[1]
        else:  # every part checked before any is applied (NOTE [ps aggregation])
            checked = [
                store.check_grad(
                    p.tables, p.keys, p.rest[0], p.rest[1], step, rank, stamp, bound=bound, bound_name=name
                )
                for p in parts
            ]
            if max(cmax for _, cmax in checked) > 1:
                store.reserve_step(step, sum(p.keys.shape[0] for p in parts), max(p.dim for p in parts))
            applied = sum(
                store.apply_grad(p.tables, p.keys, p.rest[0], p.rest[1], step, rank, slots)
                for p, (slots, _) in zip(parts, checked)
            )
        job.pushed(step, rank)
        ctx.counters["push_grad_keys"] += sum(p.keys.shape[0] for p in parts)
        ctx.counters["rows_updated"] += applied
        return {"applied": applied}, []

    def push_rows(self, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
        """``push_rows {parts}`` [tables, keys, rows per part]: write rows back (embedding and
        optimizer state); with ``advance`` frames: the clocked write-back (NOTE [clock frames]).

        Raises:
            ProtocolError: a bad part, a non-finite row, a repeated key (nothing stored then).
        """
        if "advance" in header or "read_clocks" in header:  # NOTE [clock frames]
            return self.clocked.push_rows(header, arrays)
        ctx = self.ctx
        parts = ctx.parts.parse(header, arrays, "push_rows", wire_dtype=compress.wire_of(header))
        stamp = ctx.store.next_stamp()
        for p in parts:
            ctx.store.push_rows(p.tables, p.keys, p.rest[0], None, stamp)
            ctx.counters["push_rows_keys"] += p.keys.shape[0]
        return {}, []

    def expire_aggregations(self, now: float | None = None) -> list[dict]:
        """Abort every aggregation open longer than ``aggregation_timeout_ms`` (NOTE [ps
        aggregation]): count, log (stderr: the shard's log) and keep a report naming the
        ranks that did not push. Returns the reports of this call."""
        ctx, job = self.ctx, self.ctx.job
        now = time.monotonic() if now is None else now
        timeout_ms = ctx.limits.aggregation_timeout_ms
        out = []
        if ctx.store.aggregations.pending:
            for report in ctx.store.aggregations.expire(now, timeout_ms / 1000.0):
                pushed = job.ranks_pushed(report["step"])
                report["ranks_pushed"] = pushed
                if job.workers is not None:
                    report["missing_ranks"] = [r for r in range(job.workers) if r not in pushed]
                else:
                    report["missing_ranks"] = "unknown (declare the job's workers: PSClient(num_workers=...))"
                ctx.counters["aggregations_aborted"] += 1
                ctx.counters["aggregation_keys_aborted"] += report["open_keys"]
                job.aborted.append(report)
                out.append(report)
                ctx.log(
                    f"aborted {report['open_keys']} open aggregations of step {report['step']} on table "
                    f"{report['table']!r} after {report['waited_ms']} ms (aggregation_timeout_ms={timeout_ms}); "
                    f"expected {report['contributors']} contributors, ranks that pushed {pushed}, "
                    f"missing ranks {report['missing_ranks']}"
                )
        return out

    def tick(self, now: float) -> list[Reply]:
        """The loop's tick: :meth:`expire_aggregations` (no reply is due)."""
        self.expire_aggregations(now)
        return []

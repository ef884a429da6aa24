"""One PS shard: a single-threaded ZeroMQ ROUTER loop over :class:`EmbeddingTable` s.

Implements NOTE [ps wire protocol] (docs/ps.md; framing: NOTE [wire format] in
herald/wire.py), NOTE [ps aggregation] (herald/ps/aggregate.py) and NOTE [ps limits]
(docs/ps.md, :class:`~herald.ps.config.ShardLimits`). Every malformed or over-limit
message gets an error reply and the loop keeps serving; nothing received is unpickled;
a frame larger than the limits allow is cut off by libzmq before it is buffered (NOTE
[message size limits] in herald/wire.py).
Admin ops (checkpoint, restore, shutdown) are NOTE [ps admin ops] (herald/ps/admin.py);
with a keys folder the socket is a CURVE server: NOTE [transport security] (herald/auth.py).
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from herald.auth import HandshakeMonitor, check_bind, server_socket
from herald.contracts.tables import OptimizerConfig, TableConfig, check_tables
from herald.contracts.vocab import SPARSE_OPTIMIZERS
from herald.errors import ConfigError, HeraldError, ProtocolError
from herald.ps import checkpoint, clocked, compress, gba, stepped, wire
from herald.ps import kernels as K
from herald.ps.admin import AdminGate, AdminRefused
from herald.ps.config import ShardLimits, largest_frame_bytes
from herald.ps.store import TableSet, frozen
from herald.ps.table import FIRST_ROWS, EmbeddingTable, first_capacity, rows_within, table_bytes
from herald.ps.wire import PS

MAX_PARTS = 1024
#: Steps whose pushing ranks are remembered (to name the missing ones of an aborted step).
PUSHER_STEPS = 256
#: Seconds between two scans for expired aggregations in the serve loop.
EXPIRE_EVERY_S = 0.1


class Part:
    """One part of a pull or push, its frames checked: ``tables`` (uint16 [n], table
    positions), ``keys`` (uint64 [n]) and the part's other arrays ``rest`` (float32
    gradients or rows, contributors, a widened clock frame), the ``dim`` and ``width`` of
    its first key's table (the kernels check every key's: NOTE [ps wire protocol]) and the
    part map it came as (``echo``)."""

    __slots__ = ("tables", "keys", "rest", "dim", "width", "echo")

    def __init__(self, tables, keys, rest, dim, width, echo):
        self.tables, self.keys, self.rest = tables, keys, rest
        self.dim, self.width, self.echo = dim, width, echo


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, checkpoint.CheckpointError):
        return "checkpoint"
    if isinstance(exc, AdminRefused):
        return "refused"
    if isinstance(exc, ConfigError):
        return "config"
    if isinstance(exc, ProtocolError):
        return "protocol"
    return "internal"


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
        self.tables: list[EmbeddingTable] = []
        self.limits = limits if limits is not None else ShardLimits()
        if not isinstance(self.limits, ShardLimits):
            raise ConfigError(f"limits must be a ShardLimits, got {type(self.limits).__name__}")
        #: every table's arrays reachable from one kernel call (NOTE [table directory]),
        #: within NOTE [ps limits]' max_shard_bytes
        self.store = TableSet(self.shard, self.num_shards, max_bytes=self.limits.max_shard_bytes)
        self._replies: collections.OrderedDict = collections.OrderedDict()  # NOTE [reply cache]
        self._reply_rids: dict[int, collections.deque] = {}  # per client, its kept replies' request ids in order
        self._done_below: collections.OrderedDict = collections.OrderedDict()  # per client, its done_below
        self._reply_cache = reply_cache
        self._stop = False
        self.counters = collections.Counter()
        self.admin = AdminGate(checkpoint_root, admin_token, self.counters)
        self._handshakes: HandshakeMonitor | None = None
        #: seconds spent handling each op (``busy_s[op] / wall time`` = busy fraction)
        self.busy_s: collections.Counter = collections.Counter()
        self._started = time.monotonic()
        #: the job's worker count, once a declare carried it (bounds contributors and ranks)
        self.workers: int | None = None
        self._pushers: collections.OrderedDict = collections.OrderedDict()  # step -> ranks that pushed
        #: reports of the last aborted aggregations (NOTE [ps aggregation])
        self.aborted: collections.deque = collections.deque(maxlen=16)
        self._next_expiry = 0.0
        self.gba: gba.GradientBuffer | None = None  # NOTE [gba tokens]: made by the first GBA request
        #: the step messages held until all their ranks' came (NOTE [step messages])
        self.steps = stepped.StepBarrier()
        self.declare(check_tables(tables))

    # ------------------------------------------------------------------ tables
    def declare(self, tables: Sequence[TableConfig]) -> None:
        """Declare tables: the known list must be a prefix of ``tables`` (idempotent;
        appending is allowed, a different config at an existing index is rejected)."""
        tables = check_tables(tables)
        new = tables[len(self.tables) :]
        for t in new:
            self.limits.check_table(t)
        self.limits.check_declare(
            len(tables),
            self.store.nbytes()
            + sum(  # NOTE [ps limits], before any change
                table_bytes(
                    first_capacity(FIRST_ROWS, rows_within(self.limits.max_table_bytes, t.row_width)), t.row_width
                )
                for t in new
            ),
        )
        for i, t in enumerate(tables[: len(self.tables)]):
            if t != self.tables[i].cfg:
                raise ConfigError(
                    f"table {i} is declared as {self.tables[i].cfg} on shard {self.shard}; "
                    f"conflicting redeclaration {t} rejected (restart the shard to change it)"
                )
        for i in range(len(self.tables), len(tables)):
            self.tables.append(
                EmbeddingTable(
                    tables[i],
                    i,
                    self.seed,
                    capacity_rows=FIRST_ROWS,
                    max_bytes=self.limits.max_table_bytes,
                    max_resident_rows=self.limits.max_rows or None,
                    tableset=self.store,
                )
            )

    # ------------------------------------------------------------------ requests
    def handle(self, frames: Sequence) -> list:
        """Reply frames (header + arrays) for one request's frames (no routing id); the
        time taken is added to :attr:`busy_s` under the request's op. A ``step`` request
        needs :meth:`receive` (its reply may wait for other peers' messages)."""
        replies = self.receive(None, frames)
        if len(replies) != 1:
            raise ProtocolError("handle() answers one request at once; a step message needs receive()")
        return replies[0][1]

    def receive(self, peer: Any, frames: Sequence) -> list[tuple[Any, list]]:
        """The replies ``[(peer, frames)]`` due after one request from ``peer`` (its routing
        id) arrived: its own, or none while a step message is held, or every held one of its
        step (NOTE [step messages] in herald/ps/stepped.py). Busy time as :meth:`handle`."""
        t0 = time.perf_counter()
        replies, op = self._handle(peer, frames)
        self.busy_s[op if op in wire.OPS else "malformed"] += time.perf_counter() - t0
        return replies

    def _handle(self, peer: Any, frames: Sequence) -> tuple[list[tuple[Any, list]], Any]:
        rid = -1
        op = None
        try:
            if not frames:
                raise ProtocolError("empty message")
            header = PS.unpack_header(frames[0])
            rid = header.get("rid") if type(header.get("rid")) is int else -1
            op = header.get("op")
            if op not in wire.OPS:
                raise ProtocolError(f"unknown op {op!r}; known ops: {list(wire.OPS)}")
            key = None
            if op in wire.MUTATING:
                key = (wire.get_int(header, "cid", 0, (1 << 64) - 1), wire.get_int(header, "rid", 0, (1 << 64) - 1))
                if self._answered(key, header):  # NOTE [reply cache]: a late copy of a request answered
                    self.counters["duplicate_requests"] += 1
                    return [], op
                cached = self._replies.get(key)
                if cached is not None:
                    self.counters["duplicate_requests"] += 1
                    return [(peer, list(cached))], op
                if op == "step" and self.steps.readdress(key, peer):
                    self.counters["duplicate_requests"] += 1
                    return [], op
            arrays = PS.unpack_arrays(header, frames[1:], readonly=True)  # the kernels' variant: frozen
            if op == "step":
                replies = stepped.op_step(self, peer, key, header, arrays)
                self.counters["requests"] += 1
                return replies, op
            reply_header, reply_arrays = getattr(self, "_op_" + op)(header, arrays)
            reply_header.update(op=op, rid=rid, ok=True)
            out = PS.pack(reply_header, reply_arrays)
            if key is not None:  # the whole reply: a push_rows reply may carry clocks
                self.remember(key, out)
            self.counters["requests"] += 1
            return [(peer, out)], op
        except Exception as exc:  # every failure becomes an error reply; the loop goes on
            return [(peer, self.error_reply(op, rid, exc))], op

    # NOTE [reply cache]
    # ~~~~~~~~~~~~~~~~~~
    # A mutating request (wire.MUTATING) must not be applied twice when a client retries it
    # (NOTE [ps client deadline] in herald/ps/client.py), so its whole reply is kept, keyed
    # by (client id, request id), and a repeat is answered from it. A reply is needed only
    # while its client may still retry the request: every request carries ``done_below``,
    # the lowest request id its client still awaits a reply to (request ids grow per
    # client), and the shard forgets that client's replies below it. So a shard keeps about
    # one reply per client (a step message's: its rows and the dense sum, hundreds of KB)
    # instead of the last ``reply_cache`` of all clients: kept for thousands of steps, those
    # made every reply's memory fresh pages to fault in (page-clearing was 17% of a
    # shard's CPU samples, perf, 2 workers), and held up to ``reply_cache`` x that size.
    # A copy of a request below ``done_below`` that arrives later (a retry overtaken on
    # another connection) is dropped unanswered: its client holds the reply or gave the
    # request up. ``reply_cache`` still bounds the replies kept, and the clients whose
    # ``done_below`` is remembered.
    def remember(self, key: tuple[int, int], reply: list) -> None:
        """Keep the reply of mutating request ``key`` (client id, request id) for its retries
        (NOTE [reply cache])."""
        self._replies[key] = reply
        self._reply_rids.setdefault(key[0], collections.deque()).append(key[1])
        if len(self._replies) > self._reply_cache:
            (cid, rid), _ = self._replies.popitem(last=False)
            self._drop_rid(cid, rid)

    def _answered(self, key: tuple[int, int], header: dict) -> bool:
        """Record the client's ``done_below`` (dropping its kept replies below it); True
        when request ``key`` itself is below it (NOTE [reply cache]).

        Raises:
            ProtocolError: ``done_below`` is not an int in [0, 2**64).
        """
        cid, rid = key
        done = self._done_below.get(cid, 0)
        if "done_below" in header:
            done = max(done, wire.get_int(header, "done_below", 0, (1 << 64) - 1))
            self._done_below[cid] = done
            self._done_below.move_to_end(cid)
            if len(self._done_below) > self._reply_cache:
                self._done_below.popitem(last=False)
        rids = self._reply_rids.get(cid)
        while rids and rids[0] < done:
            self._replies.pop((cid, rids.popleft()), None)
        if rids is not None and not rids:
            del self._reply_rids[cid]
        return rid < done

    def _drop_rid(self, cid: int, rid: int) -> None:
        """The oldest kept reply of all was evicted: it is also its client's oldest."""
        rids = self._reply_rids.get(cid)
        if rids and rids[0] == rid:
            rids.popleft()
            if not rids:
                del self._reply_rids[cid]

    def error_reply(self, op: Any, rid: int, exc: BaseException) -> list:
        """The error reply frames of request ``rid`` that failed with ``exc`` (counted)."""
        kind = _error_kind(exc)
        self.counters["errors"] += 1
        self.counters["errors_" + kind] += 1
        if kind == "internal":
            traceback.print_exception(exc, file=sys.stderr)
        msg = str(exc) if isinstance(exc, HeraldError) else f"{type(exc).__name__}: {exc}"
        # echo only a known op: an arbitrary one could push the reply past the header limit
        return PS.pack(
            {"op": op if op in wire.OPS else "", "rid": rid, "ok": False, "error": kind, "message": msg[:2000]}
        )

    def _parts(
        self, header: dict[str, Any], arrays: list, op: str, clock: str | None = None, wire_dtype: str = "fp32"
    ) -> list[Part]:
        """Check ``parts`` against the arrays (NOTE [ps wire protocol]): per-table parts
        ``{"table": t}`` and flat parts ``{"flat": true}`` (their first frame: the table of
        every key); compressed frames (``wire_dtype``, NOTE [wire compression]) are decoded.
        ``clock``: each part ends with that clock frame (NOTE [clock frames]), given back
        widened to uint64: ``clocks`` (a conditional pull: at most n) or ``advance`` (exactly
        n). Every key's table, shape and shard are checked by the op's kernel."""
        parts = header.get("parts")
        spec = wire.PART_FRAMES[op]
        if (
            clock is None
            and (wire_dtype == "fp32" or op == "pull")
            and type(parts) is list
            and len(parts) == 1
            and type(parts[0]) is dict
            and len(parts[0]) == 1
            and parts[0].get("flat") is True
            and len(arrays) == len(spec) + 1
        ):  # what PSClient sends: one flat part
            p = self._part(op, spec, parts[0], arrays[0], arrays[1:])
            if p.keys.shape[0] > self.limits.max_keys_per_request:
                self._too_many(op, p.keys.shape[0])
            return [p]
        if not isinstance(parts, list) or len(parts) > MAX_PARTS:
            raise ProtocolError(f"{op}: header 'parts' must be a list of at most {MAX_PARTS} maps")
        base = len(spec) if wire_dtype == "fp32" or op == "pull" else len(wire.COMPRESSED_PART_FRAMES[op])
        extra = clock is not None
        sizes = []
        for k, part in enumerate(parts):
            if type(part) is not dict or (part.get("flat") is not True) == ("table" not in part):
                raise ProtocolError(f"{op}: part {k} must be a map {{'table': index}} or {{'flat': true}}")
            sizes.append(base + extra + ("table" not in part))
        if len(arrays) != sum(sizes):
            raise ProtocolError(f"{op}: {len(parts)} parts need {sum(sizes)} frames, got {len(arrays)}")
        out, n_keys, at = [], 0, 0
        for k, part in enumerate(parts):
            frames = arrays[at : at + sizes[k]]
            at += sizes[k]
            flat = "table" not in part
            tables = frames[0] if flat else None
            ops = frames[flat : sizes[k] - extra]
            if base != len(spec):
                ops = compress.decode_part(op, ops, wire_dtype)
            p = self._part(op, spec, part, tables, ops)
            if extra:
                p.rest.append(
                    frozen(
                        wire.unpack_clocks(
                            frames[-1], f"{op} {clock} of part {k}", p.keys.shape[0], prefix=clock == "clocks"
                        )
                    )
                )
            n_keys += p.keys.shape[0]
            out.append(p)
        if n_keys > self.limits.max_keys_per_request:
            self._too_many(op, n_keys)
        if op != "pull" and len(out) > 1:
            seen = set()
            for p in out:
                ts = set(np.unique(p.tables).tolist())
                if ts & seen:
                    raise ProtocolError(f"{op}: table {min(ts & seen)} appears in two parts; merge them")
                seen |= ts
        return out

    def _too_many(self, op: str, n_keys: int) -> None:
        raise ProtocolError(
            f"{op}: {n_keys} keys in one request exceed this shard's max_keys_per_request="
            f"{self.limits.max_keys_per_request}; send fewer keys per request (PSClient "
            "splits by the limit the shards announce) or raise --max-keys-per-request"
        )

    def _part(self, op: str, spec: tuple, part: dict, tables, frames: list) -> Part:
        """One part's frames: dtypes and shapes (against its first key's table); arrays
        frozen (one kernel variant each: :func:`~herald.ps.store.frozen`)."""
        for (name, dt), a in zip(spec, frames):
            if a.dtype != dt:  # not a.dtype.str: that builds a string
                raise ProtocolError(f"{op}: {name} must be {dt}, got {a.dtype.str}")
        keys = frames[0]
        if keys.ndim != 1:
            raise ProtocolError(f"{op}: keys must be 1-d, got shape {keys.shape}")
        n = keys.shape[0]
        n_tables = len(self.tables)
        if tables is None:  # a per-table part
            ti = part.get("table")
            if type(ti) is not int or not 0 <= ti < n_tables:
                raise ProtocolError(
                    f"{op}: unknown table {ti!r}; this shard has {n_tables} tables (declare them first)"
                )
            tables = self.store.directory.positions(ti, n)
        else:
            if tables.dtype != wire.TABLES_DTYPE or tables.shape != (n,):
                raise ProtocolError(
                    f"{op}: the tables frame of a flat part must be {wire.TABLES_DTYPE} [{n}], "
                    f"got {tables.dtype.str} {tables.shape}"
                )
            ti = int(tables[0]) if n else -1
            if ti >= n_tables:
                raise ProtocolError(f"{op}: unknown table {ti}; this shard has {n_tables} tables (declare them first)")
            tables = frozen(tables)
        if ti >= 0:
            dim, width = self.tables[ti].cfg.dim, self.tables[ti].width
        else:  # no keys: nothing to check
            dim = width = next((a.shape[1] for a in frames[1:] if a.ndim == 2), 0)
        for (field, _), a in zip(spec[1:], frames[1:]):
            want = (n, dim) if field == "grads" else (n, width) if field == "rows" else (n,)
            if a.shape != want:
                name = repr(self.tables[ti].cfg.name) if ti >= 0 else "(none)"
                raise ProtocolError(f"{op}: {field} of table {name} must have shape {want}, got {a.shape}")
        return Part(tables, frozen(keys), [frozen(a) for a in frames[1:]], dim, width, part)

    def _op_ping(self, header, arrays):
        return {}, []

    def _op_declare(self, header, arrays):
        decl = header.get("tables")
        if not isinstance(decl, list):
            raise ProtocolError("declare: header 'tables' must be a list of table maps")
        workers = header.get("workers")
        if workers is not None:
            bound = self.limits.max_contributors
            if type(workers) is not int or not 1 <= workers <= bound:
                raise ConfigError(
                    f"declare: workers must be an int in [1, {bound}] (this shard's "
                    f"max_contributors; raise --max-contributors), got {workers!r:.40}"
                )
            if self.workers is not None and workers != self.workers:
                raise ConfigError(
                    f"declare: this shard serves a job of {self.workers} workers; a declare of "
                    f"{workers} is rejected (restart the shards for another job)"
                )
        tables = [TableConfig.from_dict(d) for d in decl]
        self.declare(tables)
        if workers is not None:
            self.workers = workers
        return {"n_tables": len(self.tables), "limits": self.limits.to_dict()}, []

    def _op_pull(self, header, arrays):
        if "staleness" in header:  # NOTE [clock frames]: a conditional pull
            return clocked.op_pull(self, header, arrays)
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
        parts = self._parts(header, arrays, "pull")
        return [(p, self.store.slots(p.tables, p.keys, p.dim, p.width, "pull")) for p in parts]

    def read_pull(self, resolved: list[tuple[Part, np.ndarray]], wire_dtype: str) -> tuple[dict, list]:
        """The reply ``(header, frames)`` of a pull :meth:`resolve_pull` resolved: its rows as
        they are now, in ``wire_dtype`` (NOTE [wire compression])."""
        out = []
        for p, slots in resolved:
            rows, pending = self.store.rows_at(p.tables, slots, p.width)
            self.counters["pull_keys"] += p.keys.shape[0]
            self.counters["pull_pending_keys"] += pending
            out += compress.encode_rows(rows, p.dim, wire_dtype)
        reply = {"parts": [p.echo for p, _ in resolved]}
        return (dict(reply, wire=wire_dtype) if wire_dtype != "fp32" else reply), out

    def _op_push_grad(self, header, arrays):
        step = wire.get_int(header, "step", -(1 << 62), 1 << 62)
        bound = self.contributor_bound
        rank = wire.get_int(header, "rank", 0, 1 << 30)
        if rank >= bound:
            raise ProtocolError(
                f"push_grad: rank {rank} is not below {self._bound_name()}; ranks run from 0 to workers - 1"
            )
        parts = self._parts(header, arrays, "push_grad", wire_dtype=compress.wire_of(header))
        stamp = self.store.next_stamp()  # a key twice in the request, in any part, is refused
        name = self._bound_name()
        if len(parts) == 1:  # checked and applied in one kernel call
            p = parts[0]
            applied = self.store.push_grad(
                p.tables, p.keys, p.rest[0], p.rest[1], step, rank, stamp, bound=bound, bound_name=name
            )[1]
        else:  # every part checked before any is applied (NOTE [ps aggregation])
            checked = [
                self.store.check_grad(
                    p.tables, p.keys, p.rest[0], p.rest[1], step, rank, stamp, bound=bound, bound_name=name
                )
                for p in parts
            ]
            if max(cmax for _, cmax in checked) > 1:
                self.store.reserve_step(step, sum(p.keys.shape[0] for p in parts), max(p.dim for p in parts))
            applied = sum(
                self.store.apply_grad(p.tables, p.keys, p.rest[0], p.rest[1], step, rank, slots)
                for p, (slots, _) in zip(parts, checked)
            )
        self._pushers_add(step, rank)
        self.counters["push_grad_keys"] += sum(p.keys.shape[0] for p in parts)
        self.counters["rows_updated"] += applied
        return {"applied": applied}, []

    def _pushers_add(self, step: int, rank: int) -> None:
        """Remember that ``rank`` pushed ``step`` (to name the missing ranks of an abort)."""
        ranks = self._pushers.setdefault(step, set())
        ranks.add(rank)
        self._pushers.move_to_end(step)
        while len(self._pushers) > PUSHER_STEPS:
            self._pushers.popitem(last=False)

    @property
    def contributor_bound(self) -> int:
        """Largest ``contributors`` value accepted, and the bound on ``rank`` (NOTE [ps limits])."""
        return min(self.limits.max_contributors, self.workers or self.limits.max_contributors)

    def _bound_name(self) -> str:
        if self.workers is not None and self.workers <= self.limits.max_contributors:
            return f"the job's {self.workers} workers (declared)"
        return f"this shard's max_contributors={self.limits.max_contributors} (--max-contributors)"

    def expire_aggregations(self, now: float | None = None) -> list[dict]:
        """Abort every aggregation open longer than ``aggregation_timeout_ms`` (NOTE [ps
        aggregation]): count, log (stderr: the shard's log) and keep a report naming the
        ranks that did not push. Returns the reports of this call."""
        now = time.monotonic() if now is None else now
        timeout_s = self.limits.aggregation_timeout_ms / 1000.0
        out = []
        if self.store.aggregations.pending:
            for report in self.store.aggregations.expire(now, timeout_s):
                pushed = sorted(self._pushers.get(report["step"], ()))
                report["ranks_pushed"] = pushed
                if self.workers is not None:
                    report["missing_ranks"] = [r for r in range(self.workers) if r not in pushed]
                else:
                    report["missing_ranks"] = "unknown (declare the job's workers: PSClient(num_workers=...))"
                self.counters["aggregations_aborted"] += 1
                self.counters["aggregation_keys_aborted"] += report["open_keys"]
                self.aborted.append(report)
                out.append(report)
                print(
                    f"herald ps shard {self.shard}/{self.num_shards}: aborted {report['open_keys']} open "
                    f"aggregations of step {report['step']} on table {report['table']!r} after "
                    f"{report['waited_ms']} ms (aggregation_timeout_ms={self.limits.aggregation_timeout_ms}); "
                    f"expected {report['contributors']} contributors, ranks that pushed {pushed}, "
                    f"missing ranks {report['missing_ranks']}",
                    file=sys.stderr,
                    flush=True,
                )
        return out

    def _op_push_rows(self, header, arrays):
        if "advance" in header or "read_clocks" in header:  # NOTE [clock frames]
            return clocked.op_push_rows(self, header, arrays)
        parts = self._parts(header, arrays, "push_rows", wire_dtype=compress.wire_of(header))
        stamp = self.store.next_stamp()
        for p in parts:
            self.store.push_rows(p.tables, p.keys, p.rest[0], None, stamp)
            self.counters["push_rows_keys"] += p.keys.shape[0]
        return {}, []

    def _op_gba_push(self, header, arrays):  # NOTE [gba tokens] (herald/ps/gba.py)
        return gba.op_push(self, header, arrays)

    def _op_gba_pull(self, header, arrays):
        return gba.op_pull(self, header, arrays)

    def _op_stats(self, header, arrays):
        return {"stats": self.stats()}, []

    def _op_checkpoint(self, header, arrays):
        path = self.admin.check("checkpoint", header)  # NOTE [ps admin ops]
        open_aggs = self.store.open_total
        if open_aggs:
            raise ProtocolError(
                f"checkpoint refused: {open_aggs} gradient aggregations are open; "
                "checkpoint between steps (after every push of the step is acked); an "
                "aggregation whose contributors never come is aborted after "
                f"aggregation_timeout_ms={self.limits.aggregation_timeout_ms}"
            )
        final = checkpoint.save(path, self.shard, self.num_shards, self.seed, self.tables)
        return {"path": str(final)}, []

    def _op_restore(self, header, arrays):
        path = self.admin.check("restore", header)
        data = checkpoint.load(path, self.shard, self.num_shards, self.seed, self.tables)
        # NOTE [ps limits]: room to grow (power-of-two arrays) where max_shard_bytes allows, else the rows alone
        caps = [t.load_capacity(k.shape[0]) for t, (k, _) in zip(self.tables, data)]
        if sum(table_bytes(c, t.width) for t, c in zip(self.tables, caps)) > self.limits.max_shard_bytes:
            caps = [max(16, k.shape[0]) for k, _ in data]
        self.store.directory.check_bytes(
            sum(table_bytes(c, t.width) for t, c in zip(self.tables, caps)), f"restoring {path}"
        )
        for table, (keys, rows), cap in zip(self.tables, data, caps):
            table.load(keys, rows, cap)
        self.gba = None  # its global step and buffered contributions belong to the rolled-back run (NOTE [gba tokens])
        self.steps.clear()  # so do the held step messages (NOTE [step messages])
        return {"rows": int(sum(k.shape[0] for k, _ in data))}, []

    def _op_shutdown(self, header, arrays):
        self.admin.check("shutdown", header)
        self._stop = True
        return {}, []

    def stats(self) -> dict[str, Any]:
        """Counters and per-table sizes (plain types, msgpack-able)."""
        self._count_handshakes()
        return {
            "shard": self.shard,
            "num_shards": self.num_shards,
            "pid": os.getpid(),
            "counters": dict(self.counters),
            "busy_s": {op: round(s, 6) for op, s in self.busy_s.items()},
            "uptime_s": round(time.monotonic() - self._started, 6),
            "open_aggregations": self.store.open_total,
            "replies_kept": len(self._replies),  # NOTE [reply cache]
            "step_barrier": self.steps.stats(),  # NOTE [step barrier timing] in herald/ps/stepped.py
            "aborted": list(self.aborted),
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

    # ------------------------------------------------------------------ loop
    def _count_handshakes(self) -> None:
        for kind, n in (self._handshakes.take() if self._handshakes is not None else {}).items():
            self.counters["handshakes_refused"] += n
            self.counters["handshakes_refused_" + kind] += n

    def stop(self, *_args) -> None:
        """Ask the loop to end (safe from a signal handler)."""
        self._stop = True

    def serve(self, ready_file: str | None = None, poll_ms: int = 100) -> None:
        """Bind and serve until :meth:`stop`, SIGTERM or a ``shutdown`` request.

        Writes the bound endpoint to ``ready_file`` (atomically) once serving.
        """
        warm_up()
        sock = server_socket(zmq.Context.instance(), zmq.ROUTER, self.keys_dir)  # NOTE [transport security]
        self._handshakes = HandshakeMonitor(sock) if self.keys_dir is not None else None
        sock.setsockopt(zmq.LINGER, 1000)
        PS.configure(sock, max_array_bytes=largest_frame_bytes(self.limits))  # NOTE [message size limits]
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.bind(self.bind)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        print(
            f"herald ps shard {self.shard}/{self.num_shards}: serving on {self.endpoint} "
            f"({len(self.tables)} tables, seed {self.seed})",
            file=sys.stderr,
            flush=True,
        )
        if ready_file:
            tmp = f"{ready_file}.tmp"
            with open(tmp, "w") as f:
                f.write(self.endpoint)
            os.replace(tmp, ready_file)
        try:
            while not self._stop:
                now = time.monotonic()
                replies = []
                if now >= self._next_expiry:
                    self._next_expiry = now + EXPIRE_EVERY_S
                    self.expire_aggregations(now)
                    replies = stepped.expire_steps(self, now)
                    self._count_handshakes()
                if sock.poll(0 if replies else poll_ms):
                    frames = sock.recv_multipart(copy=False)
                    replies += self.receive(frames[0].bytes, frames[1:])
                for peer, reply in replies:
                    sock.send_multipart([peer] + reply, copy=False)
        finally:
            if self._handshakes is not None:
                self._handshakes.close()
            sock.close(linger=1000)


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel variant the server uses."""
    for name in SPARSE_OPTIMIZERS:
        t = EmbeddingTable(TableConfig("warm", 2, OptimizerConfig(name=name)), 0, 0, 16)
        keys = np.arange(4, dtype=np.uint64)
        t.pull(keys)
        grads = np.ones((4, 2), np.float32)
        t.push_grad(keys, grads, np.ones(4, np.uint16), 0, 0)
        t.push_grad(keys, grads, np.full(4, 2, np.uint16), 1, 0)
        t.push_grad(keys, grads, np.full(4, 2, np.uint16), 1, 1)
        rows = np.ones((4, t.width), np.float32)
        t.push_rows(keys, rows)
        t.push_rows(keys, rows, np.ones(4, np.uint64))
        t.pull_clocked(keys, np.zeros(2, np.uint64), 0)
        t.pull(keys)
    K.shard_of_jit(np.uint64(0), frozen(np.arange(4, dtype=np.uint64)), 1, np.empty(4, np.int64))


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

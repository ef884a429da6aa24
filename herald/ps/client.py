"""Client of the PS shards: routes keys with :func:`shard_of`, talks NOTE [ps wire
protocol] (docs/ps.md; framing: NOTE [wire format]) over one DEALER socket per shard.

Every pull and push goes out as flat requests: one per shard, its keys of every table in
one flat part (``tables`` uint16 [n] + ``keys`` uint64 [n] + the values), grouped by table
in one counting-sort pass (:func:`~herald.ps.kernels.shard_order_jit`). The ``*_flat_async``
operations take ``(tables, keys)`` arrays as a worker's KeySets hold them; the per-table
ones (``{table: keys}``) are flattened into them (one flat operation per table shape).

ps-lite style: every operation has a non-blocking ``*_async`` form returning a
:class:`Handle`; requests to several shards go out at once and ``wait()`` collects
them. An operation over more keys than a shard takes in one request (NOTE [ps
limits]: ``max_keys_per_request``, announced in the declare reply) is split into
several requests per shard; each request is validated and applied on its own.

Timeouts (NOTE [ps client deadline]): the user's ``timeout_ms`` bounds the whole wait
for a request, retries included. It is cut into ``retries + 1`` attempts of
``timeout_ms / (retries + 1)`` each: when an attempt expires, the shard's socket is
closed and reopened and its outstanding requests re-sent (zguide "Lazy Pirate"); when
the last one expires, :class:`~herald.errors.PeerTimeout` names the shard (index and
address) and the operation. Sending waits one attempt at most (``SNDTIMEO``: a DEALER
with no peer blocks, e.g. after a refused CURVE handshake), and a request it could not
queue has failed that attempt. So a request waited on from the moment it is sent is
answered or fails within ``timeout_ms``, never ``(retries + 1) x timeout_ms``.
Retrying is safe for every op: shards answer a repeated mutating request (same client
id and request id) from a reply cache instead of applying it twice (NOTE [reply cache]
in herald/ps/server.py: every request says below which request id this client awaits
no reply, so the shard forgets those). A client is not thread-safe: use one per thread.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from herald.auth import load_client_keys, secure_client
from herald.contracts.tables import TableConfig, check_tables
from herald.contracts.vocab import DEFAULT_TIMEOUT_MS
from herald.errors import ConfigError, HeraldError, PeerTimeout, ProtocolError
from herald.ps import compress
from herald.ps import kernels as K
from herald.ps.admin import AdminRefused, check_token
from herald.ps.checkpoint import CheckpointError
from herald.ps.clocked import ClockOps
from herald.ps.config import MAX_TABLES, ShardLimits
from herald.ps.rows import table_salt
from herald.ps.stepped import StepOps
from herald.ps.wire import PS, put_rows

_ERRORS = {
    "protocol": ProtocolError,
    "config": ConfigError,
    "checkpoint": CheckpointError,
    "refused": AdminRefused,
    "internal": ProtocolError,
}


def _loose_header(frame) -> dict:
    """A reply header :data:`PS` rejected, decoded without its checks (only to find its
    ``rid``; plain types only); ``{}`` if even that fails."""
    try:
        header = msgpack.unpackb(getattr(frame, "buffer", frame), raw=False, max_bin_len=0, max_ext_len=0)
    except Exception:  # msgpack raises several unrelated types on garbage
        return {}
    return header if type(header) is dict else {}


class _Request:
    __slots__ = ("shard", "rid", "op", "frames", "deadline", "tries", "timeout_ms", "attempt_s")

    def __init__(self, shard, rid, op, frames, timeout_ms, attempts):
        self.shard, self.rid, self.op, self.frames = shard, rid, op, frames
        self.timeout_ms = timeout_ms
        self.attempt_s = timeout_ms / 1000.0 / attempts  # NOTE [ps client deadline]
        self.deadline = time.monotonic() + self.attempt_s
        self.tries = 0


class Handle:
    """An operation in flight; :meth:`wait` returns its result (once computed, cached)."""

    def __init__(self, client: PSClient, rids: list[int], finish: Callable[[list], Any]):
        self._client, self._rids, self._finish = client, rids, finish
        self._done = False
        self._result = None

    def wait(self) -> Any:
        """Block until every shard answered (bounded by the client's timeouts and retries).

        Raises:
            PeerTimeout: a shard did not answer after all retries (names address and op).
            ProtocolError / ConfigError / CheckpointError: a shard rejected the request.
        """
        if not self._done:
            replies = self._client._collect(self._rids)
            self._result = self._finish(replies)
            self._done = True
        return self._result


class PSClient(ClockOps, StepOps):
    """Talks to every shard of one PS (the clock-carrying ops: :class:`ClockOps`; the step
    message: :class:`StepOps`).

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
    ):
        if not addresses:
            raise ConfigError("PSClient needs at least one shard address")
        if timeout_ms <= 0 or retries < 0:
            raise ConfigError(f"timeout_ms must be > 0 and retries >= 0, got {timeout_ms}, {retries}")
        if num_workers is not None and (type(num_workers) is not int or num_workers < 1):
            raise ConfigError(f"num_workers must be an int >= 1 or None, got {num_workers!r}")
        self.num_workers = num_workers
        self.wire_dtype = compress.check_wire_dtype(wire_dtype)
        self._keys = load_client_keys(keys_dir) if keys_dir is not None else None
        self._admin_token = check_token(admin_token, "admin_token")
        #: keys per request (NOTE [ps limits]); lowered to the shards' limit by :meth:`declare`
        self.max_keys_per_request = ShardLimits().max_keys_per_request
        self.addresses = list(addresses)
        self.tables = check_tables(tables)
        if len(self.tables) > MAX_TABLES:
            raise ConfigError(f"PSClient takes at most {MAX_TABLES} tables, got {len(self.tables)}")
        self._index = {t.name: i for i, t in enumerate(self.tables)}
        self._salts = np.array([table_salt(i) for i in range(len(self.tables))], np.uint64)
        shapes = sorted({(t.dim, t.row_width) for t in self.tables})
        #: shape class of each table: tables of one class travel in one flat part
        self._shape_of = np.array([shapes.index((t.dim, t.row_width)) for t in self.tables], np.int64)
        self._shapes = shapes
        self.timeout_ms, self.retries = int(timeout_ms), int(retries)
        self._cid = secrets.randbits(63)
        self._rids = itertools.count(1)
        self._ctx = zmq.Context.instance()
        self._socks: list[zmq.Socket | None] = [None] * len(self.addresses)
        self._pending: dict[int, _Request] = {}
        self._replies: dict[int, tuple[dict, list]] = {}
        #: what went over the sockets since :meth:`take_traffic`: requests issued, and the
        #: bytes of every frame sent (retries included) and received
        self.traffic = {"requests": 0, "bytes_sent": 0, "bytes_received": 0}
        self._closed = False
        for s in range(len(self.addresses)):
            self._connect(s)
        if declare:
            self.declare()

    # ------------------------------------------------------------------ plumbing
    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def table_index(self, table: int | str) -> int:
        """Index of ``table`` (an index or a name). Raises ConfigError if unknown."""
        if isinstance(table, str):
            if table not in self._index:
                raise ConfigError(f"unknown table {table!r}; known: {list(self._index)}")
            return self._index[table]
        t = int(table)
        if not 0 <= t < len(self.tables):
            raise ConfigError(f"table index {t} out of range [0, {len(self.tables)})")
        return t

    def _connect(self, shard: int) -> None:
        old = self._socks[shard]
        if old is not None:
            old.close(linger=0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, max(1, self.timeout_ms // (self.retries + 1)))  # NOTE [ps client deadline]
        PS.configure(sock)
        if self._keys is not None:
            secure_client(sock, self._keys)
        sock.connect(self.addresses[shard])
        self._socks[shard] = sock

    def _send(self, shard: int, op: str, header: dict, arrays=(), timeout_ms: int | None = None) -> int:
        if self._closed:
            raise ConfigError("PSClient is closed")
        rid = next(self._rids)
        # NOTE [reply cache]: every request of ours below this one is answered or given up
        done_below = min(rid, min(self._pending, default=rid))
        header = dict(header, op=op, rid=rid, cid=self._cid, done_below=done_below)
        frames = PS.pack(header, arrays)
        req = _Request(shard, rid, op, frames, timeout_ms or self.timeout_ms, self.retries + 1)
        self._pending[rid] = req
        self.traffic["requests"] += 1
        self._post(req)
        return rid

    def _post(self, req: _Request) -> None:
        """Queue ``req``, waiting at most ``SNDTIMEO``; if it cannot be, its attempt (and every
        later one on that socket, without waiting again) fails now: :meth:`_await` retries."""
        sock = self._socks[req.shard]
        try:
            sock.send_multipart(req.frames, copy=False)
            self.traffic["bytes_sent"] += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in req.frames)
        except zmq.Again:
            sock.setsockopt(zmq.SNDTIMEO, 0)  # until _connect replaces the socket
            req.deadline = time.monotonic()

    def _collect(self, rids: list[int]) -> list[tuple[dict, list]]:
        """Wait for the replies of ``rids`` (in order), retrying shards that time out.

        On any failure the whole operation is abandoned: its other requests are
        forgotten (late replies are dropped), so nothing accumulates.
        """
        try:
            self._await(rids)
        except BaseException:
            for r in rids:
                self._pending.pop(r, None)
                self._replies.pop(r, None)
            raise
        out, error = [], None
        for r in rids:  # pop every reply before raising the first error
            try:
                out.append(self._pop(r))
            except HeraldError as exc:
                error = error or exc
        if error is not None:
            raise error
        return out

    def _await(self, rids: list[int]) -> None:
        while any(r not in self._replies for r in rids):
            lost = [r for r in rids if r not in self._replies and r not in self._pending]
            if lost:
                raise ProtocolError(
                    f"request {lost[0]} was abandoned after an earlier timeout of its shard; issue the operation again"
                )
            waiting = [self._pending[r] for r in rids if r not in self._replies]
            now = time.monotonic()
            for req in waiting:
                if now >= req.deadline:
                    self._expire(req)
            poller = zmq.Poller()
            shards = sorted({r.shard for r in waiting})
            for s in shards:
                poller.register(self._socks[s], zmq.POLLIN)
            wait_ms = max(0, int((min(r.deadline for r in waiting) - time.monotonic()) * 1000) + 1)
            for sock, _ in poller.poll(wait_ms):
                while True:
                    try:
                        frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._accept(frames)

    def _accept(self, frames) -> None:
        self.traffic["bytes_received"] += sum(len(f) for f in frames)
        try:
            header, error = PS.unpack_header(frames[0]), None
        except ProtocolError as exc:  # still match it to its request, to raise there
            header, error = _loose_header(frames[0]), exc
        rid = header.get("rid")
        req = self._pending.pop(rid, None) if type(rid) is int else None
        if req is None:
            return  # a late duplicate of a retried request, or no request id at all: drop it
        self._replies[rid] = (header, frames[1:], req, error)

    def _pop(self, rid: int):
        header, frames, req, error = self._replies.pop(rid)
        if error is not None:
            raise ProtocolError(
                f"shard {req.shard} ({self.addresses[req.shard]}) sent a malformed reply to {req.op}: {error}"
            )
        if not header.get("ok"):
            exc = _ERRORS.get(header.get("error"), ProtocolError)
            raise exc(f"shard {req.shard} ({self.addresses[req.shard]}) rejected {req.op}: {header.get('message')}")
        return header, PS.unpack_arrays(header, frames)

    def _expire(self, req: _Request) -> None:
        if req.tries >= self.retries:
            for r in [r for r in self._pending.values() if r.shard == req.shard]:
                del self._pending[r.rid]
            self._connect(req.shard)
            raise PeerTimeout(
                f"PS shard {req.shard} at {self.addresses[req.shard]} did not answer {req.op} "
                f"within {req.timeout_ms} ms ({req.tries + 1} attempts of "
                f"{req.attempt_s * 1000:.0f} ms); is the shard running (herald serve ps), "
                "reachable, not stopped, and does this client hold its keys (--keys)? Its log "
                "names the cause",
                peer=self.addresses[req.shard],
                op=req.op,
            )
        self._connect(req.shard)  # Lazy Pirate: new socket, resend everything outstanding
        for r in sorted((r for r in self._pending.values() if r.shard == req.shard), key=lambda r: r.rid):
            r.tries += 1
            r.deadline = time.monotonic() + r.attempt_s
            self._post(r)

    # ------------------------------------------------------------------ flat requests
    def _flat_keys(self, tables, keys) -> tuple[np.ndarray, np.ndarray]:
        """``(tables uint16 [n], keys uint64 [n])``, every table a declared index.

        Raises:
            ConfigError: keys not 1-d uint64, tables of another length or out of range.
        """
        keys = np.asarray(keys)
        if keys.dtype != np.uint64 or keys.ndim != 1:
            raise ConfigError(f"keys must be a 1-d uint64 array, got {keys.dtype} {keys.shape}")
        tables = np.asarray(tables)
        if tables.shape != keys.shape or tables.dtype.kind not in "iu":
            raise ConfigError(
                f"tables must be an integer array of the keys' shape {keys.shape}, got {tables.dtype} {tables.shape}"
            )
        if keys.shape[0] and (int(tables.min()) < 0 or int(tables.max()) >= len(self.tables)):
            raise ConfigError(
                f"table indices must be in [0, {len(self.tables)}), got {int(tables.min())}..{int(tables.max())}"
            )
        return np.ascontiguousarray(tables, np.uint16), np.ascontiguousarray(keys)

    def _shape(self, tables: np.ndarray) -> tuple[int, int] | None:
        """``(dim, row width)`` shared by ``tables`` (ConfigError when they differ); None for
        no keys of a client whose tables have several shapes (nothing is sent then)."""
        if len(self._shapes) == 1:
            return self._shapes[0]
        if not tables.shape[0]:
            return None
        classes = self._shape_of[tables]
        if (classes != classes[0]).any():
            raise ConfigError(
                "a flat operation takes tables of one dim and row width; use the per-table "
                "operations (pull_async({table: keys}), ...) for tables of several shapes"
            )
        return self._shapes[int(classes[0])]

    def _route(self, tables: np.ndarray, keys: np.ndarray) -> list[tuple[int, np.ndarray | None]]:
        """``[(shard, positions or None for all)]``: the requests of a flat operation, each of
        the keys one shard owns, table after table (each table's positions ascending: a shard
        switches tables once per table), at most :attr:`max_keys_per_request` keys each."""
        n = keys.shape[0]
        if n == 0:
            return []
        groups: list[tuple[int, np.ndarray | None]] = []
        order = np.empty(n, np.int64)
        starts = np.empty(self.num_shards + 1, np.int64)
        same = K.shard_order_jit(self._salts, tables, keys, self.num_shards, len(self.tables), order, starts)
        for sh in range(self.num_shards):
            a, b = int(starts[sh]), int(starts[sh + 1])
            if b - a == n and same:
                groups = [(sh, None)]
                break
            if b > a:
                groups.append((sh, order[a:b]))
        limit = self.max_keys_per_request
        out = []
        for sh, pos in groups:
            m = n if pos is None else pos.shape[0]
            if m <= limit:
                out.append((sh, pos))
                continue
            for a in range(0, m, limit):
                out.append((sh, np.arange(a, min(a + limit, m)) if pos is None else pos[a : a + limit]))
        return out

    @staticmethod
    def _take(arrays: Sequence[np.ndarray], pos: np.ndarray | None) -> list[np.ndarray]:
        # np.take, not a[pos]: a 2-d a[pos] copies rows one by one (82 against 15 us, 2,500 x 17)
        return list(arrays) if pos is None else [np.take(a, pos, axis=0) for a in arrays]

    def _wire(self, header: dict) -> dict:  # NOTE [wire compression]: header and frames
        return header if self.wire_dtype == "fp32" else dict(header, wire=self.wire_dtype)

    def _send_flat(self, op: str, header: dict, routes: list, tables, keys, frames_of) -> list[int]:
        """One request per route: a flat part ``[tables, keys, *frames_of(positions)]``."""
        header = self._wire(dict(header, parts=[{"flat": True}]))
        return [self._send(sh, op, header, [*self._take((tables, keys), pos), *frames_of(pos)]) for sh, pos in routes]

    def _flatten(self, batch: Mapping, arity: int) -> list[tuple]:
        """A per-table batch ``{table: arrays}`` as flat operations, one per shape class:
        ``[(entries [(table key, start, end)], tables uint16, keys, [other arrays], (dim,
        row width))]``."""
        groups: dict[int, list] = {}
        for t, arrays in batch.items():
            ti = self.table_index(t)
            arrays = arrays if isinstance(arrays, tuple) else (arrays,)
            if len(arrays) != arity:
                raise ConfigError(f"table {t!r}: expected {arity} arrays, got {len(arrays)}")
            keys = np.asarray(arrays[0])
            if keys.dtype != np.uint64 or keys.ndim != 1:
                raise ConfigError(f"keys must be a 1-d uint64 array, got {keys.dtype} {keys.shape}")
            groups.setdefault(int(self._shape_of[ti]), []).append((t, ti, keys, arrays[1:]))
        out = []
        for cls, items in groups.items():
            entries, start = [], 0
            for t, _, keys, _ in items:
                entries.append((t, start, start + keys.shape[0]))
                start += keys.shape[0]
            if len(items) == 1:
                t, ti, keys, rest = items[0]
                tables = np.full(keys.shape[0], ti, np.uint16)
                out.append((entries, tables, keys, [np.asarray(a) for a in rest], self._shapes[cls]))
                continue
            tables = np.concatenate([np.full(k.shape[0], ti, np.uint16) for _, ti, k, _ in items])
            keys = np.concatenate([k for _, _, k, _ in items])
            rest = [np.concatenate([np.asarray(r[j]) for _, _, _, r in items]) for j in range(arity - 1)]
            out.append((entries, tables, keys, rest, self._shapes[cls]))
        return out

    def _combine(self, ops: list[tuple[list[int], Callable]], finish: Callable) -> Handle:
        """One :class:`Handle` over several ``(rids, finish)``: ``finish([each one's result])``."""
        rids = [r for rs, _ in ops for r in rs]

        def done(replies):
            results, at = [], 0
            for rs, f in ops:
                results.append(f(replies[at : at + len(rs)]))
                at += len(rs)
            return finish(results)

        return Handle(self, rids, done)

    # ------------------------------------------------------------------ operations
    def declare(self, timeout_ms: int | None = None) -> None:
        """Declare this client's tables (and ``num_workers``) on every shard (idempotent);
        adopt the smallest ``max_keys_per_request`` the shards announce, and the smallest
        ``max_rows`` of a bounded shard (NOTE [bounded ps]: a request never inserts more new
        keys of a table than the shard may hold, so a large pull is split, not refused)."""
        header = {"tables": [t.to_dict() for t in self.tables]}
        if self.num_workers is not None:
            header["workers"] = self.num_workers
        rids = [self._send(s, "declare", header, timeout_ms=timeout_ms) for s in range(self.num_shards)]
        for h, _ in self._collect(rids):
            limits = h.get("limits") or {}
            for limit in (limits.get("max_keys_per_request"), limits.get("max_rows")):
                if type(limit) is int and limit >= 1:
                    self.max_keys_per_request = min(self.max_keys_per_request, limit)

    def _pull_op(self, tables: np.ndarray, keys: np.ndarray, shape=None) -> tuple[list[int], Callable]:
        dim, width = shape or self._shape(tables) or (0, 0)
        routes = self._route(tables, keys)
        rids = self._send_flat("pull", {}, routes, tables, keys, lambda pos: ())
        n = keys.shape[0]

        def finish(replies):
            if len(routes) == 1 and routes[0][1] is None:  # one request: its frame as it is
                header, arrays = replies[0]
                return compress.decode_rows(arrays, compress.wire_of(header))[0]
            out = np.empty((n, width), np.float32)
            for (header, arrays), (_, pos) in zip(replies, routes):
                put_rows(out, pos, compress.decode_rows(arrays, compress.wire_of(header))[0], "pull reply")
            return out

        return rids, finish

    def pull_flat_async(self, tables, keys) -> Handle:
        """Start pulling ``(tables[i], keys[i])`` (table indices, uint64 keys; tables of one
        dim and row width); ``wait()`` gives float32 [n, row_width] in key order (read-only
        when one request carried every key: zero copy). Duplicates are allowed."""
        return Handle(self, *self._pull_op(*self._flat_keys(tables, keys)))

    def pull_async(self, batch: Mapping[int | str, np.ndarray]) -> Handle:
        """Start pulling ``{table: keys uint64 [n]}``; ``wait()`` gives ``{table: rows}``.

        Rows are float32 [n, row_width] (embedding then optimizer state) in key order;
        duplicate keys are allowed (each gets its row). The array may be read-only
        when one shard served every key (zero copy).
        """
        flat = self._flatten(batch, 1)
        ops = [self._pull_op(tables, keys, shape) for _, tables, keys, _, shape in flat]

        def finish(results):
            out = {}
            for (entries, _, _, _, _), rows in zip(flat, results):
                for t, a, b in entries:
                    out[t] = rows if len(entries) == 1 else rows[a:b]
            return out

        return self._combine(ops, finish)

    def pull(self, table: int | str, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` in ``table``: float32 [n, row_width]. See :meth:`pull_async`."""
        return self.pull_async({table: keys}).wait()[table]

    def _grad_frames(self, tables, keys, grads, contributors, shape=None) -> Callable:
        """``frames_of(positions)``: a push_grad part's frames after the keys (NOTE [wire
        compression]) of checked ``grads`` (float32 [n, dim]) and ``contributors`` (uint16 [n]).

        Raises:
            ConfigError: another shape.
        """
        shape = shape or self._shape(tables)
        grads = np.ascontiguousarray(grads, np.float32)
        contributors = np.ascontiguousarray(contributors, np.uint16)
        dim = shape[0] if shape else (grads.shape[1] if grads.ndim == 2 else -1)
        if grads.shape != (keys.shape[0], dim) or contributors.shape != keys.shape:
            raise ConfigError(
                f"grads must be float32 [{keys.shape[0]}, {dim}] and contributors uint16 "
                f"[{keys.shape[0]}], got {grads.shape} and {contributors.shape}"
            )
        return lambda pos: compress.encode_part(
            "push_grad", [keys[:0], *self._take((grads, contributors), pos)], dim, self.wire_dtype
        )[1:]

    def _rows_frames(self, tables, keys, rows, shape=None) -> Callable:
        """``frames_of(positions)``: a push_rows part's frames after the keys (NOTE [wire
        compression]) of checked ``rows`` (float32 [n, row_width]).

        Raises:
            ConfigError: another shape.
        """
        rows = np.ascontiguousarray(rows, np.float32)
        dim, width = shape or self._shape(tables) or (0, rows.shape[1] if rows.ndim == 2 else -1)
        if rows.shape != (keys.shape[0], width):
            raise ConfigError(f"rows must be float32 [{keys.shape[0]}, {width}], got {rows.shape}")
        return lambda pos: compress.encode_part(
            "push_rows", [keys[:0], *self._take((rows,), pos)], dim, self.wire_dtype
        )[1:]

    def _push_grad_op(
        self, tables, keys, grads, contributors, step: int, rank: int, shape=None
    ) -> tuple[list[int], Callable]:
        frames_of = self._grad_frames(tables, keys, grads, contributors, shape)
        rids = self._send_flat(
            "push_grad", {"step": int(step), "rank": int(rank)}, self._route(tables, keys), tables, keys, frames_of
        )
        return rids, lambda replies: sum(h.get("applied", 0) for h, _ in replies)

    def push_grad_flat_async(self, tables, keys, grads, contributors, step: int, rank: int) -> Handle:
        """Start pushing the gradients ``grads`` (float32 [n, dim]) of unique ``(tables[i],
        keys[i])`` with their ``contributors`` (uint16 [n]) for ``step`` from ``rank`` (NOTE
        [ps aggregation]); ``wait()`` returns the rows the shards updated."""
        tables, keys = self._flat_keys(tables, keys)
        return Handle(self, *self._push_grad_op(tables, keys, grads, contributors, step, rank))

    def push_grad_async(self, batch: Mapping, step: int, rank: int) -> Handle:
        """Start pushing ``{table: (keys uint64 [n] unique, grads float32 [n, dim],
        contributors uint16 [n])}`` for ``step`` from worker ``rank`` (NOTE [ps
        aggregation]). ``wait()`` returns the number of rows the shards updated. Do not
        modify the arrays before ``wait()`` returns."""
        ops = [
            self._push_grad_op(tables, keys, grads, contributors, step, rank, shape)
            for _, tables, keys, (grads, contributors), shape in self._flatten(batch, 3)
        ]
        return self._combine(ops, sum)

    def push_grad(self, table: int | str, keys, grads, step: int, contributors, rank: int = 0) -> int:
        """Push one table's gradients and wait for the acks; see :meth:`push_grad_async`."""
        return self.push_grad_async({table: (keys, grads, contributors)}, step, rank).wait()

    def _push_rows_op(self, tables, keys, rows, shape=None) -> tuple[list[int], Callable]:
        frames_of = self._rows_frames(tables, keys, rows, shape)
        return self._send_flat("push_rows", {}, self._route(tables, keys), tables, keys, frames_of), lambda r: None

    def push_rows_flat_async(self, tables, keys, rows) -> Handle:
        """Start writing back ``rows`` (float32 [n, row_width]: embedding and optimizer
        state) of unique ``(tables[i], keys[i])`` (NOTE [step protocol] steps 1 and 6)."""
        tables, keys = self._flat_keys(tables, keys)
        return Handle(self, *self._push_rows_op(tables, keys, rows))

    def push_rows_async(self, batch: Mapping) -> Handle:
        """Start writing back ``{table: (keys uint64 [n] unique, rows float32 [n, row_width])}``
        (embedding and optimizer state; NOTE [step protocol] steps 1 and 6)."""
        ops = [
            self._push_rows_op(tables, keys, rows, shape) for _, tables, keys, (rows,), shape in self._flatten(batch, 2)
        ]
        return self._combine(ops, lambda results: None)

    def push_rows(self, table: int | str, keys, rows) -> None:
        """Write back one table's rows and wait for the acks."""
        self.push_rows_async({table: (keys, rows)}).wait()

    def take_traffic(self) -> dict[str, int]:
        """:attr:`traffic` since the last call (then reset to 0)."""
        out = dict(self.traffic)
        self.traffic = dict.fromkeys(out, 0)
        return out

    def _handle(self, rids: list[int], finish: Callable[[list], Any]) -> Handle:
        return Handle(self, rids, finish)

    def request_async(self, shard: int, op: str, header: dict, arrays=()) -> Handle:
        """One ``op`` request to ``shard`` (NOTE [gba tokens]); ``wait()`` -> reply ``(header, arrays)``."""
        return Handle(self, [self._send(shard, op, header, list(arrays))], lambda replies: replies[0])

    def _all(self, op: str, header: dict | None = None, timeout_ms: int | None = None) -> list[dict]:
        rids = [self._send(s, op, header or {}, timeout_ms=timeout_ms) for s in range(self.num_shards)]
        return [h for h, _ in self._collect(rids)]

    def stats(self) -> list[dict]:
        """Per-shard statistics (counters, open aggregations, rows per table)."""
        return [h["stats"] for h in self._all("stats")]

    def ping(self) -> None:
        self._all("ping")

    def _admin(self, fields: dict) -> dict:
        """Header of an admin op: ``fields`` and the admin token (NOTE [ps admin ops])."""
        return dict(fields, token=self._admin_token) if self._admin_token is not None else fields

    def checkpoint(self, path: str, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> list[str]:
        """Every shard writes its checkpoint under ``path`` (atomic per shard; a relative
        path is made absolute here, so shards on this host use the caller's folder).

        Call between steps: a shard with open aggregations refuses (ProtocolError).

        Raises:
            AdminRefused: ``path`` is outside the shards' checkpoint root, or a wrong or
                missing admin token (NOTE [ps admin ops]).
        """
        return [h["path"] for h in self._all("checkpoint", self._admin({"dir": os.path.abspath(path)}), timeout_ms)]

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

    def close(self) -> None:
        """Close the sockets (immediately; idempotent). Unanswered requests are dropped."""
        if self._closed:
            return
        self._closed = True
        for s, sock in enumerate(self._socks):
            if sock is not None:
                sock.close(linger=0)
            self._socks[s] = None
        self._pending.clear()
        self._replies.clear()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

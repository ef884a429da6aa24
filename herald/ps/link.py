"""The client's link to the PS shards: one DEALER socket per shard, request ids, retries
and the deadline of every request (NOTE [ps client deadline]).

NOTE [ps client deadline]
~~~~~~~~~~~~~~~~~~~~~~~~~
The user's ``timeout_ms`` bounds the whole wait for a request, retries included. It is cut
into ``retries + 1`` attempts of ``timeout_ms / (retries + 1)`` each: when an attempt
expires, the shard's socket is closed and reopened and its outstanding requests re-sent
(zguide "Lazy Pirate"); when the last one expires, :class:`~herald.errors.PeerTimeout`
names the shard (index and address) and the operation. Sending waits one attempt at most
(``SNDTIMEO``: a DEALER with no peer blocks, e.g. after a refused CURVE handshake), and a
request it could not queue has failed that attempt. So a request waited on from the
moment it is sent is answered or fails within ``timeout_ms``, never ``(retries + 1) x
timeout_ms``. Retrying is safe for every op: shards answer a repeated mutating request
(same client id and request id) from a reply cache instead of applying it twice (NOTE
[reply cache] in herald/ps/replies.py: every request says below which request id this
client awaits no reply, so the shard forgets those). While it waits, the link asks its
``liveness`` check (when one is set: a PSClient sets its shards' death notices, NOTE [death
notices] in herald/deaths.py) about every shard it waits on, so a shard known dead is named
at once instead of at its deadline. A link is not thread-safe: use one per
thread.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq

from herald.auth import secure_client
from herald.errors import ConfigError, HeraldError, PeerTimeout, ProtocolError
from herald.ps.admin import AdminRefused
from herald.ps.checkpoint import CheckpointError
from herald.ps.wire import PS

_ERRORS = {
    "protocol": ProtocolError,
    "config": ConfigError,
    "checkpoint": CheckpointError,
    "refused": AdminRefused,
    "internal": ProtocolError,
}
#: Longest poll between two liveness checks while waiting (ms), when a check is set.
LIVENESS_POLL_MS = 100


def _loose_header(frame) -> dict:
    """A reply header :data:`PS` rejected, decoded without its checks (only to find its
    ``rid``; plain types only); ``{}`` if even that fails."""
    try:
        header = msgpack.unpackb(getattr(frame, "buffer", frame), raw=False, max_bin_len=0, max_ext_len=0)
    except Exception:  # msgpack raises several unrelated types on garbage
        return {}
    return header if type(header) is dict else {}


class PendingRequest:
    """A request sent and not answered yet: its ``shard``, request id ``rid``, ``op`` and
    packed ``frames``, and its deadline (NOTE [ps client deadline])."""

    __slots__ = ("shard", "rid", "op", "frames", "deadline", "tries", "timeout_ms", "attempt_s")

    def __init__(self, shard: int, rid: int, op: str, frames: list, timeout_ms: int, attempts: int):
        self.shard, self.rid, self.op, self.frames = shard, rid, op, frames
        self.timeout_ms = timeout_ms
        self.attempt_s = timeout_ms / 1000.0 / attempts  # NOTE [ps client deadline]
        self.deadline = time.monotonic() + self.attempt_s
        self.tries = 0


class Handle:
    """An operation in flight; :meth:`wait` returns its result (once computed, cached)."""

    def __init__(self, link: ShardLink, rids: list[int], finish: Callable[[list], Any]):
        self._link, self._rids, self._finish = link, rids, finish
        self._done = False
        self._result = None

    def wait(self) -> Any:
        """Block until every shard answered (bounded by the client's timeouts and retries).

        Raises:
            PeerTimeout: a shard did not answer after all retries (names address and op).
            ProtocolError / ConfigError / CheckpointError: a shard rejected the request.
        """
        if not self._done:
            replies = self._link.collect(self._rids)
            self._result = self._finish(replies)
            self._done = True
        return self._result


class ShardLink:
    """The sockets of one client to every shard (NOTE [ps client deadline]).

    Args:
        addresses: shard endpoints, index = shard number.
        timeout_ms: longest wait for one request, its retries included (> 0).
        retries: reconnect-and-resend attempts after an attempt expired (>= 0).
        keys: the CURVE client keys (NOTE [transport security]), or None.

    Attributes:
        traffic: what went over the sockets: ``requests`` issued, ``bytes_sent`` (every
            frame, retries included) and ``bytes_received``.
        liveness: None, or ``liveness(shard)`` asked about every shard waited on, at least
            every :data:`LIVENESS_POLL_MS` while waiting: it raises (naming the shard) when
            the shard is known dead, and the wait fails with that error at once.
        post: ``post(request)`` queues a :class:`PendingRequest` on its shard's socket; an
            in-process test bed or ``herald bench step`` replaces it (with :meth:`accept`
            for the replies, or :meth:`drop_pending` when none will come).
    """

    def __init__(self, addresses: Sequence[str], timeout_ms: int, retries: int, keys=None):
        self.addresses = list(addresses)
        self.timeout_ms, self.retries = int(timeout_ms), int(retries)
        self._keys = keys
        self._cid = secrets.randbits(63)
        self._rids = itertools.count(1)
        self._ctx: zmq.Context = zmq.Context.instance()
        self._socks: list[zmq.Socket | None] = [None] * len(self.addresses)
        self._pending: dict[int, PendingRequest] = {}
        self._replies: dict[int, tuple] = {}
        self.traffic = {"requests": 0, "bytes_sent": 0, "bytes_received": 0}
        self.liveness: Callable[[int], None] | None = None
        self.post: Callable[[PendingRequest], None] = self._post
        self.closed = False
        for s in range(len(self.addresses)):
            self._connect(s)

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def socket(self, shard: int) -> zmq.Socket | None:
        """The DEALER socket of ``shard`` now (a retry replaces it); None once closed."""
        return self._socks[shard]

    def _open(self, shard: int) -> zmq.Socket:
        """The socket of ``shard``.

        Raises:
            ConfigError: the link is closed.
        """
        sock = self._socks[shard]
        if sock is None:
            raise ConfigError("PSClient is closed")
        return sock

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

    def send(self, shard: int, op: str, header: dict, arrays: Sequence = (), timeout_ms: int | None = None) -> int:
        """Send one ``op`` request to ``shard``; returns its request id (for :meth:`collect`).

        Raises:
            ConfigError: the link is closed.
        """
        if self.closed:
            raise ConfigError("PSClient is closed")
        rid = next(self._rids)
        # NOTE [reply cache]: every request of ours below this one is answered or given up
        done_below = min(rid, min(self._pending, default=rid))
        header = dict(header, op=op, rid=rid, cid=self._cid, done_below=done_below)
        frames = PS.pack(header, arrays)
        req = PendingRequest(shard, rid, op, frames, timeout_ms or self.timeout_ms, self.retries + 1)
        self._pending[rid] = req
        self.traffic["requests"] += 1
        self.post(req)
        return rid

    def handle(self, rids: list[int], finish: Callable[[list], Any]) -> Handle:
        """A :class:`Handle` whose ``wait()`` gives ``finish([(header, arrays)] of rids)``."""
        return Handle(self, rids, finish)

    def combine(self, ops: list[tuple[list[int], Callable]], finish: Callable) -> Handle:
        """One :class:`Handle` over several ``(rids, finish)``: ``finish([each one's result])``."""
        rids = [r for rs, _ in ops for r in rs]

        def done(replies):
            results, at = [], 0
            for rs, f in ops:
                results.append(f(replies[at : at + len(rs)]))
                at += len(rs)
            return finish(results)

        return Handle(self, rids, done)

    def _post(self, req: PendingRequest) -> None:
        """Queue ``req``, waiting at most ``SNDTIMEO``; if it cannot be, its attempt (and every
        later one on that socket, without waiting again) fails now: :meth:`_await` retries."""
        sock = self._open(req.shard)
        try:
            sock.send_multipart(req.frames, copy=False)
            self.traffic["bytes_sent"] += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in req.frames)
        except zmq.Again:
            sock.setsockopt(zmq.SNDTIMEO, 0)  # until _connect replaces the socket
            req.deadline = time.monotonic()

    def drop_pending(self) -> None:
        """Forget every request in flight (their replies will never come: a capture)."""
        self._pending.clear()

    def collect(self, rids: list[int]) -> list[tuple[dict, list]]:
        """Wait for the replies ``(header, arrays)`` of ``rids`` (in order), retrying shards
        that time out. On any failure the whole operation is abandoned: its other requests
        are forgotten (late replies are dropped), so nothing accumulates.

        Raises:
            PeerTimeout: a shard did not answer after all retries. ProtocolError,
                ConfigError, CheckpointError, AdminRefused: a shard rejected a request
                (the first error, once every reply is in); the ``liveness`` check's error.
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
                if self.liveness is not None:  # the seam for a liveness-aware wait
                    self.liveness(s)
                poller.register(self._open(s), zmq.POLLIN)
            wait_ms = max(0, int((min(r.deadline for r in waiting) - time.monotonic()) * 1000) + 1)
            if self.liveness is not None:
                wait_ms = min(wait_ms, LIVENESS_POLL_MS)
            for sock, _ in poller.poll(wait_ms):
                while True:
                    try:
                        frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.accept(frames)

    def accept(self, frames: Sequence) -> None:
        """One reply's frames as received: matched to its request by ``rid`` (a late
        duplicate of a retried request, or a reply without a request id, is dropped)."""
        self.traffic["bytes_received"] += sum(len(f) for f in frames)
        try:
            header, error = PS.unpack_header(frames[0]), None
        except ProtocolError as exc:  # still match it to its request, to raise there
            header, error = _loose_header(frames[0]), exc
        rid = header.get("rid")
        req = self._pending.pop(rid, None) if type(rid) is int else None
        if req is None:
            return
        self._replies[req.rid] = (header, frames[1:], req, error)

    def _pop(self, rid: int) -> tuple[dict, list]:
        header, frames, req, error = self._replies.pop(rid)
        if error is not None:
            raise ProtocolError(
                f"shard {req.shard} ({self.addresses[req.shard]}) sent a malformed reply to {req.op}: {error}"
            )
        if not header.get("ok"):
            exc = _ERRORS.get(header.get("error"), ProtocolError)
            raise exc(f"shard {req.shard} ({self.addresses[req.shard]}) rejected {req.op}: {header.get('message')}")
        return header, PS.unpack_arrays(header, frames)

    def _expire(self, req: PendingRequest) -> None:
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
            self.post(r)

    def take_traffic(self) -> dict[str, int]:
        """:attr:`traffic` since the last call (then reset to 0)."""
        out = dict(self.traffic)
        self.traffic = dict.fromkeys(out, 0)
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the sockets without lingering (idempotent); unanswered requests are dropped.
        Returns at once (``timeout_s``: nothing here waits; docs/design.md, "Timeouts and units")."""
        if self.closed:
            return
        self.closed = True
        for s, sock in enumerate(self._socks):
            if sock is not None:
                sock.close(linger=0)
            self._socks[s] = None
        self._pending.clear()
        self._replies.clear()

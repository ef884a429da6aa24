"""A shard's request loop: framing, duplicates, busy time, error replies, ticks, serving.

Implements NOTE [ps wire protocol] (docs/ps.md; framing: NOTE [wire format] in
herald/wire.py) up to the op: every request is decoded (nothing received is unpickled),
a mutating one is checked against the reply cache (NOTE [reply cache] in
herald/ps/replies.py), and its op's handler (herald/ps/handler.py) gives the replies due.
Every malformed or refused request gets an error reply and the loop keeps serving; a
frame larger than the limits allow is cut off by libzmq before it is buffered (NOTE
[message size limits] in herald/wire.py). With a keys folder the socket is a CURVE
server: NOTE [transport security] (herald/auth.py).
"""

from __future__ import annotations

import collections
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import zmq

from herald.auth import HandshakeMonitor, server_socket
from herald.errors import ProtocolError
from herald.ps import wire
from herald.ps.config import ShardLimits, largest_frame_bytes
from herald.ps.handler import Handler, Op, Peer, Reply, Request
from herald.ps.replies import ReplyCache, error_reply
from herald.ps.wire import PS

#: Seconds between two ticks of the serve loop (expired aggregations and steps).
EXPIRE_EVERY_S = 0.1


class RequestLoop:
    """Decodes a shard's requests and hands each to its op.

    Args:
        ops: ``{op: (handler, op)}`` (:func:`herald.ps.handler.registry`).
        counters: the shard's counters (``requests``, ``duplicate_requests``, errors,
            refused handshakes).
        reply_cache: replies of mutating requests kept for retries (NOTE [reply cache]).
        ticks: ``tick(now) -> [Reply]`` called every :data:`EXPIRE_EVERY_S` while serving
            (expiries), their replies sent.
        name: how the shard names itself in its log (``herald ps shard 0/2``).

    Attributes:
        replies: the :class:`~herald.ps.replies.ReplyCache`.
        busy_s: seconds spent handling each op (``busy_s[op] / wall time`` = busy fraction).
        endpoint: the bound endpoint, once :meth:`serve` bound it.
    """

    def __init__(
        self,
        ops: Mapping[str, tuple[Handler, Op]],
        counters: collections.Counter,
        reply_cache: int,
        ticks: Sequence[Callable[[float], list[Reply]]],
        name: str,
    ):
        self.ops, self.counters, self.ticks, self.name = dict(ops), counters, tuple(ticks), name
        self.replies = ReplyCache(reply_cache)
        self.busy_s: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.started = time.monotonic()
        self.endpoint: str | None = None
        self._stop = False
        self._next_tick = 0.0
        self._handshakes: HandshakeMonitor | None = None

    def receive(self, peer: Peer, frames: Sequence) -> list[tuple[Peer, list]]:
        """The replies ``[(peer, frames)]`` due after one request from ``peer`` (its routing
        id) arrived; the time taken is added to :attr:`busy_s` under the request's op."""
        t0 = time.perf_counter()
        replies, op = self._handle(peer, frames)
        self.busy_s[op if op in wire.OPS else "malformed"] += time.perf_counter() - t0
        return self._keep(replies)

    def _keep(self, replies: list[Reply]) -> list[tuple[Peer, list]]:
        """Keep the replies that name their request for its retries; ``[(peer, frames)]``."""
        out = []
        for peer, frames, key in replies:
            if key is not None:
                self.replies.remember(key, frames)
            out.append((peer, frames))
        return out

    def _handle(self, peer: Peer, frames: Sequence) -> tuple[list[Reply], object]:
        rid = -1
        op = None
        try:
            if not frames:
                raise ProtocolError("empty message")
            header = PS.unpack_header(frames[0])
            got = header.get("rid")
            rid = got if type(got) is int else -1
            op = header.get("op")
            if op not in wire.OPS:
                raise ProtocolError(f"unknown op {op!r}; known ops: {list(wire.OPS)}")
            handler, run = self.ops[op]
            key = None
            if op in wire.MUTATING:
                key = (wire.get_int(header, "cid", 0, (1 << 64) - 1), wire.get_int(header, "rid", 0, (1 << 64) - 1))
                if self.replies.answered(key, header):  # NOTE [reply cache]: a late copy of a request answered
                    self.counters["duplicate_requests"] += 1
                    return [], op
                cached = self.replies.get(key)
                if cached is not None:
                    self.counters["duplicate_requests"] += 1
                    return [Reply(peer, list(cached))], op
                if handler.readdress(key, peer):  # held (a step message): answered when released
                    self.counters["duplicate_requests"] += 1
                    return [], op
            arrays = PS.unpack_arrays(header, frames[1:], readonly=True)  # the kernels' variant: frozen
            replies = run(Request(peer, op, rid, key, header, arrays))
            self.counters["requests"] += 1
            return replies, op
        except Exception as exc:  # every failure becomes an error reply; the loop goes on
            return [Reply(peer, error_reply(self.counters, op, rid, exc))], op

    def tick(self, now: float) -> list[tuple[Peer, list]]:
        """Run the ticks (and count refused handshakes); the replies they release."""
        replies = []
        for tick in self.ticks:
            replies += tick(now)
        self.count_handshakes()
        return self._keep(replies)

    def count_handshakes(self) -> None:
        """Refused CURVE handshakes into the counters (``handshakes_refused*``)."""
        for kind, n in (self._handshakes.take() if self._handshakes is not None else {}).items():
            self.counters["handshakes_refused"] += n
            self.counters["handshakes_refused_" + kind] += n

    def stop(self, *_args) -> None:
        """Ask :meth:`serve` to end (safe from a signal handler)."""
        self._stop = True

    def serve(
        self,
        bind: str,
        keys_dir: str | None,
        limits: ShardLimits,
        ready_file: str | None = None,
        poll_ms: int = 100,
        banner: str = "",
    ) -> None:
        """Bind ``bind`` (a CURVE server with ``keys_dir``, NOTE [transport security]) and
        serve until :meth:`stop`; writes the bound endpoint to ``ready_file`` (atomically)
        once serving, and logs it with ``banner``."""
        sock = server_socket(zmq.Context.instance(), zmq.ROUTER, keys_dir)
        self._handshakes = HandshakeMonitor(sock) if keys_dir is not None else None
        sock.setsockopt(zmq.LINGER, 1000)
        PS.configure(sock, max_array_bytes=largest_frame_bytes(limits))  # NOTE [message size limits]
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.bind(bind)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        print(f"{self.name}: serving on {self.endpoint} ({banner})", file=sys.stderr, flush=True)
        if ready_file:
            tmp = f"{ready_file}.tmp"
            with open(tmp, "w") as f:
                f.write(self.endpoint)
            os.replace(tmp, ready_file)
        try:
            self._run(sock, poll_ms)
        finally:
            if self._handshakes is not None:
                self._handshakes.close()
            sock.close(linger=1000)

    def _run(self, sock: zmq.Socket, poll_ms: int) -> None:
        while not self._stop:
            now = time.monotonic()
            replies = []
            if now >= self._next_tick:
                self._next_tick = now + EXPIRE_EVERY_S
                replies = self.tick(now)
            if sock.poll(0 if replies else poll_ms):
                frames = sock.recv_multipart(copy=False)
                replies += self.receive(frames[0].bytes, frames[1:])
            for peer, reply in replies:
                sock.send_multipart([peer] + reply, copy=False)

"""Liveness of PS shards, checked from a supervisor's wait loop.

NOTE [ps liveness]: a job's PS shards are peers like its workers, so the launcher's
liveness check (the dispatcher calls it about every 0.5 s while it waits) covers them:

- a shard process that ended (``kill -9``, a crash, an exit) is named at the next
  check, with its shard index, address, log file and the end of its log
  (:meth:`herald.ps.LocalShards.failure`);
- a shard that is alive but silent (stopped, hung, swamped) is named once it has left
  a ``ping`` unanswered for ``silent_ms`` (the launcher uses half the job's
  ``--timeout-ms``, so the shard is named before any peer's own timeout blames
  someone else). A ping is answered between two requests; a request that keeps a
  healthy shard busy longer than ``silent_ms`` would be reported too.

Each check is non-blocking: it reads the replies that arrived, judges, and sends a
new ping to every shard with none in flight. The watch owns its sockets (one DEALER
per shard), so it never shares a socket with a :class:`~herald.ps.PSClient`.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Callable, Sequence

import zmq

from herald.auth import load_client_keys, secure_client
from herald.errors import HeraldError, PeerTimeout, ProtocolError
from herald.ps.wire import PS


class ShardWatch:
    """Call it (no arguments) to check the shards; it raises naming the first bad one.

    Args:
        addresses: shard endpoints, index = shard number.
        silent_ms: a ping unanswered this long makes the shard silent (ms, >= 1).
        describe: ``describe(i)``: what to add about shard ``i`` (its log and the log's
            end), e.g. :meth:`herald.ps.LocalShards.describe`.
        dead: ``dead()``: a message naming a shard process that ended, or None
            (e.g. :meth:`herald.ps.LocalShards.failure`); checked before the pings.
        died_at: ``died_at()``: when the shard ``dead()`` names ended (Unix seconds), or None
            (e.g. :meth:`herald.ps.LocalShards.died_at`); default: when the watch saw it.
        keys_dir: CURVE keys folder of shards run with ``--keys`` (NOTE [transport security]).

    Raises (from a call):
        HeraldError: ``dead()`` named a shard. PeerTimeout: a shard is silent
        (``peer`` = its address, ``op`` = ``"ping"``).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        silent_ms: int,
        describe: Callable[[int], str] | None = None,
        dead: Callable[[], str | None] | None = None,
        keys_dir: str | None = None,
        died_at: Callable[[], float | None] | None = None,
    ):
        if silent_ms < 1:
            raise HeraldError(f"silent_ms must be >= 1, got {silent_ms}")
        self.addresses, self.silent_ms = list(addresses), int(silent_ms)
        self._describe, self._dead, self._died_at = describe, dead, died_at
        self._failed_unix_s: float | None = None
        self._keys = load_client_keys(keys_dir) if keys_dir is not None else None
        self._socks: list[zmq.Socket] | None = None
        self._cid = secrets.randbits(63)
        self._rids = itertools.count(1)
        self._inflight: list[tuple[int, float] | None] = [None] * len(self.addresses)
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._closed = False

    def failure(self) -> str | None:
        """The message of the last failure this watch raised, or of a shard process that
        ended now; None when every shard looked healthy."""
        return self._failure or (self._dead() if self._dead is not None else None)

    def failed_at(self) -> float | None:
        """When the shard :meth:`failure` names was lost (Unix seconds): the moment its process
        ended when ``died_at`` knows it, else when this watch first saw the failure; None
        while :meth:`failure` is None."""
        if self.failure() is None:
            return None
        when = self._died_at() if self._died_at is not None else None
        if when is None:
            when = self._failed_unix_s = self._failed_unix_s or time.time()
        return when

    def __call__(self) -> None:
        with self._lock:  # non-blocking work only; the lock only keeps two callers apart
            if self._closed:
                return
            if self._dead is not None:
                dead = self._dead()
                if dead:
                    self._failure, self._failed_unix_s = dead, self._failed_unix_s or time.time()
                    raise HeraldError(dead)
            if self._socks is None:  # made in the calling thread
                self._socks = []
                for address in self.addresses:
                    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    PS.configure(sock, max_array_bytes=0)  # ping replies: a header only (NOTE [message size limits])
                    if self._keys is not None:
                        secure_client(sock, self._keys)
                    sock.connect(address)
                    self._socks.append(sock)
            now = time.monotonic()
            for i, sock in enumerate(self._socks):
                self._drain(i, sock, now)
                inflight = self._inflight[i]
                if inflight is None:
                    rid = next(self._rids)
                    try:
                        sock.send_multipart(PS.pack({"op": "ping", "rid": rid, "cid": self._cid}), flags=zmq.NOBLOCK)
                        self._inflight[i] = (rid, now)
                    except zmq.Again:  # not connected yet: try again at the next check
                        pass
                elif (now - inflight[1]) * 1000 >= self.silent_ms:
                    more = f"; {self._describe(i)}" if self._describe is not None else ""
                    self._failure = (
                        f"PS shard {i} at {self.addresses[i]} answered no ping for "
                        f"{(now - inflight[1]) * 1000:.0f} ms (limit {self.silent_ms} ms): it is "
                        f"alive but silent (stopped, hung or swamped){more}"
                    )
                    self._failed_unix_s = self._failed_unix_s or time.time()
                    raise PeerTimeout(self._failure, peer=self.addresses[i], op="ping")

    def _drain(self, i: int, sock: zmq.Socket, now: float) -> None:
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                rid = PS.unpack_header(frames[0]).get("rid")
            except ProtocolError:
                continue
            inflight = self._inflight[i]
            if inflight is not None and rid == inflight[0]:
                self._inflight[i] = None

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the sockets without lingering (idempotent), waiting at most ``timeout_s`` for a
        check in progress on another thread; past it, only the check's next call sees the watch
        closed (its sockets go with the watch)."""
        got = self._lock.acquire(timeout=max(0.0, timeout_s))
        self._closed = True
        if not got:
            return
        try:
            for sock in self._socks or ():
                sock.close(linger=0)
            self._socks = None
        finally:
            self._lock.release()

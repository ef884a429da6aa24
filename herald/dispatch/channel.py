"""The dispatcher's peer channel: its ROUTER socket and every message to and from its workers.

One responsibility: moving messages (NOTE [dispatch protocol] in
herald/dispatch/dispatcher.py). :class:`PeerChannel` binds the socket (NOTE [transport
security] in herald/auth.py), sends to a rank (naming a worker whose connection is gone),
receives with a deadline through NOTE [peer validation]
(:class:`~herald.dispatch.peers.PeerTable`: identity binding, the rejected-message counts),
bounds what it takes and sends by NOTE [message size limits] (herald/wire.py), waits for the
handshake's hellos and for one op from a set of ranks (``flushed``,
``saved``). It knows no steps: the step ledger (:mod:`herald.dispatch.ledger`) and the
barriers (:mod:`herald.dispatch.barrier`) say what is awaited.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from herald import wire
from herald.auth import check_bind, server_socket
from herald.contracts.microbatch import MAX_WORKER_FRAME_BYTES
from herald.dispatch.config import DispatcherConfig
from herald.dispatch.peers import Message, PeerTable
from herald.errors import ConfigError, HeraldError, PeerTimeout, ProtocolError


class PeerChannel:
    """The ROUTER socket of one dispatcher, bound to ``config.bind``.

    Args:
        config: the dispatcher's settings (``bind``, keys, ``num_workers``, ``peer_timeout_ms``).
        liveness: called about every 0.5 s while waiting on workers; raise from it to abort.
        max_array_bytes: the largest array frame a worker sends
            (:func:`~herald.dispatch.peers.largest_frame_bytes`); a peer sending a larger
            frame is cut off before it is buffered (NOTE [message size limits]).

    Attributes:
        address: the bound endpoint.
        peers: the :class:`~herald.dispatch.peers.PeerTable` (identities, rejected counts,
            the shape of an ack's arrays).
    """

    def __init__(
        self, config: DispatcherConfig, liveness: Callable[[], None] | None = None, *, max_array_bytes: int = 0
    ):
        self.timeout_ms = config.peer_timeout_ms
        #: the handshake's wait: never shorter than the start-up grace (workers import torch first)
        self.startup_ms = max(config.peer_timeout_ms, config.startup_grace_ms)
        self._grace_ms = config.startup_grace_ms
        self._liveness = liveness
        # NOTE [transport security] (herald/auth.py): keys -> CURVE server; else loopback or --insecure
        check_bind(config.bind, config.keys_dir, config.insecure, "dispatcher")
        self._sock = server_socket(zmq.Context.instance(), zmq.ROUTER, config.keys_dir)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        wire.DISPATCH.configure(self._sock, max_array_bytes=max_array_bytes)  # NOTE [message size limits]
        self._sock.bind(config.bind)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peers = PeerTable(config.num_workers, name=f"dispatcher {self.address}")  # NOTE [peer validation]
        self._closed = False

    @property
    def rejected(self) -> dict[str, int]:
        """Messages dropped so far, per kind (NOTE [peer validation]); a copy, thread-safe."""
        return dict(self.peers.rejected)

    def close(self, timeout_s: float = 0.0) -> None:
        """Close the socket; queued messages may still leave for at most ``timeout_s``
        (default 0: LINGER 0, dropped at once). Idempotent."""
        if not self._closed:
            self._closed = True
            self._sock.close(linger=max(0, round(timeout_s * 1000)))

    # ------------------------------------------------------------------ send
    def send(self, rank: int, header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> None:
        """Send one :func:`herald.wire.pack` message to worker ``rank`` (:meth:`route`)."""
        self.route(rank, wire.pack(header, arrays))

    def send_all(self, header: dict[str, Any]) -> None:
        """Send ``header`` (no arrays) to every worker, in rank order."""
        for rank in range(self.peers.num_workers):
            self.send(rank, header)

    def route(self, rank: int, frames: list) -> None:
        """Send ``frames`` to worker ``rank``. Raises HeraldError naming the rank when its
        connection is gone, with the error it sent before leaving when there is one, and
        ConfigError when a frame is larger than a worker takes (NOTE [message size limits]:
        it would be dropped, and the worker would time out not knowing why)."""
        largest = max((f.nbytes if isinstance(f, np.ndarray) else len(f) for f in frames), default=0)
        if largest > MAX_WORKER_FRAME_BYTES:
            raise ConfigError(
                f"a message to worker {rank} holds a frame of {largest} bytes, more than the "
                f"{MAX_WORKER_FRAME_BYTES} a worker accepts (NOTE [message size limits]); lower "
                "--batch-size (or --cache-rows, whose rows a flush lists)"
            )
        try:
            self._sock.send_multipart([self.peers.identities[rank], *frames], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            deadline = time.monotonic() + 1.0  # its last words (an error message) may still be queued
            try:
                while True:
                    self.recv(f"the last message of worker {rank}", deadline)  # raises on `error`
            except PeerTimeout:
                pass
            raise HeraldError(
                f"worker {rank} is gone (its connection to dispatcher {self.address} closed); its log names the cause"
            ) from None

    def tell_error(self, message: str) -> None:
        """Send ``error {message}`` to every worker that said hello, ignoring those gone (so
        none waits out its timeout on a dispatcher that failed)."""
        for rank in self.peers.identities:
            try:
                self.send(rank, {"op": "error", "message": message})
            except (zmq.ZMQError, HeraldError):
                pass

    # --------------------------------------------------------------- receive
    def deadline(self) -> float:
        """``time.monotonic()`` seconds ``peer_timeout_ms`` from now."""
        return time.monotonic() + self.timeout_ms / 1e3

    def recv(
        self,
        waiting_for: str,
        deadline: float | None = None,
        *,
        ranks: Sequence[int] | None = None,
        timeout_ms: int | None = None,
    ) -> Message:
        """The next message that passes NOTE [peer validation] (:meth:`PeerTable.receive`).

        Args:
            waiting_for: what is awaited, in words (the timeout's message names it).
            deadline: ``time.monotonic()`` seconds when to give up (default :meth:`deadline`).
            ranks: the ranks awaited, kept if the wait fails (NOTE [silent workers]); None: unknown.
            timeout_ms: the wait's length as the timeout's message gives it (default ``peer_timeout_ms``).

        Raises:
            PeerTimeout: nothing admitted by the deadline. HeraldError: a worker's ``error``.
        """
        return self.peers.receive(
            self._sock,
            self.deadline() if deadline is None else deadline,
            waiting_for=waiting_for,
            timeout_ms=timeout_ms or self.timeout_ms,
            liveness=self._liveness,
            ranks=ranks,
        )

    def wait_for_hellos(self) -> None:
        """Block until every rank said hello (a valid hello binds its identity: NOTE [peer
        validation]); ProtocolError on any other op, PeerTimeout after :attr:`startup_ms`
        (``max(peer_timeout_ms, startup_grace_ms)``: starting a worker process is no step)."""
        deadline = time.monotonic() + self.startup_ms / 1e3
        while not self.peers.complete:
            msg = self.recv(
                f"hello from workers {self.peers.missing()} (the start-up wait: --timeout-ms, at "
                f"least {self._grace_ms / 1e3:g} s)",
                deadline,
                timeout_ms=self.startup_ms,
            )
            if msg.header["op"] != "hello":
                raise ProtocolError(f"expected hello, got {msg.header['op']!r} from worker {msg.rank}")

    def expect(self, ranks: set[int], op: str) -> None:
        """Block until each of ``ranks`` sent ``op`` (within one ``peer_timeout_ms``);
        ProtocolError on anything else from a worker."""
        done: set[int] = set()
        deadline = self.deadline()
        while done != ranks:
            msg = self.recv(f"{op} from workers {sorted(ranks - done)}", deadline, ranks=sorted(ranks - done))
            if msg.header["op"] != op or msg.rank not in ranks - done:
                raise ProtocolError(
                    f"unexpected {msg.header['op']} from rank {msg.rank}; waiting for {op} from "
                    f"workers {sorted(ranks - done)}"
                )
            done.add(msg.rank)

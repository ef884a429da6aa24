"""The worker's link to its dispatcher: one ZeroMQ DEALER socket and the messages on it.

The worker's side of NOTE [dispatch protocol] (herald/dispatch/dispatcher.py), and
nothing else: :class:`DispatcherLink` connects (identity ``worker-<rank>``, CURVE keys
when given: NOTE [transport security] in herald/auth.py), says hello and receives the
job, receives the dispatcher's messages with a deadline, and sends acks, ``flushed``,
``saved`` and errors. Every wait is bounded by the worker's ``timeout_ms``, and a timeout
names the dispatcher (:class:`~herald.errors.PeerTimeout`); the dispatcher's own
``error`` message is raised as a :class:`~herald.errors.HeraldError` naming it. What the
messages mean to training is :class:`herald.worker.api.ScheduledLoader`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from herald import wire
from herald.auth import load_client_keys, secure_client
from herald.contracts.microbatch import MAX_WORKER_FRAME_BYTES
from herald.contracts.vocab import STARTUP_GRACE_MS
from herald.errors import HeraldError, PeerTimeout, ProtocolError


class DispatcherLink:
    """Worker ``rank``'s DEALER socket, connected to the dispatcher at ``address``.

    Use :meth:`connect`.

    Attributes:
        sock: the ZeroMQ DEALER socket. address: the dispatcher's endpoint (named by
        every timeout). rank: this worker's rank. timeout_ms: longest wait for any
        dispatcher message, and for a send to be taken.
    """

    def __init__(self, sock: zmq.Socket, address: str, rank: int, timeout_ms: int):
        self.sock, self.address, self.rank, self.timeout_ms = sock, address, rank, timeout_ms

    @classmethod
    def connect(cls, address: str, rank: int, timeout_ms: int, keys_dir: str | None = None) -> DispatcherLink:
        """A socket connected to ``address`` (ZeroMQ connects in the background: nothing is
        awaited here).

        Raises:
            ConfigError: ``keys_dir`` holds no usable client keys (before any socket is made).
        """
        keys = load_client_keys(keys_dir) if keys_dir is not None else None  # bad keys: raise before any socket
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"worker-{rank}".encode())
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)  # no connected dispatcher (e.g. it refused our keys): bounded
        wire.DISPATCH.configure(sock, max_array_bytes=MAX_WORKER_FRAME_BYTES)  # NOTE [message size limits]
        if keys is not None:
            secure_client(sock, keys)
        sock.connect(address)
        return cls(sock, address, rank, timeout_ms)

    def handshake(self, world_size: int) -> Any:
        """Say hello as rank :attr:`rank` of ``world_size``; returns the ``job`` of the
        dispatcher's ``config`` answer (unchecked: :meth:`JobSpec.from_dict`'s input).

        The wait for the config lasts the longer of ``timeout_ms`` and
        :data:`~herald.contracts.vocab.STARTUP_GRACE_MS`: the dispatcher sends it once the
        last worker has started and said hello, which no step's timeout bounds.

        Raises:
            PeerTimeout: no config within that wait. ProtocolError: another op came.
        """
        self.send({"op": "hello", "rank": self.rank, "world_size": world_size})
        header, _ = self.receive(
            "config (it comes once every worker said hello)", timeout_ms=max(self.timeout_ms, STARTUP_GRACE_MS)
        )
        if header["op"] != "config":
            raise ProtocolError(f"expected config from the dispatcher, got {header['op']!r}")
        return header.get("job")

    # --------------------------------------------------------------- receive
    def ready(self) -> bool:
        """A message from the dispatcher is already here (no wait)."""
        return bool(self.sock.poll(0))

    def receive(self, what: str, timeout_ms: int | None = None) -> tuple[dict[str, Any], list[np.ndarray]]:
        """The next message (header, arrays), within ``timeout_ms`` (default :attr:`timeout_ms`).

        Args:
            what: what is awaited, in words (``"micro-batch"``): the timeout names it.

        Raises:
            PeerTimeout: nothing arrived in time (names the dispatcher and ``what``).
            HeraldError: the dispatcher's ``error`` message (the job stops).
        """
        timeout_ms = self.timeout_ms if timeout_ms is None else timeout_ms
        if not self.sock.poll(timeout_ms):
            raise PeerTimeout(
                f"dispatcher {self.address} sent no {what} within {timeout_ms} ms; check that the "
                "dispatcher process is alive",
                peer=self.address,
                op=what,
            )
        header, arrays = wire.unpack(self.sock.recv_multipart(copy=False))
        if header["op"] == "error":
            raise HeraldError(f"dispatcher {self.address} reported: {header.get('message')}")
        return header, arrays

    # ------------------------------------------------------------------ send
    def send(self, header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> None:
        """Send one message; waits at most ``timeout_ms`` for the socket to take it.

        Raises:
            PeerTimeout: no dispatcher connected to take it (not running, or it refused
                this worker's keys).
        """
        try:
            self.sock.send_multipart(wire.pack(header, arrays), copy=False)  # waits at most SNDTIMEO = timeout_ms
        except zmq.Again:
            raise PeerTimeout(
                f"dispatcher {self.address} took no message within {self.timeout_ms} ms: no connection "
                "to it (is it running, and does this worker hold its keys, --keys?)",
                peer=self.address,
                op="send",
            ) from None

    def send_ack(
        self,
        step: int,
        loss: float,
        phases_ms: dict[str, float],
        consistency: dict[str, int],
        traffic: dict[str, int],
        arrays: Sequence[np.ndarray],
    ) -> None:
        """``ack {rank, step, loss, phases_ms, consistency, bytes_*}`` with ``arrays``
        (labels and predictions, and whatever the consistency protocol adds)."""
        self.send(
            {
                "op": "ack",
                "rank": self.rank,
                "step": step,
                "loss": loss,
                "phases_ms": phases_ms,
                "consistency": consistency,
                **traffic,
            },
            arrays,
        )

    def send_flushed(self) -> None:
        self.send({"op": "flushed", "rank": self.rank})

    def send_saved(self) -> None:
        self.send({"op": "saved", "rank": self.rank})

    def report_error(self, exc: BaseException) -> None:
        """Tell the dispatcher this worker failed (``error {message}``); never raises."""
        try:
            self.send({"op": "error", "rank": self.rank, "message": f"{type(exc).__name__}: {exc}"})
        except Exception:
            pass

    def report_error_nowait(self, message: str) -> None:
        """``error {message}`` without waiting (a failed :meth:`connect`: there may be no
        dispatcher to take it, and then nobody to tell)."""
        try:
            self.sock.send_multipart(
                wire.pack({"op": "error", "rank": self.rank, "message": message}), flags=zmq.NOBLOCK
            )
        except zmq.ZMQError:
            pass

    def close(self, timeout_s: float = 0.0) -> None:
        """Close the socket; queued messages may still leave for at most ``timeout_s``
        (default 0: dropped at once). Idempotent."""
        self.sock.close(linger=max(0, round(timeout_s * 1000)))

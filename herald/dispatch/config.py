"""The dispatcher's settings (docs/dispatch.md)."""

from __future__ import annotations

import dataclasses

from herald.config import require
from herald.contracts.vocab import DEFAULT_TIMEOUT_MS, STARTUP_GRACE_MS


@dataclasses.dataclass(frozen=True)
class DispatcherConfig:
    """Settings of one dispatcher.

    Args:
        num_workers: workers served (ranks 0..num_workers-1).
        bind: ZeroMQ endpoint to bind; port 0 picks a free port.
        max_inflight_steps: steps sent but not yet acked by every worker (credits).
        peer_timeout_ms: longest wait for any expected worker message, but the hellos.
        startup_grace_ms: the handshake waits ``max(peer_timeout_ms, startup_grace_ms)``
            for the workers' hellos (:data:`~herald.contracts.vocab.STARTUP_GRACE_MS` by default:
            starting a worker process is not bounded by a step's timeout).
        dispatcher_rank: the top 8 bits of every sample id (Persia §4.1), 0-255.
        checkpoint_every_steps: steps between checkpoint barriers (0: only at the end,
            and only if ``on_checkpoint`` is given).
        first_step: number of the first step (a resumed job continues its count).
        ready_steps: built steps (encoded micro-batches) queued ahead of the serving
            thread (NOTE [dispatch pipeline]).
        close_timeout_ms: longest the dispatcher waits for its pipeline threads when
            :meth:`Dispatcher.serve` ends, and for its threads when it closes as a context
            manager (``with``; :meth:`Dispatcher.close` takes its own ``timeout_s``).
        keys_dir: CURVE keys folder (NOTE [transport security] in herald/auth.py): only
            workers holding its client key connect, traffic encrypted. None: plain ZeroMQ,
            allowed on loopback ``bind`` only unless ``insecure``.
        insecure: allow a non-loopback ``bind`` without keys (one warning line).
        batch_size_per_worker: samples per worker per step (``--batch-size``): sizes the
            largest message a worker may send (NOTE [message size limits] in
            herald/wire.py: :func:`herald.dispatch.peers.largest_frame_bytes`). 0: unknown,
            the socket then takes frames of a header's size only (1 MiB; tests' small jobs).
    """

    num_workers: int
    bind: str = "tcp://127.0.0.1:0"
    max_inflight_steps: int = 2
    peer_timeout_ms: int = DEFAULT_TIMEOUT_MS
    startup_grace_ms: int = STARTUP_GRACE_MS
    dispatcher_rank: int = 0
    checkpoint_every_steps: int = 0
    first_step: int = 0
    ready_steps: int = 2
    close_timeout_ms: int = 5_000
    keys_dir: str | None = None
    insecure: bool = False
    batch_size_per_worker: int = 0

    def __post_init__(self) -> None:
        require(
            self.keys_dir is None or (isinstance(self.keys_dir, str) and self.keys_dir != ""),
            f"keys_dir must be a folder path or None, got {self.keys_dir!r}",
        )
        require(isinstance(self.insecure, bool), f"insecure must be True or False, got {self.insecure!r}")
        require(self.num_workers >= 1, f"num_workers must be >= 1, got {self.num_workers}")
        require(self.max_inflight_steps >= 1, "max_inflight_steps must be >= 1")
        require(self.peer_timeout_ms > 0, "peer_timeout_ms must be > 0")
        require(
            type(self.startup_grace_ms) is int and self.startup_grace_ms >= 0,
            f"startup_grace_ms must be an int >= 0, got {self.startup_grace_ms!r}",
        )
        require(0 <= self.dispatcher_rank < 256, "dispatcher_rank must be in [0, 255]")
        require(self.checkpoint_every_steps >= 0, "checkpoint_every_steps must be >= 0")
        require(self.first_step >= 0, "first_step must be >= 0")
        require(self.ready_steps >= 1, "ready_steps must be >= 1")
        require(self.close_timeout_ms >= 0, "close_timeout_ms must be >= 0")
        require(
            type(self.batch_size_per_worker) is int and self.batch_size_per_worker >= 0,
            f"batch_size_per_worker must be an int >= 0, got {self.batch_size_per_worker!r}",
        )

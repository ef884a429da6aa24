"""The dispatcher's settings and what it records per finished step."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from herald.config import require
from herald.contracts.vocab import DEFAULT_TIMEOUT_MS, STARTUP_GRACE_MS
from herald.errors import ConfigError, DataError
from herald.loader.source import state_int


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
        close_timeout_ms: longest :meth:`Dispatcher.close` waits for the pipeline threads.
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


@dataclasses.dataclass
class StepRecord:
    """What the dispatcher learned about one finished step.

    ``labels`` and ``probs`` (float32 [global batch]) are the workers' predictions made
    *before* the step's update: progressive validation.
    """

    step: int
    loss: float
    counts: np.ndarray  # int64 [num_workers, len(CAUSES)] from the scheduler
    bytes_pulled: int
    bytes_pushed: int
    schedule_ms: float
    labels: np.ndarray
    probs: np.ndarray
    bytes_allreduced: int = 0
    #: the workers' phases of this step (:data:`herald.phases.WORKER_PHASES`), ms, mean over workers
    phases_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    #: ``time.perf_counter()`` when the last worker's ack arrived
    acked_at: float = 0.0
    #: messages the dispatcher dropped so far, per kind (NOTE [peer validation] in
    #: :mod:`herald.dispatch.peers`), cumulative; the last record ``serve()`` returns holds the job's totals
    rejected: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the workers' consistency counters of this step, summed (``gap_max``: the largest);
    #: :meth:`herald.worker.protocol.ConsistencyProtocol.take_stats`
    consistency: dict[str, int] = dataclasses.field(default_factory=dict)
    #: PS requests the workers sent during this step, all shards together, summed over the
    #: workers (each ack's ``ps_requests``; 0 where a worker does not count them)
    ps_requests: int = 0
    #: bytes of dense gradients the workers sent in their step messages, summed over the
    #: workers (NOTE [dense gradients on the shards] in herald/ps/stepped.py; as many come back)
    bytes_dense: int = 0

    @classmethod
    def from_acks(
        cls,
        step: int,
        acks: list[tuple[dict[str, Any], list]],
        counts: np.ndarray,
        schedule_ms: float,
        rejected: dict[str, int],
        consistency: dict[str, int] | None = None,
    ) -> StepRecord:
        """The record of ``step`` from its acks (header, arrays), in rank order: loss and phases
        averaged, bytes and PS requests summed, predictions (``[labels, probs]`` arrays)
        concatenated, the consistency counters summed unless given."""
        preds = [a for _, a in acks if len(a) == 2]
        return cls(
            step,
            float(np.mean([h.get("loss", float("nan")) for h, _ in acks])),
            counts,
            sum(int(h.get("bytes_pulled", 0)) for h, _ in acks),
            sum(int(h.get("bytes_pushed", 0)) for h, _ in acks),
            schedule_ms,
            np.concatenate([a[0] for a in preds]) if preds else np.zeros(0, np.float32),
            np.concatenate([a[1] for a in preds]) if preds else np.zeros(0, np.float32),
            sum(int(h.get("bytes_allreduced", 0)) for h, _ in acks),
            mean_phases(acks),
            time.perf_counter(),
            rejected,
            sum_consistency(acks) if consistency is None else consistency,
            sum(int(h.get("ps_requests", 0)) for h, _ in acks),
            sum(int(h.get("bytes_dense", 0)) for h, _ in acks),
        )


def mean_phases(acks: list[tuple[dict[str, Any], list]]) -> dict[str, float]:
    """The workers' ``phases_ms`` of one step, averaged over the workers (ignoring
    malformed entries: they are measurements, not protocol)."""
    total: dict[str, float] = {}
    for header, _ in acks:
        phases = header.get("phases_ms")
        if isinstance(phases, dict):
            for k, v in phases.items():
                if isinstance(k, str) and isinstance(v, (int, float)):
                    total[k] = total.get(k, 0.0) + float(v)
    return {k: v / len(acks) for k, v in total.items()}


def sum_consistency(acks: list[tuple[dict[str, Any], list]]) -> dict[str, int]:
    """The workers' ``consistency`` counters of one step: summed, ``gap_max`` the largest
    (malformed entries ignored: they are measurements, not protocol)."""
    total: dict[str, int] = {}
    for header, _ in acks:
        stats = header.get("consistency")
        if isinstance(stats, dict):
            for k, v in stats.items():
                if isinstance(k, str) and type(v) is int:
                    total[k] = max(total.get(k, 0), v) if k == "gap_max" else total.get(k, 0) + v
    return total


def check_state(state: Any, num_workers: int) -> tuple[int, int, list[int]]:
    """``(next_step, next_batch, checkpoints)`` of a ``Dispatcher.state_dict()``.

    Raises:
        DataError: malformed state. ConfigError: saved with another number of workers.
    """
    if not isinstance(state, dict) or state.get("format") != "dispatcher":
        raise DataError("not a Dispatcher state; pass Dispatcher.state_dict() (a checkpoint's meta.json 'dispatcher')")
    if state.get("num_workers") != num_workers:
        raise ConfigError(
            f"state saved by a dispatcher of {state.get('num_workers')!r} workers, this one serves "
            f"{num_workers}; resume with the same number of workers"
        )
    next_step, next_batch = state_int(state, "next_step"), state_int(state, "next_batch")
    done = state.get("checkpoints")
    if not isinstance(done, list) or not all(isinstance(s, int) and 0 <= s < next_step for s in done):
        raise DataError(f"malformed dispatcher state: 'checkpoints' must list steps < next_step, got {done!r}")
    return next_step, next_batch, list(done)

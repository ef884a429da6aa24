"""What the dispatcher records per finished step, and the check of its saved state."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from herald.errors import ConfigError, DataError
from herald.loader.source import state_int


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

"""The step ledger: the steps in flight, their acks, and the records made of them.

Shared by the dispatcher's two serve loops (the lockstep one of the plan-driven modes,
:mod:`herald.dispatch.lockstep`, and GBA's data list, :class:`herald.dispatch.gba.GbaServe`).
:class:`StepLedger` holds the number of the next step to send, the steps sent and not yet
acked by every rank (the credit window of NOTE [dispatch protocol]: at most
``max_inflight_steps``), their samples (the ID-feature buffer, Persia §4.2.1, and under
``--consistency hybrid`` the dispatcher's embedding worker the acks feed: NOTE [hybrid
training] in herald/dispatch/hybrid.py), the acks received so far, and the
:class:`~herald.dispatch.records.StepRecord` of every step all ranks acked (``on_step``,
the sample-id log). Its messages go through the peer channel (:mod:`herald.dispatch.channel`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np

from herald.contracts.job import JobSpec
from herald.dispatch.channel import PeerChannel
from herald.dispatch.config import DispatcherConfig
from herald.dispatch.embedding_worker import EmbeddingWorker, NullEmbeddingWorker
from herald.dispatch.idbuffer import IdFeatureBuffer
from herald.dispatch.modes import dispatch_mode
from herald.dispatch.peers import Message
from herald.dispatch.records import StepRecord, sum_consistency
from herald.dispatch.steps import ReadyStep
from herald.errors import ProtocolError
from herald.phases import PhaseTimer


class StepLedger:
    """Steps in flight and acked, for one dispatcher (serve thread only).

    Args:
        config: the dispatcher's settings; job: the job served (its consistency mode).
        channel: the :class:`~herald.dispatch.channel.PeerChannel` acks arrive on.
        timer: the serve thread's :class:`~herald.phases.PhaseTimer` (``wait_credit``).
        on_step: called with each :class:`StepRecord` once every worker acked it.
        sample_id_log: a binary file; the uint64 ids of every fully acked step are appended.

    Attributes:
        next_step: the number of the next step to send (the serve loop advances it).
        records: the :class:`StepRecord` of every fully acked step, in step order.
    """

    def __init__(
        self,
        config: DispatcherConfig,
        job: JobSpec,
        channel: PeerChannel,
        timer: PhaseTimer,
        *,
        on_step: Callable[[StepRecord], None] | None = None,
        sample_id_log: BinaryIO | None = None,
    ):
        self._config, self._job, self._channel, self._timer = config, job, channel, timer
        self._workers = config.num_workers
        self._on_step, self._id_log = on_step, sample_id_log
        self.next_step = config.first_step
        self.records: list[StepRecord] = []
        self._acks: dict[int, dict[int, tuple[dict[str, Any], list[np.ndarray]]]] = {}
        self._pending: dict[int, tuple[np.ndarray, float, np.ndarray]] = {}
        self._buffer: IdFeatureBuffer | None = None  # sized on the first step
        # made on the first step: hybrid's (NOTE [hybrid training] in herald/dispatch/hybrid.py), or the null one
        self._embedding: EmbeddingWorker = NullEmbeddingWorker()

    @property
    def in_flight(self) -> int:
        """Steps sent and not yet acked by every worker."""
        return len(self._pending)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the embedding worker (hybrid's push thread), bounded by ``timeout_s``."""
        self._embedding.close(timeout_s)

    # ------------------------------------------------------------- lockstep steps
    def open(self, ready: ReadyStep) -> None:
        """Record ``ready`` as in flight (call right before sending it): its micro-batches
        go to the ID-feature buffer, and the embedding worker (the mode's, made on the first
        step) may wait: hybrid's until the step outside the credit window is applied."""
        step = ready.step
        if self._buffer is None:
            self._buffer = IdFeatureBuffer((self._config.max_inflight_steps + 1) * len(ready.sample_ids))
            self._channel.peers.ack_rows = len(ready.sample_ids) // self._workers
            make = dispatch_mode(self._job.consistency).embedding_worker  # hybrid's, else the null one
            self._embedding = make(self._job, self._config, step, self._channel.peers)
        self._embedding.before_send(step)
        self._buffer.put(step, ready.micro_batches)
        self._pending[step] = (ready.counts, ready.schedule_ms, ready.sample_ids)
        self._acks[step] = {}

    def expecting(self, step: int) -> list[int]:
        """The ranks whose ack of ``step`` (in flight) has not arrived, ascending."""
        return sorted(set(range(self._workers)) - set(self._acks[step]))

    def wait_for_credit(self, drain: bool) -> None:
        """Block until at most ``max_inflight_steps - 1`` steps are unacked (none if ``drain``)."""
        limit = 0 if drain else self._config.max_inflight_steps - 1
        with self._timer("wait_credit"):
            while len(self._pending) > limit:
                self._await_ack()

    def drain(self) -> None:
        """Wait for every ack, then for the embedding worker to apply every update (before a
        checkpoint barrier: the PS then holds every step)."""
        self.wait_for_credit(drain=True)
        self._embedding.drain()

    def _await_ack(self) -> None:
        """Receive one ack (PeerTimeout naming the ranks the oldest step still waits for)."""
        oldest = min(self._pending)
        missing = self.expecting(oldest)
        msg = self.receive_ack(f"ack of step {oldest} from workers {missing}", ranks=missing)
        self.record_ack(msg.header, msg.arrays)

    def record_ack(self, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Take one worker's ack of a step in flight; the last one makes its record.

        Raises:
            ProtocolError: the step is not in flight, or that rank acked it already.
        """
        step, rank = header["step"], header["rank"]  # types and rank checked (NOTE [peer validation])
        if step not in self._pending or rank in self._acks[step]:
            raise ProtocolError(
                f"unexpected ack of step {step!r} from rank {rank!r} (steps in flight: "
                f"{sorted(self._pending)}, ranks 0-{self._workers - 1}, one ack each)"
            )
        # hybrid's takes the gradients by sample id (NOTE [hybrid training])
        arrays = self._embedding.receive(step, rank, arrays, self._buffer, self.next_step - 1)
        self._acks[step][rank] = (header, arrays)
        if len(self._acks[step]) < self._workers:
            return
        by_rank = self._acks.pop(step)
        acks = [by_rank[r] for r in range(self._workers)]
        counts, sched_ms, ids = self._pending.pop(step)
        consistency = sum_consistency(acks)
        consistency.update(self._embedding.step_acked(step, self._buffer))
        self._buffer.release(step)
        self.emit(step, acks, counts, sched_ms, ids, consistency)

    # ----------------------------------------------------------------- shared
    def receive_ack(
        self, waiting_for: str, deadline: float | None = None, *, ranks: list[int] | None = None
    ) -> Message:
        """The next message, which must be an ``ack`` (ProtocolError otherwise; PeerTimeout
        naming ``waiting_for`` after ``peer_timeout_ms``); ``ranks``: those it waits on
        (NOTE [silent workers]), None: not known."""
        msg = self._channel.recv(waiting_for, deadline, ranks=ranks)
        if msg.header["op"] != "ack":
            raise ProtocolError(f"expected ack, got {msg.header['op']!r} from worker {msg.rank}")
        return msg

    def emit(
        self,
        step: int,
        acks: list[tuple[dict[str, Any], list]],
        counts: np.ndarray,
        schedule_ms: float,
        sample_ids: np.ndarray,
        consistency: dict[str, int] | None = None,
    ) -> StepRecord:
        """The :class:`StepRecord` of a fully acked step (acks in rank or slot order):
        appended to :attr:`records`, its sample ids to the id log, then ``on_step``."""
        rec = StepRecord.from_acks(step, acks, counts, schedule_ms, self._channel.rejected, consistency)
        self.records.append(rec)
        if self._id_log is not None:
            self._id_log.write(np.ascontiguousarray(sample_ids, np.uint64).tobytes())
            self._id_log.flush()
        if self._on_step is not None:
            self._on_step(rec)
        return rec

    def end(self) -> list[StepRecord]:
        """Tell every worker ``end {steps}`` and return :attr:`records`, the last one holding
        the job's rejected-message totals (those after the last ack included)."""
        self._channel.send_all({"op": "end", "steps": self.next_step})
        if self.records:
            self.records[-1].rejected = self._channel.rejected
        return self.records

"""The dispatcher: global batches -> scheduler -> one micro-batch per worker per step.

NOTE [dispatch protocol] (ZeroMQ ROUTER at the dispatcher, one DEALER per worker,
identity ``worker-<rank>``; every message is :mod:`herald.wire` framed):

    worker -> dispatcher   hello {rank, world_size}
    dispatcher -> worker   config {job}                     once all ranks said hello
    dispatcher -> worker   microbatch {step, ...}           at most ``max_inflight_steps``
                                                            steps ahead of the slowest ack
    worker -> dispatcher   ack {step, loss, bytes_pulled, bytes_pushed}
    dispatcher -> worker   flush [table, ids]               after the last step: write back
                                                            every only-latest cached row
    worker -> dispatcher   flushed {}
    dispatcher -> worker   end {steps}
    worker -> dispatcher   error {message}                  a worker failed; the job stops

Every rank receives the same number of equal-size micro-batches (the scheduler
allocates exactly ``batch_size_per_worker`` samples to each), so all ranks stop at
the same step and no collective ever waits on a rank that ran out of data.
The scheduler runs one step ahead: the plan of step t needs the allocation of
step t+1 (Herald Alg. 2), so step t is sent once batch t+1 has been scheduled.
A peer that sends nothing for ``peer_timeout_ms`` while the dispatcher waits on
it is reported by rank (:class:`~herald.errors.PeerTimeout`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import zmq

from herald import wire
from herald.config import require
from herald.errors import HeraldError, PeerTimeout, ProtocolError
from herald.loader.batch import SampleBatch
from herald.scheduler.plan import CAUSES, KeySet
from herald.worker.microbatch import MicroBatch, make_sample_ids


@dataclasses.dataclass(frozen=True)
class DispatcherConfig:
    """Settings of one dispatcher.

    Args:
        num_workers: workers served (ranks 0..num_workers-1).
        bind: ZeroMQ endpoint to bind; port 0 picks a free port.
        max_inflight_steps: steps sent but not yet acked by every worker (credits).
        peer_timeout_ms: longest wait for any expected worker message.
        dispatcher_rank: the top 8 bits of every sample id (Persia §4.1), 0-255.
    """

    num_workers: int
    bind: str = "tcp://127.0.0.1:0"
    max_inflight_steps: int = 2
    peer_timeout_ms: int = 120_000
    dispatcher_rank: int = 0

    def __post_init__(self) -> None:
        require(self.num_workers >= 1, f"num_workers must be >= 1, got {self.num_workers}")
        require(self.max_inflight_steps >= 1, "max_inflight_steps must be >= 1")
        require(self.peer_timeout_ms > 0, "peer_timeout_ms must be > 0")
        require(0 <= self.dispatcher_rank < 256, "dispatcher_rank must be in [0, 255]")


class IdFeatureBuffer:
    """ID features of in-flight samples, keyed by sample id (Persia §4.2.1's buffer).

    Holds the micro-batches of steps sent but not yet acked by every worker; bounded
    by ``capacity_samples`` (the credits keep it from filling: a full buffer is a bug
    and raises rather than growing).
    """

    def __init__(self, capacity_samples: int):
        self.capacity_samples = capacity_samples
        self._steps: "collections.OrderedDict[int, list[MicroBatch]]" = collections.OrderedDict()
        self._first_id: dict[int, int] = {}
        self.size_samples = 0

    def put(self, step: int, micro_batches: list[MicroBatch]) -> None:
        n = sum(len(mb) for mb in micro_batches)
        if self.size_samples + n > self.capacity_samples:
            raise ProtocolError(f"ID-feature buffer full ({self.size_samples}+{n} > {self.capacity_samples} samples)")
        self._steps[step] = micro_batches
        self.size_samples += n

    def get(self, sample_id: int) -> tuple[int, dict[int, np.ndarray]]:
        """(rank, {table: ids}) of one in-flight sample.

        Raises:
            KeyError: the sample is not in flight (never sent, or already acked).
        """
        for mbs in self._steps.values():
            for mb in mbs:
                hit = np.flatnonzero(mb.sample_ids == np.uint64(sample_id))
                if hit.size:
                    i = int(hit[0])
                    return mb.rank, {t: mb.values(t)[mb.offsets[t][i]:mb.offsets[t][i + 1]]
                                     for t in range(mb.num_tables)}
        raise KeyError(f"sample id {sample_id} is not in flight")

    def release(self, step: int) -> None:
        mbs = self._steps.pop(step, [])
        self.size_samples -= sum(len(mb) for mb in mbs)


@dataclasses.dataclass
class StepRecord:
    """What the dispatcher learned about one finished step."""

    step: int
    loss: float
    counts: np.ndarray          # int64 [num_workers, len(CAUSES)] from the scheduler
    bytes_pulled: int
    bytes_pushed: int
    schedule_ms: float


class Dispatcher:
    """Serve scheduled micro-batches to ``config.num_workers`` workers.

    Args:
        config: :class:`DispatcherConfig`.
        batches: global batches of exactly ``num_workers * batch_size_per_worker``
            samples (use the loader's batcher with ``drop_last=True``).
        scheduler: a :class:`herald.scheduler.Scheduler` for the same workers.
        job: JSON-serialisable settings sent to every worker in ``config``
            (tables, model, PS addresses, ...).
        on_step: called with each :class:`StepRecord` once every worker acked it.
        liveness: called about every 0.5 s while waiting on workers; raise from it to
            abort (``herald train`` checks that its worker processes are alive).

    Use as a context manager; :attr:`address` is the bound endpoint.
    """

    def __init__(self, config: DispatcherConfig, batches: Iterable[SampleBatch], scheduler: Any,
                 job: dict[str, Any], on_step: Callable[[StepRecord], None] | None = None,
                 liveness: Callable[[], None] | None = None):
        self.config = config
        self._batches = batches
        self._scheduler = scheduler
        self._job = job
        self._on_step = on_step
        self._liveness = liveness
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(config.bind)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._identities: dict[int, bytes] = {}
        self._buffer: IdFeatureBuffer | None = None  # sized on the first global batch
        self._acks: dict[int, dict[int, dict[str, Any]]] = collections.defaultdict(dict)
        self._pending: dict[int, tuple[np.ndarray, float]] = {}
        self.records: list[StepRecord] = []
        self.steps_sent = 0
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Dispatcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket (idempotent, never blocks: LINGER 0)."""
        if not self._closed:
            self._closed = True
            self._sock.close(linger=0)

    # ---------------------------------------------------------------- serve
    def serve(self) -> list[StepRecord]:
        """Run the whole job: handshake, all steps, flush, end. Returns the step records.

        Raises:
            PeerTimeout: a worker sent nothing for ``peer_timeout_ms`` while awaited.
            HeraldError: a worker reported an error (the message names its rank).
        """
        self._handshake()
        for step_plan, batch in self._scheduled():
            self._wait_for_credit(step_plan.step)
            self._send_step(step_plan, batch)
        self._wait_for_credit(self.steps_sent, drain=True)
        self._flush()
        for rank in range(self.config.num_workers):
            self._send(rank, {"op": "end", "steps": self.steps_sent})
        return self.records

    def _scheduled(self) -> Iterator[tuple[Any, SampleBatch]]:
        """(StepPlan of step t, global batch t), one step behind the batches read."""
        held: collections.deque[SampleBatch] = collections.deque()
        for batch in self._batches:
            held.append(batch)
            t0 = time.perf_counter()
            plan = self._scheduler.submit(batch)
            self._last_schedule_ms = (time.perf_counter() - t0) * 1e3
            if plan is not None:
                yield plan, held.popleft()
        t0 = time.perf_counter()
        plan = self._scheduler.finish()
        self._last_schedule_ms = (time.perf_counter() - t0) * 1e3
        if plan is not None:
            yield plan, held.popleft()

    def _handshake(self) -> None:
        deadline = time.monotonic() + self.config.peer_timeout_ms / 1e3
        while len(self._identities) < self.config.num_workers:
            msg = self._recv(deadline, waiting_for="hello from workers "
                             f"{sorted(set(range(self.config.num_workers)) - set(self._identities))}")
            if msg is None:
                continue
            ident, header, _ = msg
            if header["op"] != "hello":
                raise ProtocolError(f"expected hello, got {header['op']!r}")
            rank = header.get("rank")
            if not isinstance(rank, int) or not 0 <= rank < self.config.num_workers or rank in self._identities:
                raise ProtocolError(f"hello from invalid or duplicate rank {rank!r} "
                                    f"(world size {self.config.num_workers})")
            if header.get("world_size") != self.config.num_workers:
                raise ProtocolError(f"worker {rank} expects world size {header.get('world_size')}, "
                                    f"dispatcher serves {self.config.num_workers}")
            self._identities[rank] = ident
        job = dict(self._job, capacity_rows=int(self._scheduler.capacity_rows), num_workers=self.config.num_workers)
        for rank in range(self.config.num_workers):
            self._send(rank, {"op": "config", "job": job})

    def _send_step(self, step_plan: Any, batch: SampleBatch) -> None:
        n_workers = self.config.num_workers
        gb = len(batch)
        ids = make_sample_ids(self.config.dispatcher_rank, step_plan.step * gb, gb)
        mbs = []
        for rank in range(n_workers):
            idx = step_plan.assignment[rank]
            mb = MicroBatch.build(step_plan.step, rank, batch.take(idx), ids[idx], step_plan.plans[rank])
            mbs.append(mb)
        if self._buffer is None:
            self._buffer = IdFeatureBuffer((self.config.max_inflight_steps + 1) * gb)
        self._buffer.put(step_plan.step, mbs)
        self._pending[step_plan.step] = (np.asarray(step_plan.counts), self._last_schedule_ms)
        for mb in mbs:
            header, arrays = mb.to_frames()
            self._send(mb.rank, header, arrays)
        self.steps_sent = step_plan.step + 1

    def _wait_for_credit(self, next_step: int, drain: bool = False) -> None:
        """Block until at most ``max_inflight_steps - 1`` steps are unacked (0 if ``drain``)."""
        limit = 0 if drain else self.config.max_inflight_steps - 1
        while len(self._pending) > limit:
            oldest = min(self._pending)
            missing = sorted(set(range(self.config.num_workers)) - set(self._acks[oldest]))
            deadline = time.monotonic() + self.config.peer_timeout_ms / 1e3
            msg = self._recv(deadline, waiting_for=f"ack of step {oldest} from workers {missing}")
            if msg is None:
                continue
            _, header, _ = msg
            if header["op"] != "ack":
                raise ProtocolError(f"expected ack, got {header['op']!r}")
            self._record_ack(header)

    def _record_ack(self, header: dict[str, Any]) -> None:
        step, rank = header.get("step"), header.get("rank")
        if step not in self._pending or not isinstance(rank, int) or rank in self._acks[step]:
            raise ProtocolError(f"unexpected ack of step {step!r} from rank {rank!r}")
        self._acks[step][rank] = header
        if len(self._acks[step]) == self.config.num_workers:
            acks = self._acks.pop(step)
            counts, sched_ms = self._pending.pop(step)
            self._buffer.release(step)
            rec = StepRecord(step, float(np.mean([a.get("loss", float("nan")) for a in acks.values()])), counts,
                             sum(int(a.get("bytes_pulled", 0)) for a in acks.values()),
                             sum(int(a.get("bytes_pushed", 0)) for a in acks.values()), sched_ms)
            self.records.append(rec)
            if self._on_step is not None:
                self._on_step(rec)

    def _flush(self) -> None:
        keysets: list[KeySet] = self._scheduler.flush()
        for rank, ks in enumerate(keysets):
            self._send(rank, {"op": "flush"}, [ks.table, ks.ids])
        done: set[int] = set()
        deadline = time.monotonic() + self.config.peer_timeout_ms / 1e3
        while len(done) < self.config.num_workers:
            msg = self._recv(deadline, waiting_for=f"flushed from workers {sorted(set(range(self.config.num_workers)) - done)}")
            if msg is None:
                continue
            _, header, _ = msg
            if header["op"] != "flushed":
                raise ProtocolError(f"expected flushed, got {header['op']!r}")
            done.add(int(header["rank"]))

    # --------------------------------------------------------------- socket
    def _send(self, rank: int, header: dict[str, Any], arrays: list[np.ndarray] = ()) -> None:
        self._sock.send_multipart([self._identities[rank], *wire.pack(header, arrays)], copy=False)

    def _recv(self, deadline: float, *, waiting_for: str):
        """One message, or raise PeerTimeout at ``deadline``; worker errors are raised."""
        while True:
            timeout_ms = max(0, int((deadline - time.monotonic()) * 1e3))
            if self._sock.poll(min(timeout_ms, 500)):
                break
            if self._liveness is not None:
                self._liveness()
            if timeout_ms > 500:
                continue
            raise PeerTimeout(f"dispatcher {self.address}: no message within "
                              f"{self.config.peer_timeout_ms} ms while waiting for {waiting_for}; "
                              "check that those worker processes are alive (their log names the cause)",
                              peer=waiting_for, op="recv")
        frames = self._sock.recv_multipart(copy=False)
        ident, payload = frames[0].bytes, frames[1:]
        header, arrays = wire.unpack(payload)
        if header["op"] == "error":
            raise HeraldError(f"worker {header.get('rank')} failed: {header.get('message')}")
        return ident, header, arrays


def counts_table(records: list[StepRecord]) -> dict[str, int]:
    """Total transmissions by cause over ``records`` (all workers)."""
    if not records:
        return {c: 0 for c in CAUSES}
    total = np.sum([r.counts.sum(axis=0) for r in records], axis=0)
    return {c: int(v) for c, v in zip(CAUSES, total)}

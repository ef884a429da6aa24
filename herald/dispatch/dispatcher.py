"""The dispatcher: global batches -> scheduler -> one micro-batch per worker per step.

NOTE [dispatch protocol] (ZeroMQ ROUTER at the dispatcher, one DEALER per worker,
identity ``worker-<rank>``; every message is :mod:`herald.wire` framed; every message received
passes NOTE [peer validation] in :mod:`herald.dispatch.peers`, which binds identities to ranks):

    worker -> dispatcher   hello {rank, world_size}
    dispatcher -> worker   config {job}                     once all ranks said hello
    dispatcher -> worker   microbatch {step, ...} [blob]    at most ``max_inflight_steps``
                                                            steps ahead of the slowest ack
                                                            (NOTE [micro-batch layout])
    worker -> dispatcher   ack {step, loss, bytes_*} [labels, probs]
    dispatcher -> worker   flush {reset} [table, ids]       write back every only-latest
                                                            cached row (then, with reset,
                                                            empty the cache)
    worker -> dispatcher   flushed {}
    dispatcher -> worker   save {path}                      rank 0 writes dense state
    worker -> dispatcher   saved {}
    dispatcher -> worker   end {steps}
    worker -> dispatcher   error {message}                  a worker failed; the job stops

Every rank receives the same number of equal-size micro-batches (the scheduler
allocates exactly ``batch_size_per_worker`` samples to each), so all ranks stop at
the same step and no collective ever waits on a rank that ran out of data.
The scheduler runs one step ahead: the plan of step t needs the allocation of
step t+1 (Herald Alg. 2), so step t is sent once batch t+1 has been scheduled.
Reading and scheduling, and building the micro-batches, run on two background
threads ahead of the thread that serves (NOTE [dispatch pipeline] in
:mod:`herald.dispatch.pipeline`).

NOTE [checkpoint barrier]: every ``checkpoint_every_steps`` steps (and at the end)
the dispatcher stops reading (its plan thread waits at the barrier until it is
complete: NOTE [dispatch pipeline]), finishes the scheduler's last step (no plan pushes),
waits for every ack, has the workers write back every only-latest row and empty
their caches, has rank 0 save the dense state, then calls ``on_checkpoint`` (which
checkpoints the PS and commits the source position). The PS then holds the whole
model as of that step. Training goes on with a fresh scheduler and empty caches,
exactly as a job restarted from that checkpoint would. ``on_checkpoint`` also gets
:meth:`Dispatcher.state_dict` (next step, next batch index, checkpoints, and the
global-batch producer's position after the barrier's batch), the one moment that
state is complete: a dispatcher given it by ``load_state_dict`` before ``serve``, with
the PS rows and dense state of the same checkpoint, continues the job exactly.
A barrier is never repeated for the same step (a periodic barrier on the last batch
is also the final one).
A peer that sends nothing for ``peer_timeout_ms`` while the dispatcher waits on
it is reported by rank (:class:`~herald.errors.PeerTimeout`).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, BinaryIO, Callable, Iterable, Iterator

import numpy as np
import zmq

from herald import wire
from herald.auth import check_bind, server_socket
from herald.errors import ConfigError, HeraldError, PeerTimeout, ProtocolError
from herald.spec.job import JobSpec
from herald.spec.modes import consistency_mode
from herald.phases import PhaseTimer
from herald.loader.batch import SampleBatch
from herald.dispatch.early import TouchedKeys
from herald.dispatch.idbuffer import IdFeatureBuffer
from herald.dispatch.peers import Message, PeerTable
from herald.dispatch.pipeline import Pipeline
from herald.dispatch.records import DispatcherConfig, StepRecord, check_state, sum_consistency
from herald.dispatch.steps import ReadyStep, build_ready_step, scheduled_view

__all__ = ["Dispatcher", "DispatcherConfig", "StepRecord"]


class Dispatcher:
    """Serve scheduled micro-batches to ``config.num_workers`` workers.

    Args:
        config: :class:`DispatcherConfig`.
        batches: global batches of exactly ``num_workers * batch_size_per_worker``
            samples, normally a :class:`~herald.loader.global_batches.GlobalBatches`.
            If it has ``sample_ids(i)`` returning an array (Kafka), those are the sample
            ids of batch ``i``; else ids are ``rank << 56 | sequence number``. With
            ``state_dict``/``load_state_dict`` its position is part of this dispatcher's.
        scheduler_factory: returns a fresh :class:`herald.scheduler.Scheduler` (called at
            the start and after every checkpoint barrier).
        job: the :class:`~herald.spec.job.JobSpec` sent to every worker in ``config``
            (with the scheduler's ``capacity_rows`` and ``num_workers`` filled in).
        on_step: called with each :class:`StepRecord` once every worker acked it.
        on_checkpoint: ``on_checkpoint(step, batch_index, save_path, state)`` at each
            barrier, after the workers flushed and saved (NOTE [checkpoint barrier]);
            ``save_path`` is where rank 0 wrote the dense state, ``state`` is
            :meth:`state_dict` (JSON-able).
        checkpoint_path: ``checkpoint_path(step) -> str``, the folder the workers save to.
        liveness: called about every 0.5 s while waiting on workers; raise from it to abort.
        sample_id_log: a binary file; the uint64 ids of every fully acked step are appended.

    Use as a context manager; :attr:`address` is the bound endpoint; :meth:`stop`
    (thread-safe) ends the job cleanly after the steps already read. Reading and
    scheduling, and building the micro-batches, run on two threads of their own
    (NOTE [dispatch pipeline]); :attr:`timer` gathers every thread's stages once
    :meth:`serve` returns.
    """

    def __init__(self, config: DispatcherConfig, batches: Iterable[SampleBatch], scheduler_factory: Callable[[], Any],
                 job: JobSpec, *, on_step: Callable[[StepRecord], None] | None = None,
                 on_checkpoint: Callable[[int, int, str, dict], None] | None = None,
                 checkpoint_path: Callable[[int], str] | None = None,
                 liveness: Callable[[], None] | None = None, sample_id_log: BinaryIO | None = None):
        self.config = config
        self._batches = batches
        self._factory = scheduler_factory
        self.scheduler = scheduler_factory()
        self._job = job
        self._replicated = job.replicated_tables
        self._on_step, self._on_checkpoint, self._checkpoint_path = on_step, on_checkpoint, checkpoint_path
        self._liveness, self._id_log = liveness, sample_id_log
        self._ctx = zmq.Context.instance()
        # NOTE [transport security] (herald/auth.py): keys -> CURVE server; else loopback or --insecure
        check_bind(config.bind, config.keys_dir, config.insecure, "dispatcher")
        self._sock = server_socket(self._ctx, zmq.ROUTER, config.keys_dir)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(config.bind)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers = PeerTable(config.num_workers, name=f"dispatcher {self.address}")  # NOTE [peer validation]
        self._buffer: IdFeatureBuffer | None = None  # sized on the first global batch
        self._hybrid = None   # --consistency hybrid: NOTE [hybrid training] (herald/dispatch/hybrid.py)
        self._acks: dict[int, dict[int, tuple[dict[str, Any], list[np.ndarray]]]] = {}
        self._pending: dict[int, tuple[np.ndarray, float, np.ndarray]] = {}
        self._stop = threading.Event()
        self.records: list[StepRecord] = []
        self.next_step = config.first_step
        self._first_step = config.first_step    # first step of this process (resumed: the state's)
        self._next_batch = 0                    # index of the next global batch to read
        self._at_barrier = True                 # nothing held or in flight (state_dict is valid)
        self._serving = False
        self.checkpoints: list[int] = []
        #: seconds per stage (:data:`herald.phases.DISPATCHER_PHASES`) over the whole job; the
        #: pipeline threads' stages are added when :meth:`serve` ends (live: :meth:`stage_seconds`)
        self.timer = PhaseTimer()
        self._plan_timer, self._build_timer = PhaseTimer(), PhaseTimer()   # one per pipeline thread
        self._pipeline: Pipeline | None = None
        self._plan_step = config.first_step      # plan thread: number of the next step planned
        self._touched: TouchedKeys | None = None  # build thread, NOTE [early pulls]: keys the last step changes
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Dispatcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the pipeline threads (joined for at most ``close_timeout_ms``) and close
        the socket (LINGER 0); idempotent, bounded."""
        self._close_pipeline()
        if self._hybrid is not None:
            self._hybrid.close()
        if not self._closed:
            self._closed = True
            self._sock.close(linger=0)

    def stop(self) -> None:
        """Stop reading new batches; the job ends at the next step boundary (thread-safe).

        The steps already read and scheduled (at most the pipeline's depth, NOTE
        [dispatch pipeline]) are still trained, then the final barrier runs."""
        self._stop.set()

    def stage_seconds(self) -> dict[str, float]:
        """Seconds per stage so far, every thread's stages together (thread-safe reads of
        counters the pipeline threads add to)."""
        out: dict[str, float] = {}
        for timer in (self.timer, self._plan_timer, self._build_timer):
            for _ in range(3):   # a thread may add a new stage name while we copy
                try:
                    items = list(timer.seconds.items())
                    break
                except RuntimeError:
                    continue
            else:
                items = []
            for k, v in items:
                out[k] = out.get(k, 0.0) + v
        return out

    @property
    def rejected(self) -> dict[str, int]:
        """Messages dropped so far, per kind (NOTE [peer validation]); a copy, thread-safe."""
        return dict(self._peers.rejected)

    def _close_pipeline(self) -> None:
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is None:
            return
        pipeline.close(self.config.close_timeout_ms / 1e3)
        for timer in (self._plan_timer, self._build_timer):
            for k, v in timer.take().items():
                self.timer.add(k, v / 1e3)

    # ---------------------------------------------------------------- serve
    def serve(self) -> list[StepRecord]:
        """Run the whole job: handshake, all steps (with barriers), final flush, end.

        Raises:
            PeerTimeout: a worker sent nothing for ``peer_timeout_ms`` while awaited.
            HeraldError: a worker reported an error (the message names its rank).
            ProtocolError: a worker's well-formed message out of turn (a second ack, ...).
            Malformed or foreign messages raise nothing: they are dropped and counted
            (NOTE [peer validation], :attr:`rejected`).
            Any exception of the pipeline threads (reading, scheduling, building),
                re-raised here with its traceback.
        """
        self._serving = True
        self._handshake()
        try:
            # the mode's serve strategy (herald.spec.modes): serve_steps, or gba's (NOTE [gba tokens])
            return consistency_mode(self._job.consistency).resolve("serve")(self)
        except BaseException as exc:
            # tell every worker, so none waits out its timeout on a dead dispatcher
            for rank in self._peers.identities:
                try:
                    self._send(rank, {"op": "error", "message": f"{type(exc).__name__}: {exc}"})
                except (zmq.ZMQError, HeraldError):
                    pass
            raise
        finally:
            self._close_pipeline()

    def _serve_steps(self) -> list[StepRecord]:
        last = None
        self._plan_step = self.next_step
        self._pipeline = pipeline = Pipeline(self._plans, self._build_step, depth_plans=1,
                                             depth_ready=self.config.ready_steps)
        pipeline.start()
        while True:
            with self.timer("wait_build"):
                item = pipeline.get(on_idle=self._liveness)
            if item[0] == "end":
                break
            if item[0] == "step":
                self._wait_for_credit(drain=False)
                self._send_ready(item[1])
            else:
                _, last, index, final = item
                self._barrier(last, index, final=final)
                pipeline.resume()
        if last is None:  # no batch at all
            self._wait_for_credit(drain=True)
        for rank in range(self.config.num_workers):
            self._send(rank, {"op": "end", "steps": self.next_step})
        if self.records:   # the job's totals (messages rejected after the last ack included)
            self.records[-1].rejected = self.rejected
        return self.records

    # ------------------------------------------------ plan thread (NOTE [dispatch pipeline])
    def _plans(self, pipeline: Pipeline) -> Iterator[tuple]:
        """("plan", step, StepPlan, batch, batch index, sample ids or None, schedule ms)
        items, one step behind the batches read, and ("barrier", last step, its batch
        index, final) items, after each of which it waits for the barrier to complete."""
        held: list[tuple[SampleBatch, int, Any]] = []
        every = self.config.checkpoint_every_steps
        index = barrier_at = self._next_batch - 1
        batches = iter(self._batches)
        ids_of = getattr(self._batches, "sample_ids", None)
        timer = self._plan_timer
        for index in itertools.count(self._next_batch):
            with timer("read"):
                batch = next(batches, None)
            if batch is None:
                break
            self._next_batch, self._at_barrier = index + 1, False
            held.append((batch, index, ids_of(index) if ids_of is not None else None))
            t0 = time.perf_counter()
            plan = self.scheduler.submit(scheduled_view(batch, self._replicated))
            schedule_s = time.perf_counter() - t0
            timer.add("schedule", schedule_s)
            if plan is not None:
                yield self._plan_item(plan, held.pop(0), schedule_s)
            due = every and (index + 1) % every == 0
            if due or self._stop.is_set():
                yield from self._finish_scheduler(held)
                final = self._stop.is_set()
                yield ("barrier", self._plan_step - 1, index, final)
                barrier_at = index
                if final:
                    return
                pipeline.wait_resume()
                if self._stop.is_set():   # stopped during the barrier: it was the last one
                    return
                self.scheduler = self._factory()
        index = self._next_batch - 1
        if held:
            yield from self._finish_scheduler(held)
        if index > barrier_at:   # batches since the last barrier (else that barrier was the final one)
            yield ("barrier", self._plan_step - 1, index, True)

    def _plan_item(self, plan: Any, held: tuple, schedule_s: float) -> tuple:
        step, self._plan_step = self._plan_step, self._plan_step + 1
        return ("plan", step, plan, *held, schedule_s * 1e3)

    def _finish_scheduler(self, held: list) -> Iterator[tuple]:
        t0 = time.perf_counter()
        plan = self.scheduler.finish()
        schedule_s = time.perf_counter() - t0
        self._plan_timer.add("schedule", schedule_s)
        if plan is not None:
            yield self._plan_item(plan, held.pop(0), schedule_s)

    # ----------------------------------------------- build thread (NOTE [dispatch pipeline])
    def _build_step(self, item: tuple) -> tuple:
        """A "plan" item -> ("step", :class:`ReadyStep`); other items pass through."""
        if item[0] != "plan":
            return item
        _, step, step_plan, batch, index, ids, schedule_ms = item
        with self._build_timer("build"):
            ready, self._touched = build_ready_step(step, step_plan, batch, index, ids, schedule_ms,
                                                    dispatcher_rank=self.config.dispatcher_rank,
                                                    replicated=self._replicated, touched_before=self._touched)
        return ("step", ready)

    # -------------------------------------------------------------- serve thread
    def _handshake(self) -> None:
        deadline = time.monotonic() + self.config.peer_timeout_ms / 1e3
        while not self._peers.complete:   # a valid hello binds its identity (NOTE [peer validation])
            msg = self._recv(deadline, waiting_for=f"hello from workers {self._peers.missing()}")
            if msg.header["op"] != "hello":
                raise ProtocolError(f"expected hello, got {msg.header['op']!r} from worker {msg.rank}")
        job = self._job.replace(capacity_rows=int(self.scheduler.capacity_rows), num_workers=self.config.num_workers)
        for rank in range(self.config.num_workers):
            self._send(rank, {"op": "config", "job": job.to_dict()})

    def _send_ready(self, ready: ReadyStep) -> None:
        step = ready.step
        if step != self.next_step:
            raise HeraldError(f"the pipeline built step {step} where step {self.next_step} was due; this is a bug "
                              "(NOTE [dispatch pipeline])")
        if self._buffer is None:
            self._buffer = IdFeatureBuffer((self.config.max_inflight_steps + 1) * len(ready.sample_ids))
            self._peers.ack_rows = len(ready.sample_ids) // self.config.num_workers
            make = consistency_mode(self._job.consistency).resolve("embedding_worker")   # hybrid's, else None
            self._hybrid = make(self._job, self.config, step, self._peers) if make is not None else None
        if self._hybrid is not None:
            self._hybrid.before_send(step)
        self._buffer.put(step, ready.micro_batches)
        self._pending[step] = (ready.counts, ready.schedule_ms, ready.sample_ids)
        self._acks[step] = {}
        with self.timer("send"):
            for rank, frames in enumerate(ready.frames):
                self._route(rank, frames)
        self.next_step = step + 1

    def _wait_for_credit(self, drain: bool) -> None:
        """Block until at most ``max_inflight_steps - 1`` steps are unacked (none if ``drain``)."""
        limit = 0 if drain else self.config.max_inflight_steps - 1
        with self.timer("wait_credit"):
            while len(self._pending) > limit:
                self._await_ack()

    def _await_ack(self) -> None:
        """Receive one ack (PeerTimeout naming the ranks the oldest step still waits for)."""
        oldest = min(self._pending)
        missing = sorted(set(range(self.config.num_workers)) - set(self._acks[oldest]))
        deadline = time.monotonic() + self.config.peer_timeout_ms / 1e3
        msg = self._recv(deadline, waiting_for=f"ack of step {oldest} from workers {missing}")
        if msg.header["op"] != "ack":
            raise ProtocolError(f"expected ack, got {msg.header['op']!r} from worker {msg.rank}")
        self._record_ack(msg.header, msg.arrays)

    def _record_ack(self, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        step, rank = header["step"], header["rank"]   # types and rank checked (NOTE [peer validation])
        if step not in self._pending or rank in self._acks[step]:
            raise ProtocolError(f"unexpected ack of step {step!r} from rank {rank!r} (steps in flight: "
                                f"{sorted(self._pending)}, ranks 0-{self.config.num_workers - 1}, one ack each)")
        if self._hybrid is not None:   # gradients by sample id (NOTE [hybrid training])
            arrays = self._hybrid.receive(step, rank, arrays, self._buffer, self.next_step - 1)
        self._acks[step][rank] = (header, arrays)
        if len(self._acks[step]) < self.config.num_workers:
            return
        by_rank = self._acks.pop(step)
        acks = [by_rank[r] for r in range(self.config.num_workers)]
        counts, sched_ms, ids = self._pending.pop(step)
        consistency = sum_consistency(acks)
        if self._hybrid is not None:
            consistency.update(self._hybrid.step_acked(step, self._buffer))
        self._buffer.release(step)
        rec = StepRecord.from_acks(step, acks, counts, sched_ms, self.rejected, consistency)
        self.records.append(rec)
        if self._id_log is not None:
            self._id_log.write(np.ascontiguousarray(ids, np.uint64).tobytes())
            self._id_log.flush()
        if self._on_step is not None:
            self._on_step(rec)

    def _barrier(self, step: int, batch_index: int, final: bool) -> None:
        """NOTE [checkpoint barrier]."""
        self._wait_for_credit(drain=True)
        if self._hybrid is not None:   # every embedding update applied before the PS checkpoint
            self._hybrid.drain()
        self._flush(reset=not final)
        self._at_barrier = True
        if self._on_checkpoint is None or step < self._first_step:
            return
        self._save_checkpoint(step, batch_index)

    def _save_checkpoint(self, step: int, batch_index: int) -> None:
        """At a complete barrier: rank 0 saves the dense state, then ``on_checkpoint``
        (NOTE [checkpoint barrier]; the GBA dispatcher's barrier too, NOTE [gba checkpoints])."""
        path = self._checkpoint_path(step) if self._checkpoint_path else ""
        if path:
            self._send(0, {"op": "save", "path": path})
            self._expect({0}, "saved")
        self.checkpoints.append(step)
        self._on_checkpoint(step, batch_index, path, self.state_dict())

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The job's position at a checkpoint barrier (or before :meth:`serve`, or after it).

        ``{"format": "dispatcher", "num_workers", "next_step", "next_batch" (index of
        the next global batch), "checkpoints" (steps checkpointed), "batches" (the
        producer's ``state_dict()``, or None when it has none)}``; JSON-able.

        Raises:
            HeraldError: called between barriers, where batches sit in the scheduler and
                steps are in flight (NOTE [checkpoint barrier]: take it in ``on_checkpoint``).
        """
        if not self._at_barrier or self._pending:
            raise HeraldError("Dispatcher.state_dict() is complete only at a checkpoint barrier (NOTE [checkpoint "
                              "barrier]): between barriers the scheduler holds batches and steps are in flight; "
                              "take the state given to on_checkpoint")
        get = getattr(self._batches, "state_dict", None)
        return {"format": "dispatcher", "num_workers": self.config.num_workers, "next_step": self.next_step,
                "next_batch": self._next_batch, "checkpoints": list(self.checkpoints),
                "batches": get() if get is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict` taken at a barrier); call before
        :meth:`serve`, with the PS rows and dense state of the same checkpoint restored.

        Raises:
            DataError: malformed state. ConfigError: saved with another number of workers,
                or it holds a producer position and ``batches`` cannot load one.
            HeraldError: called after :meth:`serve` started.
        """
        if self._serving:
            raise HeraldError("Dispatcher.load_state_dict() must come before serve(); make a new Dispatcher")
        next_step, next_batch, done = check_state(state, self.config.num_workers)
        if state.get("batches") is not None:
            load = getattr(self._batches, "load_state_dict", None)
            if load is None:
                raise ConfigError("the state holds a global-batch position but these batches cannot load one; "
                                  "pass a herald.loader.global_batches.GlobalBatches")
            load(state["batches"])
        self.next_step = self._first_step = next_step
        self._next_batch = next_batch
        self.checkpoints = list(done)

    def _flush(self, reset: bool) -> None:
        for rank, ks in enumerate(self.scheduler.flush()):
            self._send(rank, {"op": "flush", "reset": reset}, [ks.table, ks.ids])
        self._expect(set(range(self.config.num_workers)), "flushed")

    def _expect(self, ranks: set[int], op: str) -> None:
        done: set[int] = set()
        deadline = time.monotonic() + self.config.peer_timeout_ms / 1e3
        while done != ranks:
            msg = self._recv(deadline, waiting_for=f"{op} from workers {sorted(ranks - done)}")
            if msg.header["op"] != op or msg.rank not in ranks - done:
                raise ProtocolError(f"unexpected {msg.header['op']} from rank {msg.rank}; waiting for {op} from "
                                    f"workers {sorted(ranks - done)}")
            done.add(msg.rank)

    # --------------------------------------------------------------- socket
    def _send(self, rank: int, header: dict[str, Any], arrays: list[np.ndarray] = ()) -> None:
        self._route(rank, wire.pack(header, arrays))

    def _route(self, rank: int, frames: list) -> None:
        """Send ``frames`` to worker ``rank``. Raises HeraldError naming the rank when its
        connection is gone, with the error it sent before leaving when there is one."""
        try:
            self._sock.send_multipart([self._peers.identities[rank], *frames], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            deadline = time.monotonic() + 1.0   # its last words (an error message) may still be queued
            try:
                while True:
                    self._recv(deadline, waiting_for=f"the last message of worker {rank}")  # raises on `error`
            except PeerTimeout:
                pass
            raise HeraldError(f"worker {rank} is gone (its connection to dispatcher {self.address} closed); "
                              "its log names the cause") from None

    def _recv(self, deadline: float, *, waiting_for: str) -> Message:
        """The next message that passes NOTE [peer validation] (:meth:`PeerTable.receive`)."""
        return self._peers.receive(self._sock, deadline, waiting_for=waiting_for,
                                   timeout_ms=self.config.peer_timeout_ms, liveness=self._liveness)


def serve_steps(disp: Dispatcher) -> list[StepRecord]:
    """The serve strategy of the plan-driven modes (bsp, bounded, hybrid; their entries in
    :data:`herald.spec.modes.MODES`): global steps handed out within the credit window, with
    checkpoint barriers and the final flush (:meth:`Dispatcher.serve`)."""
    return disp._serve_steps()

"""The dispatcher: global batches -> scheduler -> one micro-batch per worker per step.

NOTE [dispatch protocol] (ZeroMQ ROUTER at the dispatcher, one DEALER per worker,
identity ``worker-<rank>``; every message is :mod:`herald.wire` framed; every message received
passes NOTE [peer validation] in :mod:`herald.dispatch.peers`, which binds identities to ranks):

    worker -> dispatcher   hello {rank, world_size}
    dispatcher -> worker   config {job}                     once all ranks said hello
    dispatcher -> worker   microbatch {step, ...} [blob]    at most ``max_inflight_steps``
                                                            steps ahead of the slowest ack
                                                            (NOTE [micro-batch layout])
    worker -> dispatcher   ack {step, loss, bytes_*, ps_requests} [labels, probs]
    dispatcher -> worker   flush {reset} [table, ids]       write back every only-latest
                                                            cached row (then, with reset,
                                                            empty the cache)
    worker -> dispatcher   flushed {}
    dispatcher -> worker   save {path, caches}              rank 0 writes dense state; with
                                                            caches (to every rank: a final
                                                            barrier off the grid) each its
                                                            cache (NOTE [warm resume])
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
is also the final one). A final barrier off that grid (a stop between two periodic
barriers) is one the uninterrupted run does not have: it keeps the caches and also saves
the scheduler's warm state and every worker's cache (NOTE [warm resume] in
:mod:`herald.dispatch.warm`).
A peer that sends nothing for ``peer_timeout_ms`` while the dispatcher waits on
it is reported by rank (:class:`~herald.errors.PeerTimeout`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

from herald.contracts.job import JobSpec
from herald.dispatch.barrier import Barriers
from herald.dispatch.channel import PeerChannel
from herald.dispatch.config import DispatcherConfig
from herald.dispatch.ledger import StepLedger
from herald.dispatch.lockstep import LockstepServe
from herald.dispatch.modes import dispatch_mode
from herald.dispatch.peers import Silence, largest_frame_bytes
from herald.dispatch.records import StepRecord
from herald.dispatch.warm import WarmLoad
from herald.errors import HeraldError
from herald.loader.batch import SampleBatch
from herald.phases import PhaseTimer

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
        job: the :class:`~herald.contracts.job.JobSpec` sent to every worker in ``config``
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

    The work is split by responsibility into parts (attributes), which the serve
    strategies (:func:`herald.dispatch.modes.serve_steps`, :func:`herald.dispatch.gba.serve_gba`) use:
    :attr:`channel` (:class:`~herald.dispatch.channel.PeerChannel`: the socket, peer
    validation), :attr:`ledger` (:class:`~herald.dispatch.ledger.StepLedger`: steps in
    flight, acks, records), :attr:`barriers` (:class:`~herald.dispatch.barrier.Barriers`:
    checkpoint barriers, the saved position) and :attr:`lockstep`
    (:class:`~herald.dispatch.lockstep.LockstepServe`: the scheduler and the pipeline).
    """

    def __init__(
        self,
        config: DispatcherConfig,
        batches: Iterable[SampleBatch],
        scheduler_factory: Callable[[], Any],
        job: JobSpec,
        *,
        on_step: Callable[[StepRecord], None] | None = None,
        on_checkpoint: Callable[[int, int, str, dict], None] | None = None,
        checkpoint_path: Callable[[int], str] | None = None,
        liveness: Callable[[], None] | None = None,
        sample_id_log: BinaryIO | None = None,
    ):
        self.config = config
        self._job = job
        scheduler = scheduler_factory()
        self.channel = PeerChannel(
            config,
            liveness,
            max_array_bytes=largest_frame_bytes(  # NOTE [message size limits]
                job, config.num_workers, config.batch_size_per_worker
            ),
        )
        self.address = self.channel.address
        #: seconds per stage (:data:`herald.phases.DISPATCHER_PHASES`) over the whole job; the
        #: pipeline threads' stages are added when :meth:`serve` ends (live: :meth:`stage_seconds`)
        self.timer = PhaseTimer()
        self._stop = threading.Event()
        self.ledger = StepLedger(config, job, self.channel, self.timer, on_step=on_step, sample_id_log=sample_id_log)
        self.barriers = Barriers(
            config, batches, self.channel, self.ledger, on_checkpoint=on_checkpoint, checkpoint_path=checkpoint_path
        )
        self.lockstep = LockstepServe(
            config,
            job,
            scheduler,
            scheduler_factory,
            self.channel,
            self.ledger,
            self.barriers,
            self.timer,
            self._stop,
            liveness,
            warm_resume=dispatch_mode(job.consistency).warm_resume,
        )
        self._serving = False
        #: what :meth:`load_state_dict` did with a checkpoint's warm state (NOTE [warm resume])
        self.warm = WarmLoad()
        self._silence: Silence | None = None
        self.hellos_at: float | None = None  # time.perf_counter() when every worker had said hello

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(self.config.close_timeout_ms / 1e3)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the pipeline threads and the embedding worker's (joined for ``timeout_s`` in
        all) and close the socket (LINGER 0); idempotent. ``with`` closes with the config's
        ``close_timeout_ms``."""
        deadline = time.monotonic() + timeout_s
        self.lockstep.close(timeout_s)
        self.ledger.close(max(0.0, deadline - time.monotonic()))
        self.channel.close()

    def stop(self) -> None:
        """Stop reading new batches; the job ends at the next step boundary (thread-safe).

        The steps already read and scheduled (at most the pipeline's depth, NOTE
        [dispatch pipeline]) are still trained, then the final barrier runs."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called (read no more batches)."""
        return self._stop.is_set()

    # ------------------------------------------------------------ properties
    @property
    def job(self) -> JobSpec:
        """The job served (as given; workers get it with ``capacity_rows`` and ``num_workers``)."""
        return self._job

    @property
    def scheduler(self) -> Any:
        """The scheduler in use (a fresh one after every checkpoint barrier)."""
        return self.lockstep.scheduler

    @property
    def next_step(self) -> int:
        """The number of the next step to send."""
        return self.ledger.next_step

    @property
    def records(self) -> list[StepRecord]:
        """The :class:`StepRecord` of every fully acked step so far."""
        return self.ledger.records

    @property
    def checkpoints(self) -> list[int]:
        """The steps checkpointed (those of the state loaded included)."""
        return self.barriers.checkpoints

    @property
    def rejected(self) -> dict[str, int]:
        """Messages dropped so far, per kind (NOTE [peer validation]); a copy, thread-safe."""
        return self.channel.rejected

    def stage_seconds(self) -> dict[str, float]:
        """Seconds per stage so far, every thread's stages together (thread-safe reads of
        counters the pipeline threads add to)."""
        out: dict[str, float] = {}
        for timer in (self.timer, self.lockstep.plan_timer, self.lockstep.build_timer):
            for _ in range(3):  # a thread may add a new stage name while we copy
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
        self.channel.wait_for_hellos()
        self.hellos_at = time.perf_counter()  # every worker has started (the report's start-up)
        job = self._job.replace(
            capacity_rows=int(self.scheduler.capacity_rows),
            num_workers=self.config.num_workers,
            resume_caches=self.warm.loaded,  # NOTE [warm resume]
        )
        self.channel.send_all({"op": "config", "job": job.to_dict()})
        try:
            # the mode's serve strategy (herald.dispatch.modes): serve_steps, or gba's (NOTE [gba tokens])
            return dispatch_mode(self._job.consistency).serve(self)
        except BaseException as exc:
            # who the failed wait was for, as it failed (NOTE [silent workers] in herald/job/recovery/silence.py)
            self._silence = self.channel.peers.silence(self.config.peer_timeout_ms / 2e3)
            # tell every worker, so none waits out its timeout on a dead dispatcher
            self.channel.tell_error(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.lockstep.close(self.config.close_timeout_ms / 1e3)

    def silence(self) -> Silence | None:
        """After :meth:`serve` failed: the workers its failed wait was for that had sent
        nothing for at least half of ``peer_timeout_ms`` when it failed, and those that
        reported an error (NOTE [silent workers] in herald/job/recovery/silence.py); None when no
        wait on named workers failed, or none of them was silent."""
        return self._silence

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The job's position at a checkpoint barrier (or before :meth:`serve`, or after it):
        :meth:`herald.dispatch.barrier.Barriers.state_dict`.

        Raises:
            HeraldError: called between barriers, where batches sit in the scheduler and
                steps are in flight (NOTE [checkpoint barrier]: take it in ``on_checkpoint``).
        """
        return self.barriers.state_dict()

    def load_state_dict(self, state: dict[str, Any], folder: str | None = None) -> None:
        """Continue from ``state`` (a :meth:`state_dict` taken at a barrier); call before
        :meth:`serve`, with the PS rows and dense state of the same checkpoint restored.
        ``folder``: that checkpoint's folder, whose warm state (a checkpoint off the grid)
        the first scheduler and the workers load where it applies (NOTE [warm resume];
        :attr:`warm` says what was done).

        Raises:
            DataError: malformed state, or an unreadable warm state. ConfigError: saved with
                another number of workers, or it holds a producer position and ``batches``
                cannot load one.
            HeraldError: called after :meth:`serve` started.
        """
        if self._serving:
            raise HeraldError("Dispatcher.load_state_dict() must come before serve(); make a new Dispatcher")
        self.barriers.load_state_dict(state)
        if folder is not None and state.get("warm") is not None:
            self.warm = self.lockstep.load_warm(folder, state["warm"])

"""The lockstep pipeline of the plan-driven modes (bsp, bounded, hybrid): global batches ->
scheduler plans -> built steps -> sent within the credit window, with checkpoint barriers.

:class:`LockstepServe` owns the scheduler (a fresh one after every barrier) and runs the
three stages of NOTE [dispatch pipeline] (herald/dispatch/pipeline.py): the plan thread's
generator (read, schedule one step ahead, emit barriers: the plan of step t needs the
allocation of step t+1, Herald Alg. 2), the build thread's map (cut, compress and encode
the micro-batches: herald/dispatch/steps.py) and the serve thread's loop (wait for
credit, send the ready steps, run the barriers). What is in flight and acked is the step
ledger's (:mod:`herald.dispatch.ledger`); a barrier's messages and the saved position
are :mod:`herald.dispatch.barrier`'s.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from herald.contracts.job import JobSpec
from herald.dispatch.barrier import Barriers
from herald.dispatch.channel import PeerChannel
from herald.dispatch.config import DispatcherConfig
from herald.dispatch.early import TouchedKeys, touched_keys
from herald.dispatch.ledger import StepLedger
from herald.dispatch.pipeline import Pipeline
from herald.dispatch.records import StepRecord
from herald.dispatch.steps import ReadyStep, build_ready_step, scheduled_view
from herald.dispatch.warm import WarmLoad, WarmState, load_scheduler
from herald.errors import HeraldError
from herald.loader.batch import SampleBatch
from herald.phases import PhaseTimer


class LockstepServe:
    """Global steps handed out within the credit window, with barriers (one dispatcher).

    Args:
        config: the dispatcher's settings; job: the job served (its replicated tables).
        scheduler: the first :class:`herald.scheduler.Scheduler`; scheduler_factory: makes
            the next ones (after every checkpoint barrier).
        channel, ledger, barriers: the dispatcher's peer channel, step ledger and barriers.
        timer: the serve thread's :class:`~herald.phases.PhaseTimer`.
        stop: set by :meth:`herald.dispatch.dispatcher.Dispatcher.stop`: read no more batches.
        liveness: called about every 0.5 s while waiting for the next built step.
        warm_resume: a final barrier off the grid saves the scheduler's warm state, and a
            resume loads it (NOTE [warm resume] in herald/dispatch/warm.py; the mode's
            ``DispatchMode.warm_resume``).

    Attributes:
        scheduler: the scheduler in use. plan_timer, build_timer: the two threads' stages.
    """

    def __init__(
        self,
        config: DispatcherConfig,
        job: JobSpec,
        scheduler: Any,
        scheduler_factory: Callable[[], Any],
        channel: PeerChannel,
        ledger: StepLedger,
        barriers: Barriers,
        timer: PhaseTimer,
        stop: threading.Event,
        liveness: Callable[[], None] | None = None,
        warm_resume: bool = False,
    ):
        # the features reading replicated tables (NOTE [tables and features]: a table may have several)
        self._config, self._feature_tables = config, job.shared_feature_tables
        self._replicated = tuple(f for f, t in enumerate(job.feature_tables) if t in job.replicated_tables)
        self.scheduler, self._factory = scheduler, scheduler_factory
        self._channel, self._ledger, self._barriers = channel, ledger, barriers
        self._timer, self._stop, self._liveness = timer, stop, liveness
        self.plan_timer, self.build_timer = PhaseTimer(), PhaseTimer()  # one per pipeline thread
        self._pipeline: Pipeline | None = None
        self._plan_step = config.first_step  # plan thread: number of the next step planned
        self._touched: TouchedKeys | None = None  # build thread, NOTE [early pulls]: keys the last step changes
        self._reads_early = job.mode.reads_early
        self._mode, self._warm_resume = job.mode.to_dict(), warm_resume
        self._ghost = False  # NOTE [warm resume]: the scheduler's first plan is a step trained already

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the pipeline threads (joined for at most ``timeout_s``) and add their
        stages to the serve thread's timer; idempotent."""
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is None:
            return
        pipeline.close(timeout_s)
        for timer in (self.plan_timer, self.build_timer):
            for k, v in timer.take().items():
                self._timer.add(k, v / 1e3)

    # ---------------------------------------------------------- serve thread
    def serve(self) -> list[StepRecord]:
        """Start the pipeline, send every step, run the barriers, tell every worker ``end``."""
        last = None
        self._plan_step = self._ledger.next_step
        self._pipeline = pipeline = Pipeline(
            self._plans, self.build_step, depth_plans=1, depth_ready=self._config.ready_steps
        )
        pipeline.start()
        while True:
            with self._timer("wait_build"):
                item = pipeline.get(on_idle=self._liveness)
            if item[0] == "end":
                break
            if item[0] == "touched":  # NOTE [warm resume]: a step trained before the resume
                continue
            if item[0] == "step":
                self._ledger.wait_for_credit(drain=False)
                self._send_ready(item[1])
            else:
                _, last, index, final, warm = item
                self._barrier(last, index, final=final, warm=warm)
                pipeline.resume()
        if last is None:  # no batch at all
            self._ledger.wait_for_credit(drain=True)
        return self._ledger.end()

    def _send_ready(self, ready: ReadyStep) -> None:
        step = ready.step
        if step != self._ledger.next_step:
            raise HeraldError(
                f"the pipeline built step {step} where step {self._ledger.next_step} was due; this is "
                "a bug (NOTE [dispatch pipeline])"
            )
        self._ledger.open(ready)
        with self._timer("send"):
            for rank, frames in enumerate(ready.frames):
                self._channel.route(rank, frames)
        self._ledger.next_step = step + 1

    def _barrier(self, step: int, batch_index: int, final: bool, warm: WarmState | None = None) -> None:
        """NOTE [checkpoint barrier]: every ack in, the workers flushed (their caches emptied
        unless ``final``), then the checkpoint (with ``warm``: NOTE [warm resume])."""
        self._ledger.drain()
        self._barriers.flush(([ks.table, ks.ids] for ks in self.scheduler.flush()), reset=not final)
        self._barriers.complete(step, batch_index, warm=warm)

    def load_warm(self, folder: str, entry: Any) -> WarmLoad:
        """Before serving: load a checkpoint's warm state (``state["warm"]`` of the checkpoint
        ``folder``) into the first scheduler when it applies (NOTE [warm resume])."""
        load = load_scheduler(folder, entry, self.scheduler, self._mode, self._warm_resume)
        self._ghost = load.loaded
        return load

    # ------------------------------------------------ plan thread (NOTE [dispatch pipeline])
    def _plans(self, pipeline: Pipeline) -> Iterator[tuple]:
        """("plan", step, StepPlan, batch, batch index, sample ids or None, schedule ms, follows)
        items, one step behind the batches read, and ("barrier", last step, its batch
        index, final, warm state or None) items, after each of which it waits for the barrier
        to complete; a final barrier off the grid carries the scheduler's warm state (NOTE
        [warm resume])."""
        held: list[tuple[SampleBatch, int, Any]] = []
        every = self._config.checkpoint_every_steps
        source = self._barriers
        index = barrier_at = source.next_batch - 1
        batches = iter(source.batches)
        ids_of = getattr(source.batches, "sample_ids", None)
        timer = self.plan_timer
        for index in itertools.count(source.next_batch):
            with timer("read"):
                batch = next(batches, None)
            if batch is None:
                break
            source.batch_read(index)
            held.append((batch, index, ids_of(index) if ids_of is not None else None))
            t0 = time.perf_counter()
            plan = self.scheduler.submit(scheduled_view(batch, self._replicated))
            schedule_s = time.perf_counter() - t0
            timer.add("schedule", schedule_s)
            if plan is not None:  # the held batch's step comes next: no barrier between
                yield self._plan_item(plan, held, schedule_s, follows=True)
            due = every and (index + 1) % every == 0
            if due or self._stop.is_set():
                warm = yield from self._finish_scheduler(held, off_grid=not due)
                final = self._stop.is_set()
                yield ("barrier", self._plan_step - 1, index, final, warm)
                barrier_at = index
                if final:
                    return
                pipeline.wait_resume()
                if self._stop.is_set():  # stopped during the barrier: it was the last one
                    return
                self.scheduler = self._factory()
        index = source.next_batch - 1
        warm = None
        if held:
            warm = yield from self._finish_scheduler(held, off_grid=True)
        if index > barrier_at:  # batches since the last barrier (else that barrier was the final one)
            yield ("barrier", self._plan_step - 1, index, True, warm)

    def _plan_item(self, plan: Any, held: list, schedule_s: float, follows: bool = False) -> tuple:
        """A "plan" item of the first batch ``held``; ``follows``: another step comes right after
        it (``MicroBatch.next_follows`` when the credit window lets it be sent before this one's
        ack). The first plan of a warm scheduler is a "touched" item instead (NOTE [warm resume])."""
        if self._ghost:
            self._ghost = False
            return ("touched", plan)
        step, self._plan_step = self._plan_step, self._plan_step + 1
        follows = follows and self._config.max_inflight_steps >= 2
        return ("plan", step, plan, *held.pop(0), schedule_s * 1e3, follows)

    def _finish_scheduler(self, held: list, off_grid: bool = False) -> Iterator[tuple]:
        """Finish the scheduler's last step; returns its warm state taken just before when the
        barrier is ``off_grid`` and is checkpointed (NOTE [warm resume]), else None."""
        keep = off_grid and self._warm_resume and self._barriers.checkpointing and not self._ghost
        warm = WarmState(*self.scheduler.warm_state(), self._mode) if keep else None
        t0 = time.perf_counter()
        plan = self.scheduler.finish()
        schedule_s = time.perf_counter() - t0
        self.plan_timer.add("schedule", schedule_s)
        if plan is not None:
            yield self._plan_item(plan, held, schedule_s)
        return warm

    # ----------------------------------------------- build thread (NOTE [dispatch pipeline])
    def build_step(self, item: tuple) -> tuple:
        """A "plan" item -> ("step", :class:`ReadyStep`); a "touched" item sets the keys the
        step before touched (NOTE [warm resume]); other items pass through."""
        if item[0] == "touched":
            self._touched = touched_keys(item[1].plans) if self._reads_early else None
            return item
        if item[0] != "plan":
            return item
        _, step, step_plan, batch, index, ids, schedule_ms, follows = item
        with self.build_timer("build"):
            ready, self._touched = build_ready_step(
                step,
                step_plan,
                batch,
                index,
                ids,
                schedule_ms,
                dispatcher_rank=self._config.dispatcher_rank,
                replicated=self._replicated,
                feature_tables=self._feature_tables,
                touched_before=self._touched,
                next_follows=follows,
                reads_early=self._reads_early,
            )
        return ("step", ready)

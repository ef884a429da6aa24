"""NOTE [dispatch pipeline]: the dispatcher's plan and build threads, against scripted peers.

Failures in any stage surface in ``serve()`` (with the traceback of where they were
raised) and reach every worker; ``stop()`` ends the job at a step boundary; a
checkpoint barrier sees exactly the batches of the steps before it (the plan thread
waits there); early pulls are computed in step order; ``close()`` is bounded even with
a producer blocked in a read.
"""

from __future__ import annotations

import threading
import time
import traceback

import numpy as np
import zmq
from test_dispatcher_peers import (
    PEER_TIMEOUT_MS,
    PER_WORKER,
    WAIT_S,
    WORKERS,
    make_batches,
    make_job,
    make_peers,
    scheduler_factory,
)

from herald.contracts.modes import BoundedSettings
from herald.dispatch.dispatcher import Dispatcher, DispatcherConfig
from herald.dispatch.early import key_hash
from herald.dispatch.lockstep import LockstepServe
from herald.errors import DataError, HeraldError
from herald.scheduler import Scheduler
from tests.fakes import ServedDispatcher, all_ended, cooperative, drive


def _pipeline_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("herald-dispatch")]


def _assert_threads_end(timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while _pipeline_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _pipeline_threads(), f"pipeline threads still alive: {_pipeline_threads()}"


def _function_names(exc: BaseException) -> list[str]:
    return [frame.name for frame in traceback.extract_tb(exc.__traceback__)]


def _drive_until_error(peers) -> None:
    """Act as cooperative workers until the dispatcher reports an error to all of them."""
    deadline = time.monotonic() + WAIT_S
    poller = zmq.Poller()
    for p in peers:
        poller.register(p.sock, zmq.POLLIN)
    while not all(p.error is not None for p in peers):
        assert time.monotonic() < deadline, f"no error reached the peers: {[p.received for p in peers]}"
        ready = dict(poller.poll(50))
        for p in peers:
            if p.sock in ready:
                header, arrays = p.take()
                if header["op"] != "error":
                    cooperative(p, header, arrays)


# ------------------------------------------------------------------ errors
class _FailingScheduler:
    """A real scheduler whose ``submit`` raises on the ``fail_at``-th call (plan thread)."""

    def __init__(self, fail_at: int):
        self.inner, self.calls, self.fail_at = scheduler_factory(), 0, fail_at
        self.capacity_rows = self.inner.capacity_rows

    def submit(self, batch):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("scheduler exploded in submit")
        return self.inner.submit(batch)

    def finish(self):
        return self.inner.finish()

    def flush(self):
        return self.inner.flush()


def test_plan_thread_error_is_raised_by_serve_with_its_traceback_and_workers_are_told(job_of):
    d, served, peers, _ = job_of(make_batches(6), scheduler_factory=lambda: _FailingScheduler(fail_at=3))
    _drive_until_error(peers)
    served.join()
    assert isinstance(served.error, ValueError) and "exploded" in str(served.error)
    assert "submit" in _function_names(served.error), _function_names(served.error)  # where it was raised
    assert all("scheduler exploded" in p.error for p in peers)
    _assert_threads_end()


class _BuildFails(LockstepServe):
    def build_step(self, item):
        if item[0] == "plan" and item[1] == 1:
            raise RuntimeError("cannot build step 1")
        return super().build_step(item)


def test_build_thread_error_is_raised_by_serve_after_the_steps_before_it(job_of, monkeypatch):
    monkeypatch.setattr("herald.dispatch.dispatcher.LockstepServe", _BuildFails)  # the dispatcher's pipeline part
    d, served, peers, _ = job_of(make_batches(5))
    _drive_until_error(peers)
    served.join()
    assert isinstance(served.error, RuntimeError) and "cannot build step 1" in str(served.error)
    assert "build_step" in _function_names(served.error)
    assert all(p.steps == [0] for p in peers), "step 0 was built and sent before the failure"
    _assert_threads_end()


def test_read_error_is_raised_by_serve(job_of):
    def batches():
        yield from make_batches(2)
        raise DataError("corrupt record at row 17")

    d, served, peers, _ = job_of(batches())
    _drive_until_error(peers)
    served.join()
    assert isinstance(served.error, DataError) and "row 17" in str(served.error)
    assert "batches" in _function_names(served.error)
    _assert_threads_end()


# ------------------------------------------------------------------- stop
def test_stop_mid_run_ends_after_the_steps_read_with_a_final_barrier(job_of):
    states: list = []
    holder: dict = {}

    def on_step(rec):
        if rec.step == 1:
            holder["d"].stop()

    d, served, peers, _ = job_of(
        make_batches(40),
        on_step=on_step,
        on_checkpoint=lambda step, index, path, state: states.append((step, index, state)),
    )
    holder["d"] = d
    drive(peers, cooperative, all_ended(peers))
    served.join()
    assert served.error is None, served.error
    steps = [r.step for r in served.result]
    assert steps == list(range(len(steps))) and 2 <= len(steps) < 40
    # the pipeline is bounded: besides the 2 acked steps, only what was read ahead when
    # stop() came is trained: the steps in flight and ready, one in each thread's hands,
    # the plan queue's slot and the batch the scheduler holds (NOTE [dispatch pipeline])
    assert len(steps) <= 2 + d.config.max_inflight_steps + d.config.ready_steps + 4
    for p in peers:
        assert p.ended == len(steps) and p.steps == steps
        assert p.received[-2:] == ["flush", "end"]
    ((step, index, state),) = states  # one final barrier
    assert step == len(steps) - 1 and index == len(steps) - 1
    assert state["next_step"] == state["next_batch"] == len(steps)
    _assert_threads_end()


# ------------------------------------------------------- barrier exactness
class CountingBatches:
    """Global batches that count what was consumed; the count is their state."""

    def __init__(self, batches):
        self.batches, self.consumed = list(batches), 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.consumed >= len(self.batches):
            raise StopIteration
        time.sleep(0.002)  # let the serve thread fall behind the producer
        self.consumed += 1
        return self.batches[self.consumed - 1]

    def state_dict(self):
        return {"consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = state["consumed"]


def test_barrier_sees_exactly_the_batches_before_it(job_of):
    n, every = 9, 3
    batches = CountingBatches(make_batches(n))
    seen: list = []

    def on_checkpoint(step, index, path, state):
        # the plan thread waits at the barrier: nothing was read beyond its batch
        seen.append((step, index, batches.consumed, state))

    d, served, peers, _ = job_of(
        batches, checkpoint_every_steps=every, on_checkpoint=on_checkpoint, max_inflight_steps=2
    )
    drive(peers, cooperative, all_ended(peers))
    served.join()
    assert served.error is None, served.error
    assert [(s, i, c) for s, i, c, _ in seen] == [(2, 2, 3), (5, 5, 6), (8, 8, 9)]
    for step, _index, consumed, state in seen:
        assert state["next_step"] == state["next_batch"] == step + 1
        assert state["batches"] == {"consumed": consumed}


def test_resumed_dispatcher_continues_at_the_saved_step_and_batch(job_of):
    n, gb = 6, WORKERS * PER_WORKER
    states: list = []
    d, served, peers, _ = job_of(
        CountingBatches(make_batches(n)),
        checkpoint_every_steps=2,
        on_checkpoint=lambda step, index, path, state: states.append(state),
    )
    drive(peers, cooperative, all_ended(peers))
    served.join()
    assert served.error is None, served.error

    # a fresh dispatcher given the first barrier's state before serve() trains steps 2..5
    # on batches 2..5, with their own sample ids
    rest = CountingBatches(make_batches(n))
    d2 = Dispatcher(
        DispatcherConfig(num_workers=WORKERS, peer_timeout_ms=PEER_TIMEOUT_MS), rest, scheduler_factory, make_job()
    )
    d2.load_state_dict(states[0])
    assert rest.consumed == 2 and d2.next_step == 2
    peers2 = make_peers(d2.address, [])
    try:
        served2 = ServedDispatcher(d2, wait_s=WAIT_S)
        for p in peers2:
            p.hello()
        drive(peers2, cooperative, all_ended(peers2))
        served2.join()
        assert served2.error is None, served2.error
        assert [r.step for r in served2.result] == [2, 3, 4, 5]
        for p in peers2:
            assert p.steps == [2, 3, 4, 5] and p.ended == 6
            for mb in p.micro_batches:
                assert (
                    (mb.sample_ids >= np.uint64(mb.step * gb)) & (mb.sample_ids < np.uint64((mb.step + 1) * gb))
                ).all()
    finally:
        for p in peers2:
            p.close()
        d2.close()


# ------------------------------------------------------------- early pulls
def test_early_pulls_follow_the_previous_steps_touched_keys(job_of):
    # a mode whose workers read early (bounded, staleness > 0); bsp's pulls ride on the
    # step messages, so its micro-batches carry no marks
    d, served, peers, _ = job_of(make_batches(8), job=make_job().replace(mode=BoundedSettings(staleness=1)))
    drive(peers, cooperative, all_ended(peers))
    served.join()
    assert served.error is None, served.error
    for step in range(8):
        mbs = [p.micro_batches[step] for p in peers]
        if step == 0:
            assert not any(mb.pull_early.any() for mb in mbs)
            continue
        before = [p.micro_batches[step - 1].plan for p in peers]
        touched = set()
        for plan in before:
            touched |= set(key_hash(plan.grad_push).tolist()) | set(key_hash(plan.plan_push).tolist())
            wb = plan.write_back.astype(bool)
            touched |= set(
                (plan.evict.ids[wb] ^ (plan.evict.table[wb].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))).tolist()
            )
        for mb in mbs:
            want = np.array([h not in touched for h in key_hash(mb.plan.pull).tolist()], bool)
            assert np.array_equal(mb.pull_early, want), step


def test_bsp_micro_batches_mark_no_early_pulls(job_of):
    d, served, peers, _ = job_of(make_batches(4))
    drive(peers, cooperative, all_ended(peers))
    served.join()
    assert served.error is None, served.error
    mbs = [mb for p in peers for mb in p.micro_batches]
    assert len(mbs) == 4 * len(peers) and sum(len(mb.plan.pull) for mb in mbs) > 0
    assert not any(mb.pull_early.any() for mb in mbs)


# ------------------------------------------------------------ bounded close
def test_close_is_bounded_with_a_producer_blocked_in_a_read(job_of):
    """close(timeout_s) joins the pipeline threads for at most ``timeout_s`` (and serve()'s own
    close for ``close_timeout_ms``): it returns while the plan thread is still blocked in a read
    that only the test ends, after close."""
    blocked, release = threading.Event(), threading.Event()

    def batches():
        yield from make_batches(1)
        blocked.set()  # the plan thread now waits in the read
        release.wait(120)  # a source that blocks (a stream with no data)
        return

    d, served, peers, _ = job_of(batches(), close_timeout_ms=200)
    assert blocked.wait(WAIT_S), "the plan thread never asked for a second batch"
    closer = threading.Thread(target=lambda: d.close(timeout_s=0.2), daemon=True, name="close")
    closer.start()
    closer.join(WAIT_S)  # a close that joined the blocked read would wait until release
    assert not closer.is_alive(), f"close() still waiting after {WAIT_S} s on a producer blocked in a read"
    assert not release.is_set() and any(t.name.endswith("-plan") for t in _pipeline_threads()), (
        "the plan thread's read ended before close() returned: nothing was tested"
    )
    served.join()
    assert isinstance(served.error, HeraldError) and "closed" in str(served.error)
    release.set()
    _assert_threads_end()


def test_scheduler_factory_runs_after_each_barrier_only(job_of):
    made: list = []

    def factory():
        made.append(time.monotonic())
        return scheduler_factory()

    d, served, peers, _ = job_of(
        make_batches(6), checkpoint_every_steps=2, on_checkpoint=lambda *a: None, scheduler_factory=factory
    )
    drive(peers, cooperative, all_ended(peers))
    served.join()
    assert served.error is None, served.error
    # at the start, then after each periodic barrier (steps 1, 3, 5: the barrier on the last
    # batch is periodic too, so a scheduler is made that never schedules anything)
    assert len(made) == 4
    assert isinstance(d.scheduler, Scheduler)

"""A real :class:`Dispatcher` against scripted ZeroMQ DEALER peers (fake workers).

Each test serves a tiny job (2 workers, global batches of 8 samples, 2 tables) on a
background thread and plays the workers from the test thread, message by message, as
NOTE [dispatch protocol] and NOTE [checkpoint barrier] describe (ScriptedWorker and
ServedDispatcher, tests/fakes.py). Every wait is bounded: peers poll with a deadline and
the dispatcher runs with a short ``peer_timeout_ms``, so a broken protocol fails the test
instead of hanging it.
"""

from __future__ import annotations

import io
import re
import time

import numpy as np
import pytest

from herald.contracts.job import JobSpec
from herald.contracts.tables import TableConfig
from herald.contracts.vocab import STARTUP_GRACE_MS
from herald.dispatch.dispatcher import Dispatcher, DispatcherConfig
from herald.errors import HeraldError, PeerTimeout, ProtocolError
from herald.job.parts import raise_job_failure
from herald.loader.batch import SampleBatch
from herald.scheduler import Scheduler
from herald.scheduler.config import SchedulerConfig
from tests.fakes import ScriptedWorker, ServedDispatcher, all_ended, cooperative, drive

WORKERS, PER_WORKER, TABLES, VOCAB = 2, 4, 2, 12
CAPACITY_ROWS = 10  # >= the 8 keys of a micro-batch, < the 24 keys of the job: evictions happen
WAIT_S = 30.0  # longest a scripted exchange may take (a fresh clone compiles the numba kernels first)
PEER_TIMEOUT_MS = 1000
# A wait that honours PEER_TIMEOUT_MS lasts at least that long, names it in its error, and
# ends long before the 120 s default peer timeout: this generous bound only tells the two
# apart (a loaded machine delays a wake-up by seconds, not minutes).
HONOURED_S = 20.0


class NoFailure:
    """A PS part's liveness check that saw nothing (``failure()`` None)."""

    def failure(self) -> None:
        return None


class FakeWorkers:
    """The worker part :func:`raise_job_failure` talks to: ``exit_codes`` as given
    (None: running), pid 100 + rank, no failure of its own, ``stop`` counted."""

    def __init__(self, exit_codes: dict[int, int | None]):
        self.codes, self.stopped = exit_codes, 0

    def failure(self, grace_s: float = 0.0) -> None:
        return None

    def exit_codes(self) -> dict[int, int | None]:
        return self.codes

    def describe(self, rank: int) -> str:
        return f"pid {100 + rank}, stopped (SIGSTOP or a debugger); log worker-{rank}.log"

    def stop(self) -> None:
        self.stopped += 1


def make_batches(n: int, seed: int = 0) -> list[SampleBatch]:
    """``n`` global batches of ``WORKERS * PER_WORKER`` single-hot samples over ``TABLES``
    tables of ``VOCAB`` ids (small enough that keys repeat across batches and workers)."""
    rng = np.random.default_rng(seed)
    gb = WORKERS * PER_WORKER
    out = []
    for _ in range(n):
        values = [rng.integers(0, VOCAB, gb).astype(np.uint64) for _ in range(TABLES)]
        offsets = [np.arange(gb + 1, dtype=np.int64) for _ in range(TABLES)]
        out.append(
            SampleBatch(
                rng.integers(0, 2, gb).astype(np.float32),
                rng.standard_normal((gb, 3)).astype(np.float32),
                values,
                offsets,
            )
        )
    return out


def make_job() -> JobSpec:
    tables = tuple(TableConfig(f"t{i}", 4) for i in range(TABLES))
    return JobSpec(tables=tables, dense_dim=3, ps=("tcp://127.0.0.1:1",))  # never dialled: no worker is real


def scheduler_factory() -> Scheduler:
    cfg = SchedulerConfig(num_workers=WORKERS, batch_size_per_worker=PER_WORKER, cache_capacity_rows=CAPACITY_ROWS)
    return Scheduler(cfg, num_tables=TABLES)


def make_peers(address: str, log: list) -> list[ScriptedWorker]:
    """The job's ``WORKERS`` scripted workers (``worker-<rank>``) at ``address``."""
    return [ScriptedWorker(address, r, log, world_size=WORKERS, rows=PER_WORKER, wait_s=WAIT_S) for r in range(WORKERS)]


@pytest.fixture
def job_of():
    """``job_of(batches, hello=ranks, log=list, **settings) -> (dispatcher, served, peers, log)``.

    ``settings`` are :class:`DispatcherConfig` fields, the callbacks of :class:`Dispatcher`,
    ``scheduler_factory``, ``job`` (default :func:`make_job`) or ``dispatcher_cls`` (a subclass of :class:`Dispatcher`);
    the peers of ``hello`` said hello (all: and received their config); ``log`` gets
    ``(rank, "sent"/"got", op)`` of every peer message. Everything is closed after the test."""
    made: list = []

    def start(batches, hello: tuple[int, ...] = (0, 1), log: list | None = None, **kwargs):
        log = [] if log is None else log
        kwargs.setdefault("peer_timeout_ms", PEER_TIMEOUT_MS)
        extra = {
            k: kwargs.pop(k)
            for k in ("on_step", "on_checkpoint", "checkpoint_path", "sample_id_log", "liveness")
            if k in kwargs
        }
        factory = kwargs.pop("scheduler_factory", scheduler_factory)
        cls = kwargs.pop("dispatcher_cls", Dispatcher)
        job = kwargs.pop("job", make_job())
        d = cls(DispatcherConfig(num_workers=WORKERS, **kwargs), batches, factory, job, **extra)
        peers = make_peers(d.address, log)
        served = ServedDispatcher(d, wait_s=WAIT_S)
        made.append((d, peers, served))
        for r in hello:
            peers[r].hello()
        if len(hello) == WORKERS:
            for p in peers:
                header, _ = p.recv()
                assert header["op"] == "config"
                assert p.job.num_workers == WORKERS and p.job.capacity_rows == CAPACITY_ROWS
                assert p.job.tables == make_job().tables and p.job.ps == make_job().ps
        return d, served, peers, log

    yield start
    for d, peers, served in made:
        served.thread.join(PEER_TIMEOUT_MS / 1e3 + 2)  # every serve ends by itself within peer_timeout_ms
        for p in peers:
            p.close()
        if not served.thread.is_alive():
            d.close()


# ------------------------------------------------------------------ happy path
def test_happy_path_every_step_is_recorded_in_order_and_end_counts_steps(job_of):
    n, gb = 5, WORKERS * PER_WORKER
    seen: list[int] = []
    id_log = io.BytesIO()
    batches = make_batches(n)
    d, served, peers, _ = job_of(batches, on_step=lambda rec: seen.append(rec.step), sample_id_log=id_log)
    drive(peers, cooperative, all_ended(peers))
    served.join()
    assert served.error is None, served.error
    records = served.result
    assert [r.step for r in records] == list(range(n)) == seen
    # every sample of batch t goes to exactly one worker at step t, with its own data
    for step, batch in enumerate(batches):
        positions = []
        for p in peers:
            mb = p.micro_batches[step]
            pos = (mb.sample_ids - np.uint64(step * gb)).astype(np.int64)  # ids are sequence numbers
            assert np.array_equal(mb.labels, batch.labels[pos]) and np.array_equal(mb.dense, batch.dense[pos])
            for t in range(TABLES):
                assert np.array_equal(mb.values(t), batch.values[t][pos])
            positions += pos.tolist()
        assert sorted(positions) == list(range(gb))
    assert np.array_equal(np.sort(np.frombuffer(id_log.getvalue(), np.uint64)), np.arange(n * gb, dtype=np.uint64))
    for p in peers:
        assert p.steps == list(range(n))
        assert p.ended == n
        # the final barrier flushes (reset=False) before the end; then nothing else
        assert p.received == ["config"] + ["microbatch"] * n + ["flush", "end"]
    for r in records:
        assert r.loss == pytest.approx(1.0)  # mean of 0.5 and 1.5
        assert (r.bytes_pulled, r.bytes_pushed) == (21, 201)
        assert r.counts.shape[0] == WORKERS
        assert r.labels.tolist() == [0.0] * PER_WORKER + [1.0] * PER_WORKER  # rank order
        assert r.probs.shape == (WORKERS * PER_WORKER,)


def test_final_flush_names_only_keys_the_worker_was_sent(job_of):
    flushed: dict[int, set] = {}

    def react(p: ScriptedWorker, header: dict, arrays: list) -> None:
        if header["op"] == "flush":
            assert header["reset"] is False  # the final barrier keeps the caches
            flushed[p.rank] = set(zip(arrays[0].tolist(), arrays[1].tolist()))
        cooperative(p, header, arrays)

    d, served, peers, _ = job_of(make_batches(4))
    drive(peers, react, all_ended(peers))
    served.join()
    assert served.error is None, served.error
    for p in peers:
        assert flushed[p.rank] <= p.sent_keys
    assert not flushed[0] & flushed[1], "a key has one only-latest copy"
    assert flushed[0] | flushed[1], "the scheduler owes some write-backs after 4 steps"


# ------------------------------------------------------------- out-of-order acks
def test_acks_of_two_inflight_steps_may_interleave_across_ranks(job_of):
    d, served, peers, _ = job_of(make_batches(3), max_inflight_steps=2)
    p0, p1 = peers
    for p in peers:  # two steps in flight: both arrive before any ack
        for step in (0, 1):
            header, _ = p.recv()
            assert (header["op"], header["step"]) == ("microbatch", step)
    assert not p0.sock.poll(200), "a third step was sent beyond max_inflight_steps=2"
    p1.ack(0)
    p1.ack(1)  # rank 1 acks step 1 before rank 0 acked step 0
    p0.ack(0)
    p0.ack(1)
    drive(peers, cooperative, all_ended(peers))
    served.join()
    assert served.error is None, served.error
    assert [r.step for r in served.result] == [0, 1, 2]
    assert [p.ended for p in peers] == [3, 3]


# -------------------------------------------------------------- protocol errors
@pytest.mark.parametrize("bad", ["duplicate", "not_in_flight"])
def test_bad_ack_is_a_protocol_error_naming_step_and_rank(job_of, bad):
    """A well-formed ack out of place from a worker's own identity is that worker's bug
    (malformed or foreign messages are dropped instead: test_hostile_peers.py)."""
    d, served, peers, _ = job_of(make_batches(3), max_inflight_steps=2)
    p0, p1 = peers
    for p in peers:
        p.recv(), p.recv()
    if bad == "duplicate":
        p0.ack(0)
        p0.ack(0)
        want = r"step 0 .*rank 0"
    else:
        p1.ack(5)
        want = r"step 5 .*rank 1"
    served.join()
    assert isinstance(served.error, ProtocolError), served.error
    assert re.search(want, str(served.error)), str(served.error)
    for p in peers:  # every worker is told, so none waits out its own timeout
        header, _ = p.recv()
        while header["op"] != "error":
            header, _ = p.recv()
        assert "ProtocolError" in header["message"]


def test_out_of_turn_op_from_a_worker_is_a_protocol_error_naming_it(job_of):
    d, served, peers, _ = job_of(make_batches(3))
    peers[0].recv()
    peers[0].send({"op": "saved", "rank": 0})  # while the dispatcher waits for acks
    served.join()
    assert isinstance(served.error, ProtocolError), served.error
    assert "expected ack, got 'saved' from worker 0" in str(served.error)


# ------------------------------------------------------------------- timeouts
def test_silent_peer_is_a_peer_timeout_naming_the_missing_rank(job_of):
    d, served, peers, _ = job_of(make_batches(3), max_inflight_steps=2)
    p0, p1 = peers
    for _ in range(2):  # rank 1 receives its steps and never answers
        assert p1.recv()[0]["op"] == "microbatch"
    for _ in range(2):
        step = p0.recv()[0]["step"]
        last_message = time.monotonic()  # the dispatcher's wait starts once it got this ack
        p0.ack(step)
    served.join()
    assert isinstance(served.error, PeerTimeout), served.error
    waited = served.ended_at - last_message
    assert 0.8 * PEER_TIMEOUT_MS / 1e3 <= waited < HONOURED_S, waited
    msg = str(served.error)
    assert "ack of step 0 from workers [1]" in msg and f"{PEER_TIMEOUT_MS} ms" in msg
    assert served.error.peer is not None and "[1]" in served.error.peer
    header, _ = p0.recv()  # the live worker learns why the job stopped
    assert header["op"] == "error" and "PeerTimeout" in header["message"]


def test_peer_missing_at_handshake_is_a_peer_timeout_naming_it(job_of):
    t0 = time.monotonic()
    d, served, peers, _ = job_of(make_batches(1), hello=(0,), startup_grace_ms=2 * PEER_TIMEOUT_MS)
    served.join()
    assert isinstance(served.error, PeerTimeout), served.error
    msg = str(served.error)  # the start-up wait, not the step timeout (below)
    assert "hello from workers [1]" in msg and f"{2 * PEER_TIMEOUT_MS} ms" in msg and "start-up" in msg
    assert 0.8 * 2 * PEER_TIMEOUT_MS / 1e3 <= served.ended_at - t0 < HONOURED_S
    assert d.silence() is None  # workers still starting are not blamed (NOTE [silent workers])


def test_the_hello_wait_is_the_start_up_grace_not_the_step_timeout(job_of):
    """A worker that says hello later than --timeout-ms (it was importing torch) joins the
    job: the handshake waits max(peer_timeout_ms, startup_grace_ms), 60 s by default."""
    assert DispatcherConfig(num_workers=1).startup_grace_ms == STARTUP_GRACE_MS == 60_000
    d, served, peers, _ = job_of(make_batches(2), hello=(0,), startup_grace_ms=4 * PEER_TIMEOUT_MS)
    assert d.channel.startup_ms == 4 * PEER_TIMEOUT_MS and d.channel.timeout_ms == PEER_TIMEOUT_MS
    time.sleep(1.5 * PEER_TIMEOUT_MS / 1e3)  # past the step timeout
    assert served.thread.is_alive() and served.error is None
    peers[1].hello()
    for p in peers:
        assert p.recv()[0]["op"] == "config"
    drive(peers, cooperative, all_ended(peers))
    served.join()
    assert served.error is None and [r.step for r in served.result] == [0, 1]


def test_a_worker_timing_out_on_a_silent_one_leaves_the_silent_one_named(job_of):
    """NOTE [silent workers]: rank 0 stops answering; rank 1 acks step 0, waits in vain on
    rank 0 for over half the timeout and reports its timeout. The dispatcher's view names
    rank 0 as awaited and silent, rank 1 as the one that reported; the job's headline
    names rank 0, the report of rank 1 comes after it."""
    d, served, peers, _ = job_of(make_batches(3))
    p0, p1 = peers
    assert p1.recv()[0]["step"] == 0
    p1.ack(0)  # rank 0 received its step and stays silent
    time.sleep(0.6 * PEER_TIMEOUT_MS / 1e3)
    p1.send({"op": "error", "rank": 1, "message": "PeerTimeout: PS shard 0 did not answer step within 1000 ms"})
    served.join()
    assert type(served.error) is HeraldError and str(served.error).startswith("worker 1 failed")
    silence = d.silence()
    assert set(silence.silent) == {0} and silence.awaited == {0} and silence.reported == {1}
    assert set(silence.quiet) == {0, 1} and "ack of step 0 from workers [0]" in silence.waiting_for
    # the job's headline (herald/job/recovery/failure.py), both workers still running
    with pytest.raises(HeraldError) as failed:
        raise_job_failure(served.error, NoFailure(), FakeWorkers({0: None, 1: None}), silence)
    first, *rest = str(failed.value).splitlines()
    assert first.startswith("worker-0 (pid 100") and "went silent" in first and "ack of step 0" in first, first
    assert "worker 1 failed: PeerTimeout" in "\n".join(rest)


def test_a_worker_error_right_after_its_ack_blames_that_worker(job_of):
    """A worker that fails without a long silence first crashed on its own: the dispatcher
    names nobody silent, and the job's headline stays that worker's error."""
    d, served, peers, _ = job_of(make_batches(3))
    assert peers[1].recv()[0]["step"] == 0
    peers[1].send({"op": "error", "rank": 1, "message": "CUDA out of memory"})
    served.join()
    assert d.silence() is None
    with pytest.raises(HeraldError, match="^worker 1 failed: CUDA out of memory"):
        raise_job_failure(served.error, NoFailure(), FakeWorkers({0: None, 1: None}), d.silence())


# ------------------------------------------------------------ a worker's error
def test_worker_error_stops_the_job_and_the_others_are_told(job_of):
    d, served, peers, _ = job_of(make_batches(3))
    p0, p1 = peers
    p0.recv()
    p1.recv()
    p1.send({"op": "error", "rank": 1, "message": "CUDA out of memory"})
    served.join()
    assert type(served.error) is HeraldError, served.error
    assert "worker 1" in str(served.error) and "CUDA out of memory" in str(served.error)
    header, _ = p0.recv()
    while header["op"] == "microbatch":
        header, _ = p0.recv()
    assert header["op"] == "error" and "worker 1" in header["message"]
    assert served.result is None


# -------------------------------------------------------- checkpoint barrier
def test_checkpoint_barrier_flushes_saves_calls_back_and_goes_on(job_of, tmp_path):
    calls: list = []
    log: list = []

    def on_checkpoint(step, batch_index, path, state):
        log.append(("dispatcher", "on_checkpoint", step))
        calls.append((step, batch_index, path, state))

    def path(step: int) -> str:
        return str(tmp_path / f"ckpt-{step}")

    d, served, peers, _ = job_of(
        make_batches(4), log=log, checkpoint_every_steps=2, on_checkpoint=on_checkpoint, checkpoint_path=path
    )
    saves: list[str] = []
    resets: list[bool] = []

    def react(p: ScriptedWorker, header: dict, arrays: list) -> None:
        if header["op"] == "save":
            saves.append(header["path"])
        if header["op"] == "flush":
            resets.append(header["reset"])
        cooperative(p, header, arrays)

    drive(peers, react, all_ended(peers))
    served.join()
    assert served.error is None, served.error
    assert [r.step for r in served.result] == [0, 1, 2, 3]
    assert [c[:3] for c in calls] == [(1, 1, path(1)), (3, 3, path(3))]
    assert saves == [path(1), path(3)]
    assert resets == [True] * 4  # two periodic barriers (caches emptied), two workers each
    first = calls[0][3]
    assert (first["next_step"], first["next_batch"], first["checkpoints"]) == (2, 2, [1])
    assert d.checkpoints == [1, 3]
    # each rank's view: steps, then the barrier, then training goes on
    assert peers[0].received == [
        "config",
        "microbatch",
        "microbatch",
        "flush",
        "save",
        "microbatch",
        "microbatch",
        "flush",
        "save",
        "end",
    ]
    assert peers[1].received == [
        "config",
        "microbatch",
        "microbatch",
        "flush",
        "microbatch",
        "microbatch",
        "flush",
        "end",
    ]
    # across ranks: both flushed before rank 0 is asked to save; on_checkpoint after saved
    # and before any micro-batch of the next step is sent
    events = list(log)
    first_save = events.index((0, "got", "save"))
    assert (0, "sent", "flushed") in events[:first_save] and (1, "sent", "flushed") in events[:first_save]
    first_cb = events.index(("dispatcher", "on_checkpoint", 1))
    assert events.index((0, "sent", "saved")) < first_cb
    got_mb = [i for i, e in enumerate(events) if e[1:] == ("got", "microbatch")]
    assert sum(i < first_cb for i in got_mb) == 4 and sum(i > first_cb for i in got_mb) == 4

"""A real :class:`Dispatcher` (served on a thread) under malformed and foreign messages:
it drops and counts each (NOTE [peer validation]) and goes on serving the job.

Scripted workers and strangers are ZeroMQ DEALERs (ScriptedWorker and Stranger,
tests/fakes.py) and plain TCP sockets on the dispatcher's real port. Hostile messages are
sent while the dispatcher waits (for
hellos or for an ack), the test waits until it counted them, and then the workers
finish the job, so every count is exact.
"""

from __future__ import annotations

import threading
import time

import hostile
import pytest
from test_dispatcher_peers import PEER_TIMEOUT_MS, PER_WORKER, WAIT_S, WORKERS, make_batches

from herald.dispatch.peers import KINDS
from herald.errors import PeerTimeout
from tests.fakes import Stranger, all_ended, cooperative, drive, wait_until

STEPS = 3
PATIENT_MS = 5000  # the dispatcher's peer_timeout_ms where the test sends hostile messages first


@pytest.fixture
def strangers():
    made: list[Stranger] = []

    def make(address: str, identity: bytes = b"stranger") -> Stranger:
        made.append(Stranger(address, identity))
        return made[-1]

    yield make
    for s in made:
        s.close()


def wait_rejected(d, want: dict[str, int], timeout_s: float = WAIT_S) -> None:
    """Wait until the dispatcher counted ``want`` (kind -> count); then it must be exact."""
    deadline = time.monotonic() + timeout_s
    while any(d.rejected[k] < n for k, n in want.items()):
        if time.monotonic() > deadline:
            raise AssertionError(f"the dispatcher counted {d.rejected} after {timeout_s} s, expected {want}")
        time.sleep(0.01)
    assert d.rejected == {**dict.fromkeys(KINDS, 0), **want}


def finish(served, peers, *, ack_step0: bool = False) -> list:
    """Play the workers to the end of the job (first acking step 0, received by
    :func:`in_flight`, if ``ack_step0``); the job's records."""
    for p in peers if ack_step0 else ():
        p.ack(0, loss=0.5 + p.rank)
    drive(peers, cooperative, all_ended(peers))
    served.join()
    assert served.error is None, served.error
    assert [r.step for r in served.result] == list(range(STEPS))
    assert all(p.steps == list(range(STEPS)) and p.ended == STEPS for p in peers)
    return served.result


def in_flight(peers) -> None:
    """Every worker received step 0: the dispatcher now waits for acks."""
    for p in peers:
        header, _ = p.recv()
        assert (header["op"], header["step"]) == ("microbatch", 0)


# ------------------------------------------------------------------ handshake
def test_garbage_during_the_handshake_is_dropped_and_the_job_goes_on(job_of, strangers):
    d, served, peers, _ = job_of(make_batches(STEPS), hello=(), peer_timeout_ms=PATIENT_MS)
    s = strangers(d.address)
    s.send_all(
        hostile.undecodable()
        + hostile.unknown_ops()
        + hostile.bad_fields(0, WORKERS, PER_WORKER)
        + hostile.claims(0, PER_WORKER)
        + hostile.claims(1, PER_WORKER)
    )
    want = {
        "undecodable": len(hostile.undecodable()),
        "unknown_op": len(hostile.unknown_ops()),
        "bad_field": len(hostile.bad_fields(0, WORKERS, PER_WORKER)),
        "unknown_peer": 2 * len(hostile.claims(0, 1)),
    }
    wait_rejected(d, want)
    assert not served.error and served.thread.is_alive()  # a forged error before any hello stopped nothing
    for p in peers:
        p.hello()
    for p in peers:
        assert p.recv()[0]["op"] == "config"
    records = finish(served, peers)
    assert records[-1].rejected == d.rejected == {**dict.fromkeys(KINDS, 0), **want}
    assert s.got_nothing()


def test_second_hello_for_a_bound_rank_is_refused_and_never_replaces_the_first(job_of, strangers):
    d, served, peers, _ = job_of(make_batches(STEPS), hello=(), peer_timeout_ms=PATIENT_MS)
    p0, p1 = peers
    p0.hello()
    p0.hello()  # the same hello again
    p0.send({"op": "hello", "rank": 1, "world_size": WORKERS})  # one identity, a second rank
    wait_rejected(d, {"duplicate_hello": 2})
    s = strangers(d.address)
    s.send_all(hostile.hellos(WORKERS)[:1])  # a stranger claims bound rank 0
    wait_rejected(d, {"duplicate_hello": 3})
    p1.hello()  # rank 1 was still free
    for p in peers:
        assert p.recv()[0]["op"] == "config"
    s.send_all(hostile.hellos(WORKERS))  # every rank is bound now
    in_flight(peers)
    wait_rejected(d, {"duplicate_hello": 5})
    finish(served, peers, ack_step0=True)
    assert s.got_nothing(), "a refused hello got an answer"
    assert p0.received.count("config") == p1.received.count("config") == 1


# ------------------------------------------------------------------ during steps
def test_malformed_and_foreign_messages_during_steps_are_dropped_and_counted(job_of, strangers):
    d, served, peers, _ = job_of(make_batches(STEPS), peer_timeout_ms=PATIENT_MS)
    p0, p1 = peers
    in_flight(peers)
    s = strangers(d.address, b"\x01not a worker\xff")
    s.send_all(
        hostile.undecodable() + hostile.unknown_ops() + hostile.claims(0, PER_WORKER) + hostile.claims(1, PER_WORKER)
    )  # forged acks and errors included
    for frames in hostile.undecodable() + hostile.unknown_ops() + hostile.bad_fields(0, WORKERS, PER_WORKER):
        p0.sock.send_multipart(frames)  # the worker's own identity, bad words
    p1.sock.send_multipart(hostile.claims(0, PER_WORKER)[0])  # rank 1 acks in rank 0's name,
    p1.sock.send_multipart(hostile.claims(0, PER_WORKER)[-1])  # and fails in its name
    want = {
        "undecodable": 2 * len(hostile.undecodable()),
        "unknown_op": 2 * len(hostile.unknown_ops()),
        "bad_field": len(hostile.bad_fields(0, WORKERS, PER_WORKER)),
        "unknown_peer": 2 * len(hostile.claims(0, 1)),
        "wrong_identity": 2,
    }
    wait_rejected(d, want)
    assert not d.records, "a forged or malformed ack completed step 0"
    records = finish(served, peers, ack_step0=True)
    assert records[-1].rejected == {**dict.fromkeys(KINDS, 0), **want}
    assert records[0].loss == pytest.approx(1.0)  # the real acks only (0.5 and 1.5)
    assert s.got_nothing()


def test_wrong_identity_during_the_barrier_is_dropped(job_of):
    d, served, peers, _ = job_of(make_batches(1), peer_timeout_ms=PATIENT_MS)
    p1 = peers[1]
    drive(
        peers,
        lambda p, h, a: p.ack(h["step"]) if h["op"] == "microbatch" else None,
        lambda: all("flush" in p.received for p in peers),
    )
    p1.send({"op": "flushed", "rank": 0})  # rank 1 answers in rank 0's name
    wait_rejected(d, {"wrong_identity": 1})
    for p in peers:
        p.send({"op": "flushed", "rank": p.rank})
    drive(peers, cooperative, all_ended(peers))
    served.join()
    assert served.error is None, served.error
    assert served.result[-1].rejected["wrong_identity"] == 1


def test_raw_tcp_bytes_are_dropped_and_counted(job_of):
    d, served, peers, _ = job_of(make_batches(STEPS), peer_timeout_ms=PATIENT_MS)
    in_flight(peers)
    for noise in hostile.NOISE:  # not ZMTP at all: libzmq may drop the connection
        hostile.send_raw_tcp(d.address, noise)
    noise_counts = dict(d.rejected)
    framed = (
        hostile.undecodable()[:1] + hostile.unknown_ops()[:1] + hostile.claims(0, PER_WORKER) + hostile.hellos(WORKERS)
    )  # ZMTP/1.0 framing: delivered as messages
    hostile.send_raw_tcp(d.address, hostile.zmtp10(framed))
    want = {"unknown_op": 1, "unknown_peer": len(hostile.claims(0, 1)), "duplicate_hello": WORKERS}
    deadline = time.monotonic() + WAIT_S
    while any(d.rejected[k] < n for k, n in want.items()) or d.rejected["undecodable"] < 1:
        assert time.monotonic() < deadline, d.rejected
        time.sleep(0.01)
    records = finish(served, peers, ack_step0=True)
    got = records[-1].rejected
    assert {k: got[k] for k in want} == want and got["wrong_identity"] == got["bad_field"] == 0
    assert 1 <= got["undecodable"] <= 1 + sum(noise_counts.values()) + len(hostile.NOISE)


def test_a_stranger_using_a_workers_identity_cannot_speak_for_it(job_of, strangers):
    """libzmq holds a second connection of a routing id in use (here worker 0's) apart and
    never delivers its messages while the first is connected, so the dispatcher cannot count
    them. The test proves instead that the forged frames were written to an established
    connection to the dispatcher, and that the dispatcher read its port after that, before
    any real ack; then they must have had no effect."""
    d, served, peers, _ = job_of(make_batches(STEPS), peer_timeout_ms=PATIENT_MS)
    in_flight(peers)
    forged = hostile.claims(0, PER_WORKER)  # forged acks and error in worker 0's identity
    spoof = strangers(d.address, b"worker-0")
    spoof.wait_handshake(WAIT_S)  # connected to the dispatcher, as worker 0 is
    spoof.send_all(forged, wait_s=WAIT_S)  # every frame written to that connection
    control = strangers(d.address, b"control")  # the same frames from an identity not in use:
    control.send_all(forged)  # read and counted, after the spoofed ones arrived
    wait_until(
        lambda: d.rejected["unknown_peer"] >= len(forged) or not served.thread.is_alive(),
        WAIT_S,
        f"the dispatcher counting the control's {len(forged)} messages (counted: {d.rejected})",
    )
    assert served.thread.is_alive() and served.error is None, f"a forged message stopped the job: {served.error!r}"
    assert not d.records, "a forged ack completed step 0"
    wait_rejected(d, {"unknown_peer": len(forged)})
    finish(served, peers, ack_step0=True)
    assert served.result[0].loss == pytest.approx(1.0)
    assert served.result[-1].rejected == {**dict.fromkeys(KINDS, 0), "unknown_peer": len(forged)}
    assert spoof.got_nothing() and control.got_nothing()


# ------------------------------------------------------------------ bounded waits
def test_a_flood_of_garbage_does_not_hold_the_timeout_or_the_liveness_check(job_of, strangers):
    checks: list[float] = []
    d, served, peers, _ = job_of(make_batches(STEPS), liveness=lambda: checks.append(time.monotonic()))
    in_flight(peers)  # rank 1 never acks
    peers[0].ack(0)
    flood = strangers(d.address)
    stop = threading.Event()

    def hammer() -> None:
        junk = hostile.undecodable()[:3]
        while not stop.is_set():
            flood.send_all(junk)
            time.sleep(0.002)

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    try:
        served.join(PEER_TIMEOUT_MS / 1e3 + 5)
    finally:
        stop.set()
        thread.join(5)
    # the flood went on until serve() ended: a wait that dropped messages extended would never end
    assert isinstance(served.error, PeerTimeout), served.error
    msg = str(served.error)
    assert "ack of step 0 from workers [1]" in msg
    assert "malformed or foreign messages were dropped meanwhile (undecodable" in msg
    assert d.rejected["undecodable"] > 3
    assert checks, "the liveness check never ran during the flood"

"""NOTE [message size limits] on the dispatcher's socket and the worker's: a frame over the
bound is never delivered (nor buffered) and the dispatcher goes on serving; the largest
legitimate message still passes.

A dropped frame is not counted (libzmq drops the connection silently), so each test proves
non-delivery by the counts of NOTE [peer validation]: every message that reaches the
dispatcher is counted when it is rejected, and the oversized ones leave no count.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from test_dispatcher_peers import PER_WORKER, WAIT_S, WORKERS, make_batches, make_job
from test_hostile_peers import finish, wait_rejected

from herald import wire
from herald.contracts.job import JobSpec
from herald.contracts.microbatch import MAX_WORKER_FRAME_BYTES
from herald.contracts.modes import GbaSettings, HybridSettings
from herald.contracts.tables import TableConfig
from herald.dispatch import channel as channel_mod
from herald.dispatch.channel import PeerChannel
from herald.dispatch.config import DispatcherConfig
from herald.dispatch.peers import KINDS, largest_frame_bytes
from herald.errors import ConfigError, PeerTimeout
from herald.worker.link import DispatcherLink
from tests import rawpeer
from tests.fakes import Stranger, dealer

STEPS = 3
PATIENT_MS = 5000


def _hybrid_job(tables: int, dim: int) -> JobSpec:
    return JobSpec(
        tables=tuple(TableConfig(f"t{i}", dim) for i in range(tables)),
        dense_dim=3,
        ps=("tcp://127.0.0.1:1",),
        mode=HybridSettings(),
    )


def test_the_bound_is_the_largest_ack_of_the_job():
    job = make_job()  # bsp: labels and predictions, float32 [rows]
    assert largest_frame_bytes(job, WORKERS, PER_WORKER) == PER_WORKER * 4
    assert largest_frame_bytes(_hybrid_job(3, 16), WORKERS, PER_WORKER) == PER_WORKER * 3 * 16 * 4  # + bag grads
    gba = JobSpec(tables=job.tables, dense_dim=3, ps=job.ps, mode=GbaSettings(buffer=1))
    assert largest_frame_bytes(gba, WORKERS, PER_WORKER) == WORKERS * PER_WORKER * 4  # one micro-batch per step
    assert largest_frame_bytes(job, WORKERS, 0) == 0  # batch size unknown: headers only


def test_an_oversized_message_is_dropped_unseen_and_the_job_goes_on(job_of):
    d, served, peers, _ = job_of(
        make_batches(STEPS), hello=(), peer_timeout_ms=PATIENT_MS, batch_size_per_worker=PER_WORKER
    )
    bound = wire.DISPATCH.max_frame_bytes(largest_frame_bytes(make_job(), WORKERS, PER_WORKER))
    stranger = Stranger(d.address)
    try:
        stranger.wait_handshake(WAIT_S)
        ack = wire.pack({"op": "ack", "rank": 0, "step": 0}, [np.zeros(PER_WORKER, np.float32)] * 2)
        stranger.sock.send_multipart([ack[0], bytes(bound + 1), ack[2]])  # delivered, it would count
        stranger.sock.send_multipart([b"\xc1"])  # undecodable: reaches the dispatcher once reconnected
        wait_rejected(d, {"undecodable": 1})  # and the oversized one was never counted: never seen
    finally:
        stranger.sock.close(linger=0)
    assert rawpeer.claim_frame(d.address, 3 << 30) < 16 << 20  # a 3 GB claim: cut off, not read
    time.sleep(0.2)
    assert d.rejected == {**dict.fromkeys(KINDS, 0), "undecodable": 1}
    for p in peers:
        p.hello()
    for p in peers:
        assert p.recv()[0]["op"] == "config"
    finish(served, peers)


def _drain(channel: PeerChannel, until, timeout_s: float = WAIT_S) -> None:
    """Let ``channel`` receive (and drop) until ``until()``; every drop is counted."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, f"counted {channel.rejected}"
        try:
            channel.recv("anything", time.monotonic() + 0.2)
        except PeerTimeout:
            pass


def test_the_largest_hybrid_ack_passes_and_one_row_more_does_not(tmp_path):
    rows, tables, dim = 128, 4, 1024  # bag gradients of 2 MiB: above the header's 1 MiB
    job = _hybrid_job(tables, dim)
    cfg = DispatcherConfig(num_workers=1, bind=f"ipc://{tmp_path}/d.ipc", batch_size_per_worker=rows)
    channel = PeerChannel(cfg, max_array_bytes=largest_frame_bytes(job, 1, rows))
    channel.peers.ack_grads = (tables, dim)  # as the hybrid embedding worker sets it (make_hybrid)
    stranger = Stranger(channel.address)
    worker = dealer(channel.address, b"worker-0")
    try:

        def ack(n: int) -> list:
            return wire.pack(
                {"op": "ack", "rank": 0, "step": 0},
                [
                    np.zeros(n, np.float32),
                    np.zeros(n, np.float32),
                    np.arange(n, dtype=np.uint64),
                    np.zeros((n, tables, dim), np.float32),
                ],
            )

        stranger.sock.send_multipart(ack(rows))  # the largest legitimate ack: delivered (from a stranger)
        _drain(channel, lambda: channel.rejected["unknown_peer"] == 1)
        stranger.sock.send_multipart(ack(rows + 1))
        stranger.sock.send_multipart([b"\xc1"])
        _drain(channel, lambda: channel.rejected["undecodable"] == 1)
        assert channel.rejected == {**dict.fromkeys(KINDS, 0), "unknown_peer": 1, "undecodable": 1}
        worker.send_multipart(wire.pack({"op": "hello", "rank": 0, "world_size": 1}))
        channel.wait_for_hellos()  # the role still serves its own worker
    finally:
        worker.close(linger=0)
        stranger.sock.close(linger=0)
        channel.close()


def test_the_dispatcher_sends_no_frame_a_worker_would_drop(tmp_path, monkeypatch):
    cfg = DispatcherConfig(num_workers=1, bind=f"ipc://{tmp_path}/d.ipc")
    channel = PeerChannel(cfg)
    monkeypatch.setattr(channel_mod, "MAX_WORKER_FRAME_BYTES", 1024)
    try:
        with pytest.raises(ConfigError, match="frame of 2048 bytes, more than the 1024 a worker accepts.*--batch-size"):
            channel.route(0, [b"header", np.zeros(2048, np.uint8)])
    finally:
        channel.close()
    link = DispatcherLink.connect(f"ipc://{tmp_path}/none.ipc", 0, timeout_ms=100)
    try:  # the worker's socket takes every frame a dispatcher may send it, and no more
        assert link.sock.getsockopt(zmq.MAXMSGSIZE) == wire.DISPATCH.max_frame_bytes(MAX_WORKER_FRAME_BYTES)
    finally:
        link.close()

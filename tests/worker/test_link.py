"""The worker's side of NOTE [dispatch protocol] (herald/worker/link.py): the handshake's
wait for the job is the start-up grace, not the step timeout."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from herald import wire
from herald.errors import PeerTimeout
from herald.worker import link as link_mod
from herald.worker.link import DispatcherLink


@pytest.fixture
def router():
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    yield sock
    sock.close(linger=0)


def test_the_job_may_come_later_than_the_step_timeout(router):
    """The dispatcher sends the config once the last worker said hello: a worker started
    first waits for it longer than --timeout-ms (max(timeout_ms, STARTUP_GRACE_MS))."""
    link = DispatcherLink.connect(router.getsockopt_string(zmq.LAST_ENDPOINT), 0, timeout_ms=200)
    got = {}
    thread = threading.Thread(target=lambda: got.update(job=link.handshake(1)), daemon=True)
    thread.start()
    assert router.poll(10_000)
    identity, *frames = router.recv_multipart()
    assert wire.unpack(frames)[0]["op"] == "hello"
    time.sleep(0.6)  # three step timeouts: the other workers are still starting
    router.send_multipart([identity, *wire.pack({"op": "config", "job": {"x": 1}})])
    thread.join(10)
    link.close()
    assert got == {"job": {"x": 1}}


def test_the_start_up_wait_still_ends(router, monkeypatch):
    monkeypatch.setattr(link_mod, "STARTUP_GRACE_MS", 300)
    link = DispatcherLink.connect(router.getsockopt_string(zmq.LAST_ENDPOINT), 0, timeout_ms=100)
    try:
        with pytest.raises(PeerTimeout, match="sent no config .* within 300 ms"):
            link.handshake(1)
    finally:
        link.close()

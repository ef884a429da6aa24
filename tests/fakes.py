"""Shared test fakes: the peers a test plays instead of a whole job.

Import them as ``from tests.fakes import ...`` (``tests/conftest.py`` puts the repository
root on ``sys.path``). Every wait here is bounded, so a broken protocol fails a test
instead of hanging it.

* :class:`InProcessPS`: real PS shards (:class:`ShardServer`) served on threads of the
  test process; :func:`shard_request`: one request handled by a ShardServer without a
  socket (:func:`as_frames`: the frames a ROUTER hands it).
* :class:`FakeDispatcher`: a scripted dispatcher, a ROUTER socket the test drives to play
  NOTE [dispatch protocol] against one real worker (:class:`ScheduledLoader`).
* :class:`ScriptedWorker`, :class:`Stranger`, :func:`dealer`: scripted workers and
  foreign peers (DEALER sockets) against one real :class:`Dispatcher`;
  :class:`ServedDispatcher` runs its ``serve()`` on a thread; :func:`drive`,
  :func:`cooperative` and :func:`all_ended` script the workers.
* :func:`thread_all_reduce`: a fake ``torch.distributed`` all-reduce (sum) across threads.
* :func:`wait_until`: poll a condition with a deadline.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from herald import wire
from herald.contracts.job import JobSpec
from herald.contracts.microbatch import MicroBatch
from herald.contracts.tables import TableConfig

if TYPE_CHECKING:
    import torch

    from herald.ps.server import ShardServer
    from herald.worker.api import ScheduledLoader


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.01) -> None:
    """Poll ``condition()`` every ``poll_s`` seconds until it is true.

    Raises:
        AssertionError: naming ``what`` (the awaited condition, in words), if it is still
            false after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)


# ------------------------------------------------------------------ in-process PS
class InProcessPS:
    """``num_shards`` PS shards served in the test process, one daemon thread each
    (``ShardServer.serve``), on free loopback ports; a context manager.

    Args:
        tables: the job's tables (:class:`TableConfig`), as a PS shard process gets them.
        num_shards: shards ``0 .. num_shards - 1`` of one PS; the keys are split among them
            as a job's client splits them.
        workdir: a folder for the shards' ready files (each holds its bound endpoint);
            None: a temporary folder removed by :meth:`stop`.
        seed: the shards' row-initialisation seed (same seed, same tables: same rows).
        start_timeout_s: longest wait for one shard to serve (a fresh clone compiles
            the shard's numba kernels first).
        limits: the shards' :class:`~herald.ps.config.ShardLimits` (None: the defaults).

    Attributes:
        addresses: ``tcp://127.0.0.1:<port>`` of each shard, in shard order (set once
            started: on ``__enter__`` or :meth:`start`).
        servers: the :class:`ShardServer` objects, to read their counters.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        num_shards: int = 1,
        workdir: pathlib.Path | None = None,
        seed: int = 0,
        start_timeout_s: float = 60.0,
        limits: Any = None,
    ):
        self.tables, self.num_shards, self.seed = tuple(tables), int(num_shards), int(seed)
        self.limits = limits
        self.start_timeout_s = start_timeout_s
        self._tmp = None if workdir is not None else tempfile.mkdtemp(prefix="herald-ps-")
        self.workdir = pathlib.Path(workdir if workdir is not None else self._tmp)
        self.servers: list[ShardServer] = []
        self.threads: list[threading.Thread] = []
        self.addresses: list[str] = []

    def start(self) -> InProcessPS:
        """Serve the shards one after the other; return once every one is serving."""
        from herald.ps.server import ShardServer

        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for s in range(self.num_shards):
                server = ShardServer(
                    s, self.num_shards, "tcp://127.0.0.1:*", self.tables, seed=self.seed, limits=self.limits
                )
                ready = self.workdir / f"ready-{s}"
                failed: list[BaseException] = []

                def serve(server=server, ready=ready, failed=failed) -> None:
                    try:
                        server.serve(ready_file=str(ready), poll_ms=20)
                    except BaseException as exc:  # named by start() or seen by the test's requests
                        failed.append(exc)
                        raise

                thread = threading.Thread(target=serve, daemon=True, name=f"ps-shard-{s}")
                thread.start()
                self.servers.append(server)
                self.threads.append(thread)
                wait_until(
                    lambda: ready.exists() or not thread.is_alive(),
                    self.start_timeout_s,
                    f"in-process PS shard {s} serving",
                )
                assert thread.is_alive(), f"in-process PS shard {s} ended before serving: {failed[:1]!r}"
                self.addresses.append(ready.read_text().strip())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask every shard to stop and join its thread (at most ``timeout_s`` each); idempotent."""
        for server in self.servers:
            server.stop()
        for thread in self.threads:
            thread.join(timeout_s)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> InProcessPS:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def as_frames(parts: Sequence[Any]) -> list[zmq.Frame]:
    """``parts`` (bytes, buffers such as numpy arrays, or zmq.Frame) as the zmq.Frame
    copies a ROUTER socket hands to ``ShardServer.handle``."""
    return [zmq.Frame(bytes(p.buffer if isinstance(p, zmq.Frame) else memoryview(p))) for p in parts]


def shard_request(server: ShardServer, header: dict, arrays: Sequence[np.ndarray] = ()) -> tuple[dict, list]:
    """One PS request handled by ``server`` (a :class:`ShardServer`, not serving) in this
    thread: the frames a client sends (``PS.pack(header, arrays)``) through
    ``server.handle``; returns its reply, ``PS.unpack``-ed to ``(header, arrays)``.

    Args:
        header: the request (``op``, ``rid``, ``cid``, ``parts``, ... as NOTE [ps wire
            protocol] has them), e.g. ``{"op": "pull", "rid": 1, "cid": 1, "parts":
            [{"table": 0}]}``.
        arrays: its arrays in order, e.g. the keys (uint64 [n]) and for a push the rows
            or gradients (float32 [n, width]).
    """
    from herald.ps.wire import PS

    return PS.unpack(as_frames(server.handle(as_frames(PS.pack(header, list(arrays))))))


# ------------------------------------------------------------- scripted dispatcher
class FakeDispatcher:
    """A scripted dispatcher: a ROUTER on a free loopback port that the test drives
    message by message (NOTE [dispatch protocol]) against one real worker.

    Args:
        worker: the routing identity of the worker it talks to (a ScheduledLoader of
            rank r connects as ``worker-<r>``).
        wait_s: default bound of :meth:`recv` and of :meth:`connect_loader`.

    Attributes:
        sock: the ROUTER socket (LINGER 0), e.g. to ``poll`` for "nothing sent".
        address: ``tcp://127.0.0.1:<port>``, what the worker connects to.
    """

    def __init__(self, worker: bytes = b"worker-0", wait_s: float = 5.0):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.worker, self.wait_s = worker, wait_s

    def send(self, header: dict, arrays: Sequence[np.ndarray] = ()) -> None:
        """Send one message (``wire.pack(header, arrays)``) to the worker; a micro-batch is
        ``send(*micro_batch.to_frames())``."""
        self.sock.send_multipart([self.worker, *wire.pack(header, list(arrays))], copy=False)

    def recv(self, timeout_s: float | None = None) -> tuple[dict, list]:
        """The worker's next message as ``(header, arrays)`` (``wire.unpack``).

        Raises:
            AssertionError: nothing came within ``timeout_s`` (default ``wait_s``), or it
                came from another identity than ``worker``.
        """
        timeout_s = self.wait_s if timeout_s is None else timeout_s
        if not self.sock.poll(int(timeout_s * 1e3)):
            raise AssertionError(f"the worker sent nothing within {timeout_s} s")
        ident, *frames = self.sock.recv_multipart()
        assert ident == self.worker, ident
        return wire.unpack(frames)

    def connect_loader(
        self, job: JobSpec | dict, *, rank: int = 0, world_size: int = 1, device: str = "cpu", **connect_kwargs
    ) -> ScheduledLoader:
        """``ScheduledLoader.connect(self.address, rank, world_size, device, **connect_kwargs)``
        on a thread while this dispatcher checks its hello and answers with ``{"op":
        "config", "job": job}`` (``job``: a :class:`JobSpec` or its ``to_dict()``, possibly
        altered). Returns the connected :class:`ScheduledLoader`.

        Raises:
            whatever ``connect`` raised (a ConfigError for a rejected job, ...).
            AssertionError: no hello, or connect still running after ``wait_s``.
        """
        from herald.worker.api import ScheduledLoader

        out: dict = {}

        def run():
            try:
                out["loader"] = ScheduledLoader.connect(
                    self.address, rank=rank, world_size=world_size, device=device, **connect_kwargs
                )
            except BaseException as exc:  # handed to the test thread
                out["error"] = exc

        thread = threading.Thread(target=run, daemon=True, name="connect")
        thread.start()
        header, _ = self.recv()
        assert (header["op"], header["rank"], header["world_size"]) == ("hello", rank, world_size), header
        self.send({"op": "config", "job": job if isinstance(job, dict) else job.to_dict()})
        thread.join(self.wait_s)
        assert not thread.is_alive(), f"ScheduledLoader.connect still running {self.wait_s} s after its config"
        if "error" in out:
            raise out["error"]
        return out["loader"]

    def close(self) -> None:
        self.sock.close(linger=0)


# ------------------------------------------------- scripted workers against a dispatcher
def dealer(address: str, identity: bytes, sndhwm: int | None = None, connect: bool = True) -> zmq.Socket:
    """A DEALER (LINGER 0) with routing ``identity``, connected to ``address`` (unless
    ``connect`` is False); with ``sndhwm``, at most that many messages queue before a
    send would block."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if sndhwm is not None:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.IDENTITY, identity)
    if connect:
        sock.connect(address)
    return sock


class ScriptedWorker:
    """A scripted worker of rank ``rank``: a DEALER with identity ``worker-<rank>``
    connected to a real dispatcher at ``address``; it remembers what it received.

    Args:
        log: a list shared by the test: gets ``(rank, "sent" | "got", op)`` of every message.
        world_size: the job's number of workers (in :meth:`hello`).
        rows: samples per micro-batch (checked on receipt; the length of an ack's arrays).
        wait_s: default bound of :meth:`recv`.
    """

    def __init__(self, address: str, rank: int, log: list, *, world_size: int, rows: int, wait_s: float = 30.0):
        self.rank, self.log, self.world_size, self.rows, self.wait_s = rank, log, world_size, rows, wait_s
        self.sock = dealer(address, f"worker-{rank}".encode())
        self.received: list[str] = []  # ops in arrival order
        self.steps: list[int] = []  # micro-batch steps in arrival order
        self.micro_batches: list[MicroBatch] = []
        self.sent_keys: set = set()  # (table, id) of every micro-batch received
        self.job: JobSpec | None = None
        self.ended: int | None = None  # the end message's step count
        self.error: str | None = None  # the dispatcher's error message

    def send(self, header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> None:
        self.log.append((self.rank, "sent", header["op"]))
        self.sock.send_multipart(wire.pack(header, list(arrays)), copy=False)

    def recv(self, timeout_s: float | None = None) -> tuple[dict, list]:
        """The dispatcher's next message (:meth:`take`), waiting at most ``timeout_s``
        (default ``wait_s``); AssertionError if none came."""
        timeout_s = self.wait_s if timeout_s is None else timeout_s
        if not self.sock.poll(int(timeout_s * 1e3)):
            raise AssertionError(
                f"peer {self.rank}: no message from the dispatcher within {timeout_s} s "
                f"(received so far: {self.received})"
            )
        return self.take()

    def take(self) -> tuple[dict, list]:
        """Decode one waiting message and remember what it was."""
        header, arrays = wire.unpack(self.sock.recv_multipart())
        op = header["op"]
        self.received.append(op)
        self.log.append((self.rank, "got", op))
        if op == "config":
            self.job = JobSpec.from_dict(header["job"])
        elif op == "microbatch":
            mb = MicroBatch.from_frames(header, arrays)
            assert mb.rank == self.rank and len(mb) == self.rows
            self.steps.append(mb.step)
            self.micro_batches.append(mb)
            for t in range(mb.num_tables):
                self.sent_keys |= {(t, int(i)) for i in mb.unique_ids[t]}
        elif op == "end":
            self.ended = header["steps"]
        elif op == "error":
            self.error = header["message"]
        return header, arrays

    def hello(self) -> None:
        self.send({"op": "hello", "rank": self.rank, "world_size": self.world_size})

    def ack(self, step: int, loss: float = 0.5) -> None:
        """Ack ``step`` with ``loss``, labels float32 [rows] (all = rank), predictions
        float32 [rows] (all 0.25), 10 + rank bytes pulled and 100 + rank pushed."""
        labels = np.full(self.rows, self.rank, np.float32)
        self.send(
            {
                "op": "ack",
                "rank": self.rank,
                "step": step,
                "loss": loss,
                "bytes_pulled": 10 + self.rank,
                "bytes_pushed": 100 + self.rank,
            },
            [labels, np.full(self.rows, 0.25, np.float32)],
        )

    def close(self) -> None:
        self.sock.close(linger=0)


class Stranger:
    """A DEALER that is not one of the job's workers, with any routing identity (a
    worker's own identity included: a ROUTER then keeps the first connection of that
    identity and never reads the second one's messages while the first is connected).

    Its sends are zero-copy, so that :meth:`send_all` can tell when libzmq wrote them to
    the connection, and a monitor sees its handshake (:meth:`wait_handshake`)."""

    def __init__(self, address: str, identity: bytes = b"stranger"):
        self.sock = dealer(address, identity, connect=False)
        self.sock.copy_threshold = 0  # no copy of small frames either: each send can be tracked
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._handshaken = False
        self.sock.connect(address)

    def wait_handshake(self, timeout_s: float) -> None:
        """Wait until this socket's ZMTP handshake with the peer at ``address`` succeeded:
        the connection is up at the peer's end.

        Raises:
            AssertionError: no handshake within ``timeout_s``.
        """
        if not self._handshaken:
            assert self._monitor.poll(int(timeout_s * 1e3)), f"no handshake with the peer within {timeout_s} s"
            recv_monitor_message(self._monitor)
            self._handshaken = True

    def send_all(self, messages: list[list[bytes]], wait_s: float | None = None) -> None:
        """Send each message (a list of frames, bytes) as it is. With ``wait_s``, then wait
        until libzmq wrote every message to the connection (each one's MessageTracker is
        done: it left this socket's queue), at most ``wait_s`` seconds in all.

        Raises:
            AssertionError: a message still queued after ``wait_s`` (no connection).
        """
        track = wait_s is not None
        trackers = [self.sock.send_multipart(frames, copy=False, track=track) for frames in messages]
        if track:
            deadline = time.monotonic() + wait_s
            for tracker in trackers:
                try:
                    tracker.wait(max(0.0, deadline - time.monotonic()))
                except zmq.NotDone:
                    raise AssertionError(f"a message was still queued after {wait_s} s: no connection") from None

    def got_nothing(self, wait_ms: int = 100) -> bool:
        """Whether no message came within ``wait_ms``."""
        return not self.sock.poll(wait_ms)

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)


class ServedDispatcher:
    """``dispatcher.serve()`` on a daemon thread; its result (list of StepRecord) or
    exception is kept, and ``ended_at`` (``time.monotonic()``) once it returned."""

    def __init__(self, dispatcher, wait_s: float = 30.0):
        self.dispatcher, self.wait_s = dispatcher, wait_s
        self.result: list | None = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="dispatcher-serve")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.dispatcher.serve()
        except BaseException as exc:  # handed to the test thread
            self.error = exc
        finally:
            self.ended_at = time.monotonic()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for ``serve()`` to return (at most ``timeout_s``, default ``wait_s``)."""
        timeout_s = self.wait_s if timeout_s is None else timeout_s
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"serve() still running after {timeout_s} s"


def drive(
    peers: Sequence[ScriptedWorker],
    react: Callable[[ScriptedWorker, dict, list], None],
    until: Callable[[], bool],
    timeout_s: float = 30.0,
) -> None:
    """Deliver every dispatcher message to ``react(peer, header, arrays)`` until ``until()``.

    Raises:
        AssertionError: a peer received an error, or ``until()`` is still false after
            ``timeout_s``.
    """
    poller = zmq.Poller()
    for p in peers:
        poller.register(p.sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"script did not finish within {timeout_s} s; received: {[p.received for p in peers]}")
        ready = dict(poller.poll(50))
        for p in peers:
            if p.sock in ready:
                header, arrays = p.take()
                if p.error is not None:
                    raise AssertionError(f"peer {p.rank}: the dispatcher failed: {p.error}")
                react(p, header, arrays)


def cooperative(p: ScriptedWorker, header: dict, arrays: list = ()) -> None:
    """A well-behaved worker (a ``react`` of :func:`drive`): ack every step at once with
    loss 0.5 + rank, answer flush and save."""
    op = header["op"]
    if op == "microbatch":
        p.ack(header["step"], loss=0.5 + p.rank)
    elif op == "flush":
        p.send({"op": "flushed", "rank": p.rank})
    elif op == "save":
        p.send({"op": "saved", "rank": p.rank})


def all_ended(peers: Sequence[ScriptedWorker]) -> Callable[[], bool]:
    """An ``until`` of :func:`drive`: every peer received its end message."""
    return lambda: all(p.ended is not None for p in peers)


# ------------------------------------------------------------------ thread all-reduce
def thread_all_reduce(n: int, timeout_s: float = 20.0) -> Callable[[torch.Tensor], None]:
    """A fake ``torch.distributed.all_reduce`` (SUM) over ``n`` threads, as in the
    leaders' group: each of ``n`` threads calls ``reduce(t)`` once per round with a tensor
    of the same shape and dtype (e.g. float32 [k]); every call blocks until all ``n``
    arrived (a :class:`threading.Barrier`, broken after ``timeout_s``), then ``t`` holds
    the sum in place."""
    import torch

    parts, total = [], {}

    def combine():
        total["sum"] = torch.stack(parts).sum(0)
        parts.clear()

    barrier, lock = threading.Barrier(n, action=combine, timeout=timeout_s), threading.Lock()

    def reduce(t: torch.Tensor) -> None:
        with lock:
            parts.append(t.clone())
        barrier.wait()
        t.copy_(total["sum"])

    return reduce

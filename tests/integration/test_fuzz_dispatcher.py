"""``herald train`` with a hostile peer on the dispatcher's port (NOTE [peer
validation] in herald/dispatch/peers.py): while a real 2-worker job trains (PS shard
processes, worker processes, the dispatcher), a fuzzer thread hammers the dispatcher's
port with garbage frames, malformed headers, unknown ops, bad fields, forged acks,
errors and hellos from foreign identities, a worker's identity reused by a stranger, and
raw TCP bytes. The job must finish, count what it dropped in its report, and train
exactly the model of the single-process reference (the tolerances of
test_train_exact.py).
"""

from __future__ import annotations

import itertools
import pathlib
import secrets
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from herald.contracts.train import TrainConfig
from herald.dispatch.dispatcher import Dispatcher
from herald.dispatch.peers import KINDS
from herald.job import launcher
from herald.job.launcher import run_train
from herald.job.reference import train_reference
from herald.loader import GlobalBatcher, open_source
from herald.loader.splits import RowRange
from herald.ps import PSClient

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "dispatch"))
import hostile  # tests/dispatch/hostile.py: the catalogue of bad messages
from test_train_exact import assert_matches_reference

from tests.fakes import dealer

pytestmark = pytest.mark.integration

WORKERS, BATCH, STEPS = 2, 8, 20
PAUSE_S = 0.004  # between two fuzzer messages: a steady stream that leaves the 2 cores to the job


class Fuzzer:
    """Hammers one dispatcher from a thread until :meth:`stop`.

    Before the handshake is over it sends nothing that could take a rank (a stranger's
    valid hello would win it: binding is first-come, NOTE [peer validation]); once the
    first step is acked it also sends valid hellos for every rank and speaks with the
    workers' own identities (``worker-<rank>``) from connections of its own.
    """

    def __init__(self):
        self.dispatcher: Dispatcher | None = None
        self.attached = threading.Event()
        self.halt = threading.Event()
        self.hellos_sent = threading.Event()  # forged hellos for every rank, once the handshake is over
        self.sent = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="fuzzer", daemon=True)
        self.thread.start()

    def attach(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.attached.set()

    def stop(self) -> None:
        self.halt.set()
        self.thread.join(10)

    def _main(self) -> None:
        try:
            if self.attached.wait(120):
                self._hammer(self.dispatcher.address)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _messages(self, late: bool) -> list[list[bytes]]:
        out = hostile.undecodable() + hostile.unknown_ops()
        for rank in range(WORKERS):
            out += hostile.bad_fields(rank, WORKERS, BATCH) + hostile.claims(rank, BATCH, step=rank)
        return out + (hostile.hellos(WORKERS) if late else [])

    def _hammer(self, address: str) -> None:
        socks: list[zmq.Socket] = []
        try:
            for rnd in itertools.count():
                if self.halt.is_set():
                    return
                late = bool(self.dispatcher.records)  # the handshake is over
                if late and len(socks) < 6:  # the workers' identities, reused by strangers
                    socks.append(self._dealer(address, f"worker-{len(socks) % WORKERS}".encode()))
                socks.append(self._dealer(address, secrets.token_bytes(1 + rnd % 40).lstrip(b"\x00") or b"z"))
                sock = socks[-1]
                messages = self._messages(late)
                for frames in messages:
                    if self.halt.is_set():
                        return
                    if not self.hellos_sent.is_set() and self.dispatcher.records:
                        self._forge_hellos(address)
                    self._send(socks[rnd % len(socks)] if late else sock, frames)
                    time.sleep(PAUSE_S)
                raw = hostile.zmtp10(messages[::3])
                try:
                    hostile.send_raw_tcp(address, raw if rnd % 2 else hostile.NOISE[rnd % len(hostile.NOISE)])
                except OSError:  # the job ended and its port closed before on_finish stopped us
                    pass
                if len(socks) > 12:
                    socks.pop(len(socks) - 12).close(linger=0)
        finally:
            for s in socks:
                s.close(linger=0)

    def _forge_hellos(self, address: str) -> None:
        """Valid hellos for every rank from a stranger, as soon as the ranks are bound."""
        sock = self._dealer(address, b"stranger")
        try:
            for frames in hostile.hellos(WORKERS):
                sock.send_multipart(frames)  # a fresh socket's queue is empty: never blocks here
                self.sent += 1
        finally:
            sock.close(linger=1000)
        self.hellos_sent.set()

    @staticmethod
    def _dealer(address: str, identity: bytes) -> zmq.Socket:
        return dealer(address, identity, sndhwm=100)  # tests/fakes.py

    def _send(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:  # the dispatcher reads at its own pace: a full queue drops the message
            pass


def test_training_under_a_hostile_peer_finishes_and_equals_single_process(tmp_path, data_dir, monkeypatch):
    source = str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv")
    cfg = TrainConfig.from_flags(
        source=source,
        schedule="herald",
        workers=WORKERS,
        batch_size=BATCH,
        cache_rows=260,
        embedding_dim=4,
        optimizer="adagrad",
        lr=0.01,
        dense_optimizer="sgd",
        dense_lr=0.05,
        model="dlrm",
        steps=STEPS,
        eval_fraction=0.0,
        seed=3,
        run_dir=str(tmp_path),
        timeout_ms=60_000,
    )
    fuzzer = Fuzzer()

    class Watched(Dispatcher):  # the real dispatcher; its address goes to the fuzzer
        def __init__(self, *args, on_step=None, **kwargs):
            def paced(*a, **k):  # the first acked step waits (bounded) for the forged hellos
                fuzzer.hellos_sent.wait(10)
                return on_step(*a, **k) if on_step is not None else None

            super().__init__(*args, on_step=paced, **kwargs)
            fuzzer.attach(self)

    monkeypatch.setattr(launcher, "Dispatcher", Watched)
    seen: dict = {}

    def grab(addresses, job):  # the trained rows, read while the PS shards are up
        fuzzer.stop()
        tables = list(job.tables)
        ref_model, ref_rows = _reference(job, source)
        seen["ref_model"] = ref_model
        by_table: dict[int, list[int]] = {}
        for t, k in ref_rows:
            by_table.setdefault(t, []).append(k)
        with PSClient(addresses, tables=tables, timeout_ms=10_000, keys_dir=job.keys_dir) as client:
            got = client.pull_async({t: np.array(ks, np.uint64) for t, ks in by_table.items()}).wait()
        dim = tables[0].dim
        pairs = [(got[t][i], ref_rows[(t, k)]) for t, ks in by_table.items() for i, k in enumerate(ks)]
        seen["diff"] = max(float(np.abs(a[:dim] - b[:dim]).max()) for a, b in pairs)
        seen["state_rel"] = max(
            float((np.abs(a[dim:] - b[dim:]) / np.maximum(1.0, np.abs(b[dim:]))).max()) for a, b in pairs
        )

    try:
        rep = run_train(cfg, progress=False, on_finish=grab)
    finally:
        fuzzer.stop()
    assert fuzzer.error is None, fuzzer.error
    assert rep["steps"] == STEPS
    rejected = rep["rejected"]
    assert set(rejected) == set(KINDS)
    for kind in ("undecodable", "unknown_op", "bad_field", "unknown_peer", "duplicate_hello"):
        assert rejected[kind] > 0, f"the fuzzer sent no {kind} message the dispatcher read: {rejected}"
    assert rejected["wrong_identity"] == 0, "only a bound worker can send in another rank's name"
    assert fuzzer.sent >= 100
    assert "messages the dispatcher dropped" in (tmp_path / "report.txt").read_text()
    assert_matches_reference(seen, tmp_path, workers=2)


def _reference(job, source):
    src = RowRange(open_source(source), 0, STEPS * WORKERS * BATCH)
    with GlobalBatcher(src, WORKERS * BATCH, drop_last=True) as batcher:
        batches = list(itertools.islice(batcher, STEPS))
    return train_reference(job, batches)

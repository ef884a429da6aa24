"""One worker step without a whole job: a :class:`ScheduledLoader` against a scripted
dispatcher and one in-process PS shard (FakeDispatcher and InProcessPS, tests/fakes.py).

The test plays the dispatcher's side of NOTE [dispatch protocol] message by message
and checks what the worker did to its cache and to the PS against NOTE [step protocol]
(``herald/contracts/plan.py``): keys only this worker used are updated in the cache and
not at the PS (until a flush writes them back); keys in ``grad_push`` are updated at
the PS by the same optimizer kernel. Every wait is bounded.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from herald.contracts.job import JobSpec
from herald.contracts.microbatch import MicroBatch, make_sample_ids
from herald.contracts.plan import CachePlan, KeySet
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.dispatch.microbatch import build_microbatch
from herald.errors import ConfigError, HeraldError, PeerTimeout, ProtocolError
from herald.loader.batch import SampleBatch
from herald.ps import PSClient, apply_gradients
from herald.worker import link as link_mod
from herald.worker.api import ScheduledLoader
from tests.fakes import FakeDispatcher, InProcessPS

OPT = OptimizerConfig("rowwise_adagrad", lr=0.1)  # stateful: the row's accumulator changes too
TABLES = (TableConfig("user", 4, OPT), TableConfig("item", 4, OPT))
DENSE_DIM = 2
WAIT_S = 5.0
LOADER_TIMEOUT_MS = 500
# A wait that honours LOADER_TIMEOUT_MS lasts at least that long, names it in its error, and
# ends long before the 120 s default timeout: this generous bound only tells the two apart
# (a loaded machine delays a wake-up by seconds, not minutes).
HONOURED_S = 30.0


@pytest.fixture(scope="module")
def ps_address(tmp_path_factory) -> str:
    """One PS shard served in-process on a thread; stopped afterwards."""
    with InProcessPS(TABLES, workdir=tmp_path_factory.mktemp("ps")) as ps:
        yield ps.addresses[0]


@pytest.fixture
def ps(ps_address):
    """The test's own client of the shard: reads rows without going through the worker."""
    with PSClient([ps_address], TABLES, timeout_ms=2000) as client:
        yield client


@pytest.fixture
def dispatcher():
    """A scripted dispatcher for worker-0 (tests/fakes.py)."""
    d = FakeDispatcher(wait_s=WAIT_S)
    yield d
    d.close()


def make_job(ps_address: str) -> JobSpec:
    return JobSpec(
        tables=TABLES, dense_dim=DENSE_DIM, ps=(ps_address,), timeout_ms=2000, capacity_rows=16, num_workers=1
    )


def connect(dispatcher: FakeDispatcher, ps_address: str, cache_device: str = "auto") -> ScheduledLoader:
    """``ScheduledLoader.connect`` on a thread while the test answers its hello with the job."""
    loader = dispatcher.connect_loader(make_job(ps_address), cache_device=cache_device, timeout_ms=LOADER_TIMEOUT_MS)
    assert loader.job == make_job(ps_address) and loader.dim == 4
    return loader


def micro_batch(step: int, base: int) -> tuple[MicroBatch, KeySet, KeySet]:
    """Two samples: table 0 ("user") ids ``base+1``, ``base+2``, one per sample, in
    ``update_local`` (keys only this worker uses); table 1 ("item") id ``base+3`` in both
    samples, in ``grad_push`` with one contributor (as for a key workers share). All pulled.

    Returns the micro-batch, its update_local keys and its grad_push keys.
    """
    u1, u2, item = (np.uint64(base + k) for k in (1, 2, 3))
    batch = SampleBatch(
        np.array([1.0, 0.0], np.float32),
        np.array([[0.5, -1.0], [2.0, 0.25]], np.float32),
        [np.array([u1, u2], np.uint64), np.array([item, item], np.uint64)],
        [np.array([0, 1, 2], np.int64), np.array([0, 1, 2], np.int64)],
    )
    local = KeySet(np.array([0, 0], np.int32), np.array([u1, u2], np.uint64))
    shared = KeySet(np.array([1], np.int32), np.array([item], np.uint64))
    pull = KeySet(np.concatenate([local.table, shared.table]), np.concatenate([local.ids, shared.ids]))
    plan = CachePlan(KeySet.empty(), np.zeros(0, bool), pull, shared, np.array([1], np.uint16), local, KeySet.empty())
    return build_microbatch(step, 0, batch, make_sample_ids(0, 2 * step, 2), plan), local, shared


def forward_backward(loader: ScheduledLoader, batch, model: torch.nn.Module) -> torch.Tensor:
    pooled = loader.embedding()(batch)  # [b, T, dim]
    assert tuple(pooled.shape) == (2, len(TABLES), 4)
    logits = model(torch.cat([batch.dense, pooled.flatten(1)], dim=1)).squeeze(-1)
    loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
    loss.backward()
    return loss


def tiny_model(loader: ScheduledLoader) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(DENSE_DIM + len(TABLES) * 4, 1)
    loader.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return model


def ps_rows(ps: PSClient, keys: KeySet) -> np.ndarray:
    return np.concatenate([np.array(ps.pull(int(t), keys.ids[keys.table == t])) for t in np.unique(keys.table)])


def cached_rows(loader: ScheduledLoader, keys: KeySet) -> np.ndarray:
    cache = loader.executor.cache
    return cache.read(cache.slots(keys))


# -------------------------------------------------------------- one full step
# NOTE [cache interface]: the host cache (auto on the CPU) and the torch cache behave alike
@pytest.mark.parametrize("cache_device,base", [("auto", 1000), ("torch", 2000)])
def test_step_updates_local_keys_in_cache_and_shared_keys_at_the_ps(dispatcher, ps_address, ps, cache_device, base):
    loader = connect(dispatcher, ps_address, cache_device)
    try:
        assert type(loader.executor.cache).__name__ == {"auto": "EmbeddingCache", "torch": "DeviceCache"}[cache_device]
        model = tiny_model(loader)
        mb, local, shared = micro_batch(step=3, base=base)
        before_local, before_shared = ps_rows(ps, local), ps_rows(ps, shared)
        dispatcher.send(*mb.to_frames())
        it = iter(loader)
        batch = next(it)
        assert batch.step == 3 and np.array_equal(batch.sample_ids, mb.sample_ids)
        # steps 1-2 (pull): the cache holds the PS rows, optimizer state included
        np.testing.assert_array_equal(cached_rows(loader, local), before_local)
        np.testing.assert_array_equal(cached_rows(loader, shared), before_shared)

        loss = forward_backward(loader, batch, model)
        grads = batch.rows.rows.grad.numpy()
        g_local, g_shared = grads[batch.rows.positions(local)], grads[batch.rows.positions(shared)]
        assert np.abs(g_local).min(axis=1).all() and np.abs(g_shared).min() > 0
        loader.step(loss)

        ack, arrays = dispatcher.recv()
        assert (ack["op"], ack["rank"], ack["step"]) == ("ack", 0, 3) and arrays == []
        assert ack["loss"] == pytest.approx(float(loss.detach()))
        assert ack["bytes_pulled"] > 0 and ack["bytes_pushed"] > 0
        assert loader.steps == 1

        # update_local: the cached rows took the step, the PS copies did not
        want_local = apply_gradients(before_local.copy(), np.ascontiguousarray(g_local), TABLES[0])
        cached_local = cached_rows(loader, local)
        np.testing.assert_allclose(cached_local, want_local, atol=1e-6, rtol=0)
        assert not np.allclose(cached_local, before_local)
        np.testing.assert_array_equal(ps_rows(ps, local), before_local)
        # grad_push: the PS applied the same kernel to the row it held
        want_shared = apply_gradients(before_shared.copy(), np.ascontiguousarray(g_shared), TABLES[1])
        np.testing.assert_allclose(ps_rows(ps, shared), want_shared, atol=1e-6, rtol=0)
        assert not np.allclose(want_shared, before_shared)

        # flush of one only-latest key (with reset), then end
        first = KeySet(local.table[:1], local.ids[:1])
        dispatcher.send({"op": "flush", "reset": True}, [first.table, first.ids])
        dispatcher.send({"op": "end", "steps": 4})
        with pytest.raises(StopIteration):
            next(it)
        flushed, _ = dispatcher.recv()
        assert (flushed["op"], flushed["rank"]) == ("flushed", 0)
        np.testing.assert_allclose(ps_rows(ps, first), cached_local[:1], atol=0, rtol=0)
        rest = KeySet(local.table[1:], local.ids[1:])
        np.testing.assert_array_equal(ps_rows(ps, rest), before_local[1:])  # not flushed: still stale
        assert len(loader.executor.cache) == 0  # reset emptied the cache
        assert not dispatcher.sock.poll(100), "nothing after flushed"
    finally:
        loader.close()


# ------------------------------------------------------------- misuse, errors
def test_step_without_an_embedding_call_raises_and_sends_no_ack(dispatcher, ps_address):
    loader = connect(dispatcher, ps_address)
    try:
        tiny_model(loader)
        mb, _, _ = micro_batch(step=0, base=2000)
        dispatcher.send(*mb.to_frames())
        next(iter(loader))
        with pytest.raises(HeraldError, match="embedding"):
            loader.step(0.5)
        assert not dispatcher.sock.poll(200), "a step that did not happen was acked"
        assert loader.steps == 0
    finally:
        loader.close()


def test_silent_dispatcher_at_connect_is_a_peer_timeout_naming_it(dispatcher, monkeypatch):
    # the wait for the job is the start-up grace (herald/worker/link.py; 60 s in a job), shortened here
    grace_ms = 2 * LOADER_TIMEOUT_MS
    monkeypatch.setattr(link_mod, "STARTUP_GRACE_MS", grace_ms)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout) as info:
        ScheduledLoader.connect(dispatcher.address, rank=0, world_size=1, device="cpu", timeout_ms=LOADER_TIMEOUT_MS)
    waited = time.monotonic() - t0
    assert 0.8 * grace_ms / 1e3 <= waited < HONOURED_S, waited
    assert f"{grace_ms} ms" in str(info.value)
    assert dispatcher.address in str(info.value) and info.value.peer == dispatcher.address
    assert "config" in str(info.value)
    assert dispatcher.recv()[0]["op"] == "hello"
    header, _ = dispatcher.recv()  # a late dispatcher still learns why
    assert (header["op"], header["rank"]) == ("error", 0) and "PeerTimeout" in header["message"]


def test_rejected_job_at_connect_is_reported_to_the_dispatcher(dispatcher, ps_address):
    with pytest.raises(ConfigError):
        dispatcher.connect_loader({**make_job(ps_address).to_dict(), "version": 99}, timeout_ms=LOADER_TIMEOUT_MS)
    header, _ = dispatcher.recv()
    assert (header["op"], header["rank"]) == ("error", 0)
    assert "ConfigError" in header["message"] and "version 99" in header["message"]


def test_silent_dispatcher_mid_job_is_a_peer_timeout_and_the_worker_reports_it(dispatcher, ps_address):
    loader = connect(dispatcher, ps_address)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout) as info:
            next(iter(loader))
        waited = time.monotonic() - t0
        assert 0.8 * LOADER_TIMEOUT_MS / 1e3 <= waited < HONOURED_S, waited
        assert dispatcher.address in str(info.value) and f"{LOADER_TIMEOUT_MS} ms" in str(info.value)
        header, _ = dispatcher.recv()
        assert (header["op"], header["rank"]) == ("error", 0) and "PeerTimeout" in header["message"]
    finally:
        loader.close()


def test_a_send_with_no_dispatcher_connected_is_a_bounded_peer_timeout(dispatcher, ps_address):
    """A DEALER with no connected peer (here disconnected; in a job, a dispatcher that
    refused this worker's CURVE handshake) blocks on send: the wait is the loader's timeout."""
    loader = connect(dispatcher, ps_address)
    try:
        loader.link.sock.disconnect(dispatcher.address)
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout, match="took no message within") as info:
            loader.link.send_saved()
        assert time.monotonic() - t0 < HONOURED_S
        assert f"{LOADER_TIMEOUT_MS} ms" in str(info.value) and info.value.peer == dispatcher.address
    finally:
        loader.close()


def test_unknown_op_is_a_protocol_error_reported_to_the_dispatcher_first(dispatcher, ps_address):
    loader = connect(dispatcher, ps_address)
    try:
        dispatcher.send({"op": "frobnicate"})
        with pytest.raises(ProtocolError, match="'frobnicate'"):
            next(iter(loader))
        header, _ = dispatcher.recv()  # sent before the error was raised
        assert (header["op"], header["rank"]) == ("error", 0)
        assert "ProtocolError" in header["message"] and "frobnicate" in header["message"]
    finally:
        loader.close()


def test_dispatcher_error_message_ends_the_worker_naming_it(dispatcher, ps_address):
    loader = connect(dispatcher, ps_address)
    try:
        dispatcher.send({"op": "error", "message": "PeerTimeout: worker 1 is gone"})
        with pytest.raises(HeraldError, match="worker 1 is gone") as info:
            next(iter(loader))
        assert dispatcher.address in str(info.value)
    finally:
        loader.close()

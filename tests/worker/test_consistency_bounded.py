"""NOTE [bounded reads]: HET's CheckValid, the key-set membership it relies on, and a
worker's stale reads against an in-process PS shard (read-my-updates, no lost update)."""

import numpy as np
import pytest
import torch

from herald.contracts.job import JobSpec
from herald.contracts.microbatch import MicroBatch, make_sample_ids
from herald.contracts.modes import consistency_mode
from herald.contracts.plan import CachePlan, KeySet
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.dispatch.microbatch import build_microbatch
from herald.errors import ProtocolError
from herald.loader.batch import SampleBatch
from herald.worker import psio
from herald.worker.clocks import CopyClocks, check_valid
from herald.worker.consistency_bounded import Bounded
from herald.worker.executor import PlanExecutor
from herald.worker.modes import PROTOCOLS
from herald.worker.psio import member
from tests.fakes import InProcessPS


def _u(*v):
    return np.array(v, np.uint64)


def test_check_valid_is_hets_two_conditions():
    # c_s, c_c, c_g; s = 2
    c_s, c_c, c_g = _u(5, 5, 5, 5, 5), _u(5, 7, 8, 5, 5), _u(5, 7, 8, 7, 8)
    assert check_valid(c_s, c_c, c_g, 2).tolist() == [True, True, False, True, False]
    # s = 0: only a copy as recent as the PS (and without unsynchronised local updates)
    assert check_valid(c_s, c_c, c_g, 0).tolist() == [True, False, False, False, False]


def test_member_matches_table_and_id():
    keys = KeySet(np.array([0, 1, 1, 2], np.int32), _u(7, 7, 9, 7))
    of = KeySet(np.array([1, 2, 0], np.int32), _u(7, 8, 9))
    assert member(keys, of).tolist() == [False, True, False, False]
    assert member(keys, KeySet.empty()).tolist() == [False] * 4


def test_bounded_is_registered():
    assert PROTOCOLS[consistency_mode("bounded").name] is Bounded


# ---------------------------------------------------------------- read-my-updates (docs/consistency.md)
# A worker and an in-process PS shard: a stale copy read instead of pulled must hold the
# worker's own updates (Het.Write, HET §3.3), and no update may be lost or doubled.

OPT = OptimizerConfig("sgd", lr=0.5)
TABLES = (TableConfig("item", 4, OPT),)


@pytest.fixture(scope="module")
def ps_address(tmp_path_factory) -> str:
    """One PS shard served in-process on a thread; stopped afterwards."""
    with InProcessPS(TABLES, workdir=tmp_path_factory.mktemp("ps")) as ps:
        yield ps.addresses[0]


def _step(protocol: Bounded, step: int, item: int, evict: bool = False) -> torch.Tensor:
    """One step of a lone worker on key (0, item), which the plan pulls (the dispatcher
    counts the copy stale after every gradient push) and pushes as a gradient; with
    ``evict`` the copy is dropped first, without write-back (it is not the only latest one).
    Returns the rows the forward read (float32 [1, 4])."""
    key = KeySet(np.array([0], np.int32), _u(item))
    plan = CachePlan(
        key if evict else KeySet.empty(),
        np.zeros(int(evict), bool),
        key,
        key,
        np.array([1], np.uint16),
        KeySet.empty(),
        KeySet.empty(),
    )
    batch = SampleBatch(
        np.array([1.0], np.float32), np.zeros((1, 1), np.float32), [_u(item)], [np.array([0, 1], np.int64)]
    )
    mb = build_microbatch(step, 0, batch, make_sample_ids(0, step, 1), plan)
    protocol.before_forward(mb)
    pooled, rows = protocol.lookup(mb)
    read = rows.rows.detach().clone()
    ((pooled - 1.0) ** 2).sum().backward()  # a gradient that depends on the row read
    protocol.after_backward(mb, rows)
    return read


def test_a_stale_read_holds_the_workers_own_updates_and_none_is_lost(ps_address):
    """A copy read stale (pull skipped) used to stay frozen at its fetch, missing
    the worker's own updates too, so the hottest keys trained on gradients up to s steps
    delayed (Avazu DeepFM AUC 0.60 against BSP's 0.74 at s = 4). With one worker its own
    updates are all there are: every read must equal the PS row exactly, the PS must
    receive every gradient once, and the copy must be re-fetched after s local updates."""
    job = JobSpec(tables=TABLES, dense_dim=1, ps=(ps_address,), timeout_ms=2000, capacity_rows=8, num_workers=1)
    ex = PlanExecutor(job, 0, 1, torch.device("cpu"), cache_device="cpu")
    key = KeySet(np.array([0], np.int32), _u(11))
    try:
        protocol = Bounded(ex, staleness=2)
        for step in range(6):
            ps_row = psio.pull_keys(ex.ps, key, ex.cache.row_width)[:, :4]
            read = _step(protocol, step, 11)
            assert np.array_equal(read.numpy(), ps_row), f"step {step}: the read missed the worker's own updates"
        stats = protocol.take_stats()
        assert stats["stale_reads"] == 4 and stats["rereads"] == 1  # fetch, 2 stale reads, reread, 2 stale reads
        assert stats.get("gap_max", 0) == 0  # nothing is missing: no other worker
        cached = ex.cache.read(ex.cache.slots(key))
        assert np.array_equal(cached, psio.pull_keys(ex.ps, key, ex.cache.row_width))
        handle, _ = ex.ps.pull_clocked_async({0: (key.ids, _u())}, 0)
        assert handle.wait()[0][0][0].tolist() == [6]  # c_g: one application per step
        _step(protocol, 6, 11, evict=True)  # dropped without write-back, pulled again: the PS copy is latest
        assert np.array_equal(ex.cache.read(ex.cache.slots(key)), psio.pull_keys(ex.ps, key, ex.cache.row_width))
    finally:
        ex.close()


def _pulled_mb(step: int, item: int, early: bool) -> MicroBatch:
    """A micro-batch that pulls key (0, item) and pushes it as a gradient (a shared key),
    its pull marked ``pull_early`` when ``early``."""
    key = KeySet(np.array([0], np.int32), _u(item))
    plan = CachePlan(
        KeySet.empty(), np.zeros(0, bool), key, key, np.array([1], np.uint16), KeySet.empty(), KeySet.empty()
    )
    batch = SampleBatch(
        np.array([1.0], np.float32), np.zeros((1, 1), np.float32), [_u(item)], [np.array([0, 1], np.int64)]
    )
    return build_microbatch(step, 0, batch, make_sample_ids(0, step, 1), plan, pull_early=np.array([early]))


def test_the_clocks_prefetch_shared_pulls_with_their_clock_and_refuse_one_without(ps_address):
    """The executor moves rows only: a shared pull prefetched through the clocks comes with
    its c_g (known afterwards), one prefetched plainly cannot be checked later (a bug of the
    protocol, refused by name)."""
    job = JobSpec(tables=TABLES, dense_dim=1, ps=(ps_address,), timeout_ms=2000, capacity_rows=8, num_workers=1)
    ex = PlanExecutor(job, 0, 1, torch.device("cpu"), cache_device="cpu")
    try:
        clocks = CopyClocks(ex, 2)
        mb = _pulled_mb(0, 21, early=True)
        clocks.prefetch(mb)
        assert ex.early.prefetched(0).tolist() == [True]
        gaps, rereads = clocks.pull(mb)
        assert (gaps.shape, rereads, ex.early.prefetched(0)) == ((0,), 0, None)
        assert clocks.known[ex.cache.slots(mb.plan.pull)].tolist() == [True]  # came with its clock
        plain = _pulled_mb(1, 22, early=True)
        ex.early.prefetch(plain)  # without the clocks' fetch: no clock comes
        with pytest.raises(ProtocolError, match="prefetched without it"):
            clocks.pull(plain)
    finally:
        ex.close()

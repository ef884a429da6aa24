"""NOTE [hybrid training] (herald/dispatch/hybrid.py): the ID-feature buffer resolves sample
ids, bag gradients expand to their ids, sums per key, expiry, staleness, the push thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from herald.contracts.microbatch import make_sample_ids
from herald.contracts.plan import CachePlan, KeySet
from herald.dispatch.hybrid import (
    GradientPusher,
    HybridEmbeddingWorker,
    expand_gradients,
    merge_ranks,
    rank_key_sums,
    step_union,
    sum_per_key,
)
from herald.dispatch.idbuffer import IdFeatureBuffer
from herald.dispatch.microbatch import build_microbatch
from herald.errors import HeraldError, PeerTimeout, ProtocolError
from herald.loader.batch import SampleBatch


def _plan():
    e = KeySet.empty()
    return CachePlan(e, np.zeros(0, bool), e, e, np.zeros(0, np.uint16), e, e)


def _mb(step, rank, first_seq, values, offsets):
    """One micro-batch of len(offsets[0]) - 1 samples; ``values``/``offsets`` per table."""
    b = len(offsets[0]) - 1
    batch = SampleBatch(
        np.zeros(b, np.float32),
        np.zeros((b, 0), np.float32),
        [np.array(v, np.uint64) for v in values],
        [np.array(o, np.int64) for o in offsets],
    )
    return build_microbatch(step, rank, batch, make_sample_ids(0, first_seq, b), _plan())


# step 5: rank 0 has samples 0-1, rank 1 samples 2-3; two tables
MB0 = _mb(5, 0, 0, [[7, 9, 7], [4, 4]], [[0, 2, 3], [0, 1, 2]])  # s0: {7, 9} {4}; s1: {7} {4}
MB1 = _mb(5, 1, 2, [[9], [8, 4, 2**64 - 1]], [[0, 1, 1], [0, 2, 3]])  # s2: {9} {8, 4}; s3: {} {2^64-1}


def _buffer():
    buf = IdFeatureBuffer(100)
    buf.put(5, [MB0, MB1])
    return buf


def test_buffer_resolves_sample_ids_to_rank_and_row():
    buf = _buffer()
    ids = np.concatenate([MB1.sample_ids[::-1], MB0.sample_ids, np.array([999], np.uint64)])
    got = buf.resolve(ids)
    assert got.step.tolist() == [5, 5, 5, 5, -1]
    assert got.rank.tolist() == [1, 1, 0, 0, -1]
    assert got.index.tolist() == [1, 0, 0, 1, -1]
    rank, feats = buf.get(int(MB1.sample_ids[0]))
    assert rank == 1 and feats[0].tolist() == [9] and feats[1].tolist() == [8, 4]
    buf.release(5)
    assert buf.size_samples == 0 and buf.resolve(ids).step.tolist() == [-1] * 5
    with pytest.raises(KeyError):
        buf.get(int(ids[0]))


def test_features_are_the_samples_ids_in_the_order_asked():
    buf = _buffer()
    ids, lengths = buf.features(5, 1, np.array([1, 0]), 1)
    assert ids.tolist() == [2**64 - 1, 8, 4] and ids.dtype == np.uint64 and lengths.tolist() == [1, 2]
    ids, lengths = buf.features(5, 1, np.array([1]), 0)
    assert ids.tolist() == [] and lengths.tolist() == [0]


def test_expand_gives_each_id_its_bags_gradient_and_sum_adds_repeats():
    ids = np.array([7, 9, 7], np.uint64)
    grads = np.array([[1.0, 2.0], [10.0, 20.0]], np.float32)
    rows = expand_gradients(ids, np.array([2, 1]), grads)
    assert rows.tolist() == [[1, 2], [1, 2], [10, 20]]
    keys, sums = sum_per_key(ids, rows)
    assert keys.tolist() == [7, 9] and sums.tolist() == [[11, 22], [1, 2]] and sums.dtype == np.float64
    with pytest.raises(ProtocolError, match="one gradient per sample"):
        expand_gradients(ids, np.array([1, 1]), grads)
    k, s = sum_per_key(np.zeros(0, np.uint64), np.zeros((0, 2), np.float32))
    assert k.shape == (0,) and s.shape == (0, 2)


class _FakeClient:
    """Records push_grad calls; ``gate`` (an Event) holds every push until set."""

    def __init__(self, log, gate=None, fail=None):
        self.log, self.gate, self.fail = log, gate, fail

    def push_grad_async(self, batch, step, rank):
        if self.fail is not None:
            raise self.fail
        client = self

        class H:
            def wait(self):
                if client.gate is not None:
                    client.gate.wait(5)
                client.log.append((step, rank, {t: (k.copy(), g.copy(), c.copy()) for t, (k, g, c) in batch.items()}))

        return H()

    def close(self):
        pass


def _worker(log, window=2, expiry=None, gate=None, fail=None, timeout_s=5.0, tables=2):
    pusher = GradientPusher(lambda: _FakeClient(log, gate, fail), first_step=5, timeout_s=timeout_s)
    return HybridEmbeddingWorker(tables, 2, window, expiry, 5, pusher)


def _ack(mb, grads):
    return [
        np.zeros(len(mb), np.float32),
        np.zeros(len(mb), np.float32),
        mb.sample_ids.copy(),
        np.asarray(grads, np.float32),
    ]


def test_a_step_is_expanded_summed_over_ranks_and_pushed_once_per_key():
    log: list = []
    hw, buf = _worker(log), _buffer()
    try:
        hw.before_send(5)
        g0 = np.arange(2 * 2 * 2, dtype=np.float32).reshape(2, 2, 2)  # [b, T, dim]
        g1 = 100 + np.arange(2 * 2 * 2, dtype=np.float32).reshape(2, 2, 2)
        rest = hw.receive(5, 0, _ack(MB0, g0), buf, newest_step=5)
        assert len(rest) == 2  # labels, predictions
        hw.receive(5, 1, _ack(MB1, g1), buf, newest_step=6)
        stats = hw.step_acked(5, buf)
        hw.drain()
        assert stats == {"staleness": 0, "dropped": 0, "hybrid_rows": 2 + 3}
        ((step, rank, parts),) = log
        assert step == 5 and rank == 0
        k0, s0, c0 = parts[0]  # table 0: 7 <- s0, s1; 9 <- s0, s2
        assert k0.tolist() == [7, 9] and (c0 == 1).all()
        np.testing.assert_array_equal(s0, [g0[0, 0] + g0[1, 0], g0[0, 0] + g1[0, 0]])
        k1, s1, _ = parts[1]  # table 1: 4 <- s0, s1, s2; 8 <- s2; 2^64-1 <- s3
        assert k1.tolist() == [4, 8, 2**64 - 1]
        np.testing.assert_array_equal(s1, [g0[0, 1] + g0[1, 1] + g1[0, 1], g1[0, 1], g1[1, 1]])
    finally:
        hw.close()


def test_a_gradient_older_than_the_expiry_is_dropped_and_counted():
    log: list = []
    hw, buf = _worker(log, window=3, expiry=1), _buffer()
    try:
        hw.before_send(5)
        hw.receive(5, 0, _ack(MB0, np.ones((2, 2, 2))), buf, newest_step=6)  # age 1: kept
        hw.receive(5, 1, _ack(MB1, np.ones((2, 2, 2))), buf, newest_step=7)  # age 2 > 1: dropped
        stats = hw.step_acked(5, buf)
        hw.drain()
        assert stats["dropped"] == 2
        ((_, _, parts),) = log
        assert parts[0][0].tolist() == [7, 9] and parts[1][0].tolist() == [4]  # rank 0's ids only
    finally:
        hw.close()


def test_all_tables_at_once_equal_the_per_table_expansion_and_sum():
    """step_union + rank_key_sums + merge_ranks (every table in one pass) push exactly what
    expand_gradients + sum_per_key give table by table, over ranks in rank order, for a
    permuted ack, empty bags and keys shared by both ranks."""
    rng = np.random.default_rng(7)
    tables, dim, b = 3, 4, 6
    mbs, acks = [], []
    for rank in range(2):
        lengths = [rng.integers(0, 3, b) for _ in range(tables)]
        offsets = [np.concatenate(([0], np.cumsum(n))) for n in lengths]
        values = [rng.integers(0, 5, int(n.sum())) for n in lengths]
        mb = _mb(5, rank, rank * b, values, offsets)
        perm = rng.permutation(b)
        mbs.append(mb)
        acks.append((perm, rng.standard_normal((b, tables, dim)).astype(np.float32)))
    table, keys, rows = step_union(mbs)
    for mb, r in zip(mbs, rows):  # each distinct id's row in the step's sorted key list
        mine = np.repeat(np.arange(tables), np.diff(mb.id_bounds))
        assert (table[r] == mine).all() and (keys[r] == mb.ids_flat).all()
    assert np.unique(np.stack([table, keys.astype(np.int64)]), axis=1).shape[1] == keys.shape[0]
    per_rank = [rank_key_sums(mb, perm, g, r, keys.shape[0]) for mb, (perm, g), r in zip(mbs, acks, rows)]
    got = merge_ranks(table, keys, per_rank, tables)
    buf = IdFeatureBuffer(100)
    buf.put(5, mbs)
    for t in range(tables):
        ids, grads = [], []
        for rank, (perm, g) in enumerate(acks):
            feats, lengths = buf.features(5, rank, perm, t)
            ids.append(feats)
            grads.append(expand_gradients(feats, lengths, g[:, t, :]))
        want_keys, sums = sum_per_key(np.concatenate(ids), np.concatenate(grads))
        if not want_keys.shape[0]:
            assert t not in got
            continue
        assert got[t][0].tolist() == want_keys.tolist() and got[t][1].dtype == np.float32
        np.testing.assert_allclose(got[t][1], sums.astype(np.float32), rtol=1e-6, atol=1e-7)
    only = merge_ranks(
        table, keys, [rank_key_sums(mbs[0], np.array([2]), acks[0][1][:1], rows[0], keys.shape[0])], tables
    )  # one sample only: its keys, no other
    for t in range(tables):
        want = sorted(set(mbs[0].values(t)[mbs[0].offsets[t][2] : mbs[0].offsets[t][3]].tolist()))
        assert (only[t][0].tolist() if t in only else []) == want
    assert merge_ranks(table, keys, [], tables) == {}


def test_gradients_for_samples_not_in_the_micro_batch_are_refused():
    log: list = []
    hw, buf = _worker(log), _buffer()
    try:
        twice = _ack(MB0, np.zeros((2, 2, 2)))
        twice[2] = np.repeat(MB0.sample_ids[:1], 2)
        with pytest.raises(ProtocolError, match="two gradients for one sample"):
            hw.receive(5, 0, twice, buf, newest_step=5)
        with pytest.raises(ProtocolError, match="not in its micro-batch"):
            hw.receive(5, 0, _ack(MB1, np.zeros((2, 2, 2))), buf, newest_step=5)  # rank 1's samples
        with pytest.raises(ProtocolError, match="no gradients"):
            hw.receive(5, 0, [np.zeros(2, np.float32), np.zeros(2, np.float32)], buf, newest_step=5)
    finally:
        hw.close()


def test_staleness_counts_the_earlier_updates_not_applied_at_hand_out():
    log: list = []
    gate = threading.Event()
    hw = _worker(log, window=3, gate=gate, tables=1)
    buf = IdFeatureBuffer(100)
    try:
        for step in (5, 6, 7):
            hw.before_send(step)
            buf.put(step, [_mb(step, 0, 10 * step, [[1]], [[0, 1]])])
        buf_mb = [buf.micro_batch(s, 0) for s in (5, 6)]
        for step, mb in zip((5, 6), buf_mb):  # acked, pushes held by the gate
            g = np.ones((1, 1, 2), np.float32)
            hw.receive(step, 0, [mb.sample_ids.copy(), g], buf, newest_step=7)
            assert hw.step_acked(step, buf)["staleness"] == step - 5
        threading.Timer(0.2, gate.set).start()
        hw.before_send(8)  # waits (bounded) until step 5 is applied
        assert hw.pusher.applied_through >= 5
        hw.drain()
        assert [s for s, _, _ in log] == [5, 6]
    finally:
        gate.set()
        hw.close()


def test_a_push_thread_failure_reaches_the_serve_thread():
    log: list = []
    hw, buf = _worker(log, fail=PeerTimeout("PS shard 0 (tcp://x) did not answer push_grad", peer="x")), _buffer()
    try:
        hw.receive(5, 0, _ack(MB0, np.ones((2, 2, 2))), buf, newest_step=5)
        hw.receive(5, 1, _ack(MB1, np.ones((2, 2, 2))), buf, newest_step=5)
        hw.step_acked(5, buf)
        with pytest.raises(HeraldError, match="PS shard 0"):
            hw.drain()
    finally:
        hw.close()


def test_a_silent_ps_is_a_bounded_wait():
    log: list = []
    gate = threading.Event()  # never set: the push never completes
    hw, buf = _worker(log, gate=gate, timeout_s=0.3), _buffer()
    try:
        hw.receive(5, 0, _ack(MB0, np.ones((2, 2, 2))), buf, newest_step=5)
        hw.receive(5, 1, _ack(MB1, np.ones((2, 2, 2))), buf, newest_step=5)
        hw.step_acked(5, buf)
        with pytest.raises(PeerTimeout, match="did not acknowledge"):
            hw.drain()
    finally:
        gate.set()
        hw.close()


def test_hybrid_settings_are_checked_with_the_fix_named():
    from herald.contracts.train import TrainConfig
    from herald.errors import ConfigError

    assert TrainConfig.from_flags(consistency="hybrid", hybrid_expiry=2).mode.expiry_steps == 2
    with pytest.raises(ConfigError, match="no meaning for --consistency bsp"):
        TrainConfig.from_flags(hybrid_expiry=2)
    with pytest.raises(ConfigError, match="0..1048576 steps"):
        TrainConfig.from_flags(consistency="hybrid", hybrid_expiry=-1)
    with pytest.raises(ConfigError, match="drop --replicate-below"):
        TrainConfig.from_flags(consistency="hybrid", replicate_below=100)


def test_resolve_can_be_limited_to_one_step():
    buf = _buffer()
    again = _mb(6, 0, 0, [[1, 2]], [[0, 1, 2]])  # the same sample ids as step 5's rank 0 (a replayed source)
    buf.put(6, [again])
    assert buf.resolve(MB0.sample_ids).step.tolist() == [6, 6]  # the newest
    assert buf.resolve(MB0.sample_ids, 5).step.tolist() == [5, 5]
    assert buf.resolve(MB1.sample_ids, 6).step.tolist() == [-1, -1]


def test_the_null_embedding_worker_has_the_seams_calls_and_changes_nothing():
    """The ledger always holds an embedding worker: hybrid's, or the null one of the other
    modes, which must answer every call of the seam (herald/dispatch/embedding_worker.py)."""
    import inspect

    from herald.dispatch.embedding_worker import EmbeddingWorker, NullEmbeddingWorker, no_embedding_worker
    from herald.dispatch.hybrid import HybridEmbeddingWorker

    calls = [n for n, f in vars(EmbeddingWorker).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert calls == ["before_send", "receive", "step_acked", "drain", "close"]
    for name in calls:
        want = list(inspect.signature(getattr(EmbeddingWorker, name)).parameters)
        for cls in (NullEmbeddingWorker, HybridEmbeddingWorker):
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls.__name__, name)
    null = no_embedding_worker(None, None, 0, None)
    arrays = [np.zeros(2, np.float32), np.ones(2, np.float32)]
    assert null.receive(3, 0, arrays, None, 3) is arrays
    assert null.step_acked(3, None) == {}
    assert (null.before_send(4), null.drain(), null.close()) == (None, None, None)

"""Each feature's pooling through the worker's lookup (NOTE [tables and features] in
herald/contracts/features.py, herald/worker/pooling.py): mean-pooled bags and padded
sequences, forward and gradient, against ``F.embedding_bag`` / plain indexing of the step's
rows, through a real loader, cache and in-process PS shard (tests/fakes.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from herald.contracts.features import FeatureConfig
from herald.contracts.job import JobSpec
from herald.contracts.microbatch import make_sample_ids
from herald.contracts.plan import CachePlan, KeySet
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.dispatch.microbatch import build_microbatch
from herald.errors import ConfigError
from herald.loader.batch import SampleBatch
from herald.worker.pooling import FeatureEmbeddings, PaddedSequence, mean_divisor, sequence_index
from tests.fakes import FakeDispatcher, InProcessPS

OPT = OptimizerConfig("rowwise_adagrad", lr=0.1)
TABLES = (TableConfig("user", 4, OPT), TableConfig("tags", 4, OPT))
TAGS = [np.array([7, 2**63 + 3, 7], np.uint64), np.array([0, 2, 2, 3])]  # bags [7, 2^63+3], [], [7]


def _micro_batch():
    user = np.array([1, 2, 1], np.uint64)
    batch = SampleBatch(
        np.array([1, 0, 1], np.float32),
        np.zeros((3, 1), np.float32),
        [user, TAGS[0]],
        [np.array([0, 1, 2, 3]), TAGS[1]],
        ["user", "tags"],
    )
    keys = KeySet(np.array([0, 0, 1, 1], np.int32), np.array([1, 2, 7, 2**63 + 3], np.uint64))
    plan = CachePlan(
        KeySet.empty(), np.zeros(0, bool), keys, KeySet.empty(), np.zeros(0, np.uint16), keys, KeySet.empty()
    )
    return build_microbatch(0, 0, batch, make_sample_ids(0, 0, 3), plan)


def _one_step(tmp_path, features, check):
    """One step with ``embedding(output="features")``; ``check(out, batch)`` runs after backward."""
    shards = InProcessPS(TABLES, workdir=tmp_path).start()
    dispatcher = FakeDispatcher(wait_s=5.0)
    job = JobSpec(
        tables=TABLES,
        dense_dim=1,
        ps=(shards.addresses[0],),
        timeout_ms=2000,
        capacity_rows=16,
        num_workers=1,
        features=features,
    )
    loader = dispatcher.connect_loader(job, timeout_ms=2000)
    try:
        model = torch.nn.Linear(1, 1)
        loader.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        embedding = loader.embedding(output="features")
        it = iter(loader)
        dispatcher.send(*_micro_batch().to_frames())
        batch = next(it)
        out = embedding(batch)
        assert isinstance(out, FeatureEmbeddings) and list(out) == ["user", "tags"]
        weights = torch.arange(1, 5, dtype=torch.float32)  # a loss that weighs every element differently
        loss = sum(
            ((v.values if isinstance(v, PaddedSequence) else v) * weights).sum() * (i + 1)
            for i, v in enumerate(out.values())
        )
        loss.backward()
        check(out, batch)
        loader.step(loss)
        assert dispatcher.recv()[0]["op"] == "ack"
    finally:
        loader.close()
        dispatcher.close()
        shards.stop()


def _tag_rows(batch):
    """The step's rows of table "tags" (a leaf copy) and their positions in ``batch.rows``."""
    rows = batch.rows
    lo, hi = int(rows.bounds[1]), int(rows.bounds[2])
    return rows.rows.detach()[lo:hi].clone(), lo, hi


def test_mean_pooling_equals_embedding_bag_mean_forward_and_gradient(tmp_path):
    def check(out, batch):
        w, lo, hi = _tag_rows(batch)
        assert list(batch.rows.uniq[lo:hi]) == [7, 2**63 + 3]  # the table's distinct ids, sorted
        inv = torch.tensor([0, 1, 0])
        ref_w = w.clone().requires_grad_(True)
        ref = F.embedding_bag(inv, ref_w, torch.from_numpy(TAGS[1][:-1]), mode="mean")
        torch.testing.assert_close(out["tags"].detach(), ref.detach(), rtol=0, atol=0)
        assert out["tags"][1].eq(0).all()  # the empty bag
        (ref * torch.arange(1, 5, dtype=torch.float32)).sum().mul(2).backward()
        torch.testing.assert_close(batch.rows.rows.grad[lo:hi], ref_w.grad, rtol=0, atol=0)

    _one_step(tmp_path, (FeatureConfig("user", "user"), FeatureConfig("tags", "tags", "mean")), check)


def test_a_sequence_keeps_order_pads_and_truncates_to_the_last_rows(tmp_path):
    def check(out, batch):
        w, lo, hi = _tag_rows(batch)
        seq = out["tags"]
        assert seq.values.shape == (3, 1, 4) and seq.lengths.tolist() == [1, 0, 1]
        assert seq.mask.tolist() == [[True], [False], [True]]
        # sample 0's bag [7, 2^63+3] keeps its last row; sample 2 is [7]; sample 1 is padding
        torch.testing.assert_close(seq.values[:, 0].detach(), torch.stack([w[1], torch.zeros(4), w[0]]), rtol=0, atol=0)
        g = batch.rows.rows.grad[lo:hi]
        torch.testing.assert_close(g, torch.arange(1, 5, dtype=torch.float32).mul(2).expand(2, 4), rtol=0, atol=0)
        assert out.pooled["user"].shape == (3, 4)

    _one_step(tmp_path, (FeatureConfig("user", "user"), FeatureConfig("tags", "tags", "none", 1)), check)


def test_sequence_index_and_mean_divisor():
    offsets = np.array([0, 3, 3, 4])
    inverse = np.array([2, 0, 1, 1], np.uint16)
    index, lengths, cut = sequence_index(offsets, inverse.astype(np.int64) + 10, 2, 99)
    assert index.tolist() == [10, 11, 99, 99, 11, 99] and lengths.tolist() == [2, 0, 1] and cut == 1
    div = mean_divisor(np.array([[0, 3, 3, 4], [0, 1, 2, 3]]), np.array([True, False]))
    assert div.tolist() == [[3, 1], [1, 1], [1, 1]]


def test_a_tensor_output_refuses_sequence_features():
    from herald.worker.pooling import FeaturePooling

    pooling = FeaturePooling((FeatureConfig("a", "a"), FeatureConfig("s", "s", "none", 4)))
    with pytest.raises(ConfigError, match="output='features'"):
        pooling.check_tensor_output()


def test_torchrec_views_keyed_tensor_and_jagged_tensor():
    """``FeatureEmbeddings.to_keyed_tensor()`` is what an EmbeddingBagCollection returns, and
    ``to_jagged(name)`` what an EmbeddingCollection returns per feature; gradients reach the
    rows through both."""
    import os

    if os.environ.get("CI", "").lower() != "true":  # CI installs torchrec (make torchrec): a missing one fails there
        pytest.importorskip("torchrec")
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

    a = torch.arange(8, dtype=torch.float32).view(2, 4).requires_grad_(True)
    b = torch.ones(2, 2, requires_grad=True)
    seq = torch.arange(24, dtype=torch.float32).view(2, 3, 4).requires_grad_(True)
    emb = FeatureEmbeddings(("a", "s", "b"), {"a": a, "b": b}, {"s": PaddedSequence(seq, torch.tensor([2, 0]))})
    kt = emb.to_keyed_tensor()
    assert isinstance(kt, KeyedTensor) and kt.keys() == ["a", "b"] and kt.length_per_key() == [4, 2]
    assert torch.equal(kt["a"], a) and torch.equal(kt["b"], b)
    jt = emb.to_jagged("s")
    assert isinstance(jt, JaggedTensor) and jt.lengths().tolist() == [2, 0]
    assert torch.equal(jt.values(), seq[0, :2])
    (kt.values().sum() + jt.values().sum()).backward()
    assert a.grad.eq(1).all() and b.grad.eq(1).all()
    assert seq.grad[0, :2].eq(1).all() and seq.grad[0, 2].eq(0).all() and seq.grad[1].eq(0).all()
    with pytest.raises(KeyError, match="not a sequence"):
        emb.to_jagged("a")
    with pytest.raises(KeyError, match="no feature"):
        emb["zz"]

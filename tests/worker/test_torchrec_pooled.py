"""``ScheduledLoader.embedding(output="keyed_tensor")``: the pooled embeddings as a
``torchrec.KeyedTensor`` (docs/torchrec.md). Gradients flow through it into herald's
cache and PS exactly as through the plain ``[b, T, dim]`` tensor: the same steps from
the same PS rows give the same cached rows, PS rows and dense parameters.

Each path runs against its own in-process PS shard (same seed: same initial rows) and a
scripted dispatcher (InProcessPS and FakeDispatcher, tests/fakes.py), as in
test_step_peers.py. Every wait is bounded.
"""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if os.environ.get("CI", "").lower() != "true":  # CI installs torchrec (make torchrec): a missing one fails there
    pytest.importorskip("torchrec")
from torchrec.sparse.jagged_tensor import KeyedTensor  # noqa: E402

from herald.contracts.job import JobSpec  # noqa: E402
from herald.contracts.microbatch import MicroBatch, make_sample_ids  # noqa: E402
from herald.contracts.plan import CachePlan, KeySet  # noqa: E402
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.dispatch.microbatch import build_microbatch  # noqa: E402
from herald.errors import ConfigError  # noqa: E402
from herald.loader.batch import SampleBatch  # noqa: E402
from herald.ps import PSClient  # noqa: E402
from herald.worker.api import CachedEmbedding  # noqa: E402
from tests.fakes import FakeDispatcher, InProcessPS  # noqa: E402

OPT = OptimizerConfig("rowwise_adagrad", lr=0.1)
TABLES = (TableConfig("user", 4, OPT), TableConfig("tags", 4, OPT))
DENSE_DIM = 2
WAIT_S = 5.0


def _micro_batch(step: int) -> MicroBatch:
    """Three samples; "user" single-hot (ids only this worker uses: update_local), "tags"
    multi-hot with an empty bag and an id >= 2^63 (grad_push, as for shared keys)."""
    user = np.array([1, 2, 1], np.uint64) + np.uint64(10 * step)
    tags = np.array([7, 2**63 + 3, 7], np.uint64)
    batch = SampleBatch(
        np.array([1, 0, 1], np.float32),
        np.array([[0.5, -1], [2, 0.25], [0, 1]], np.float32),
        [user, tags],
        [np.array([0, 1, 2, 3]), np.array([0, 2, 2, 3])],
        ["user", "tags"],
    )
    local = KeySet(np.zeros(2, np.int32), np.unique(user))
    shared = KeySet(np.ones(2, np.int32), np.unique(tags))
    pull = KeySet(np.concatenate([local.table, shared.table]), np.concatenate([local.ids, shared.ids]))
    plan = CachePlan(KeySet.empty(), np.zeros(0, bool), pull, shared, np.ones(2, np.uint16), local, KeySet.empty())
    return build_microbatch(step, 0, batch, make_sample_ids(0, 3 * step, 3), plan)


def _features(pooled) -> torch.Tensor:
    """[b, T x dim] as a model reads them: the plain tensor flattened, or TorchRec's
    KeyedTensor read the way its DLRM SparseArch does (to_dict, then cat by key)."""
    if isinstance(pooled, KeyedTensor):
        assert pooled.keys() == ["user", "tags"] and pooled.length_per_key() == [4, 4]
        parts = pooled.to_dict()
        return torch.cat([parts[name] for name in ("user", "tags")], dim=1)
    return pooled.flatten(1)


def _train(tmp_path: pathlib.Path, output: str, steps: int = 2) -> dict[str, np.ndarray]:
    """``steps`` steps with ``embedding(output=output)``; the cached rows, the PS rows
    and the dense weights after them."""
    shards = InProcessPS(TABLES, workdir=tmp_path).start()
    ps_address = shards.addresses[0]
    dispatcher = FakeDispatcher(wait_s=WAIT_S)
    job = JobSpec(
        tables=TABLES, dense_dim=DENSE_DIM, ps=(ps_address,), timeout_ms=2000, capacity_rows=16, num_workers=1
    )
    loader = dispatcher.connect_loader(job, timeout_ms=2000)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(DENSE_DIM + len(TABLES) * 4, 1)
        loader.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        embedding = loader.embedding(output=output)
        it = iter(loader)
        for step in range(steps):
            dispatcher.send(*_micro_batch(step).to_frames())
            batch = next(it)
            pooled = embedding(batch)
            logits = model(torch.cat([batch.dense, _features(pooled)], dim=1)).squeeze(-1)
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            loss.backward()
            loader.step(loss)
            assert dispatcher.recv()[0]["op"] == "ack"
        local = KeySet(np.zeros(4, np.int32), np.array([1, 2, 11, 12], np.uint64))
        with PSClient([ps_address], TABLES, timeout_ms=2000) as ps:
            shared = np.array(ps.pull(1, np.array([7, 2**63 + 3], np.uint64)))
        cache = loader.executor.cache
        return {
            "cached": cache.read(cache.slots(local)),
            "ps": shared,
            "dense": torch.cat([p.detach().flatten() for p in model.parameters()]).numpy(),
        }
    finally:
        loader.close()
        dispatcher.close()
        shards.stop()


def test_keyed_tensor_step_equals_the_plain_tensor_step(tmp_path):
    plain = _train(tmp_path / "plain", "tensor")
    keyed = _train(tmp_path / "keyed", "keyed_tensor")
    for name in ("cached", "ps", "dense"):
        np.testing.assert_array_equal(keyed[name], plain[name], err_msg=name)
    assert np.abs(plain["dense"]).sum() > 0 and np.isfinite(plain["cached"]).all()


def test_keyed_tensor_layout_and_bad_output(monkeypatch):
    from herald.loader.torchrec_interop import keyed_pooled

    pooled = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4).requires_grad_(True)
    kt = keyed_pooled(pooled, ["a", "b", "c"])
    assert kt.keys() == ["a", "b", "c"] and kt.length_per_key() == [4, 4, 4] and kt.values().shape == (2, 12)
    assert torch.equal(kt["b"], pooled[:, 1])
    kt["c"].sum().backward()  # the gradient reaches the pooled rows
    assert pooled.grad[:, 2].eq(1).all() and pooled.grad[:, :2].eq(0).all()
    with pytest.raises(ConfigError, match="keyed_tensor"):
        CachedEmbedding(executor=None, output="keyed")
    with pytest.raises(ConfigError, match="table names"):
        CachedEmbedding(executor=None, output="keyed_tensor")
    for name in ("torchrec", "torchrec.sparse.jagged_tensor"):
        monkeypatch.setitem(sys.modules, name, None)  # importing them raises ImportError
    with pytest.raises(ImportError, match=r"pip install --no-deps torchrec==1\.8\.0"):
        CachedEmbedding(executor=None, output="keyed_tensor", table_names=("a",))
    CachedEmbedding(executor=None)  # the plain tensor needs no torchrec

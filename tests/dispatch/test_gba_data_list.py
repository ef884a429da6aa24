"""GBA's data list on the dispatcher (NOTE [gba tokens]): a global batch -> M micro-batches."""

from __future__ import annotations

import numpy as np
import pytest

from herald.contracts.microbatch import make_sample_ids
from herald.dispatch.gba import split_global_batch
from herald.dispatch.microbatch import build_microbatch
from herald.errors import ConfigError
from herald.loader.batch import SampleBatch
from herald.worker.consistency_gba import micro_batch_keys


def _batch(rng, b=8, tables=3):
    values, offsets = [], []
    for _ in range(tables):
        lens = rng.integers(0, 3, b)
        o = np.zeros(b + 1, np.int64)
        np.cumsum(lens, out=o[1:])
        values.append(rng.integers(0, 6, int(o[-1])).astype(np.uint64) * np.uint64(2**60))
        offsets.append(o)
    return SampleBatch(rng.random(b).astype(np.float32), rng.random((b, 2)).astype(np.float32), values, offsets)


def test_a_global_batch_becomes_m_contiguous_micro_batches_with_their_token():
    batch = _batch(np.random.default_rng(5))
    ids = make_sample_ids(0, 7 * 8, 8)
    mbs = split_global_batch(batch, 7, 4, ids)
    assert [mb.step for mb in mbs] == [28, 29, 30, 31]  # i = token x M + slot
    assert [divmod(mb.step, 4) for mb in mbs] == [(7, s) for s in range(4)]
    for slot, mb in enumerate(mbs):
        ref = build_microbatch(
            mb.step, slot, batch, ids[2 * slot : 2 * slot + 2], mb.plan, index=np.arange(2 * slot, 2 * slot + 2)
        )
        assert np.array_equal(mb.sample_ids, ids[2 * slot : 2 * slot + 2]) and np.array_equal(mb.labels, ref.labels)
        for t in range(3):
            assert np.array_equal(mb.values(t), ref.values(t)) and np.array_equal(mb.offsets[t], ref.offsets[t])
        keys = micro_batch_keys(mb)  # what the worker pulls: every (table, id) once, table by table
        assert len(keys) == sum(np.unique(ref.values(t)).shape[0] for t in range(3))
        assert not len(mb.plan.pull) and not len(mb.plan.grad_push)  # no plan: GBA reads from the PS


def test_m_must_divide_the_global_batch():
    with pytest.raises(ConfigError, match="--gba-buffer 3 does not divide"):
        split_global_batch(_batch(np.random.default_rng(1)), 0, 3, make_sample_ids(0, 0, 8))

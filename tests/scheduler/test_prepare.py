"""The batch's key lookup and sample-major CSR: the path reading the per-table arrays
directly equals the concatenating one (slots, order, growth of the key state)."""

from __future__ import annotations

import numpy as np

from herald.loader.batch import SampleBatch
from herald.scheduler import Scheduler, SchedulerConfig
from herald.scheduler.batch_keys import sample_csr, sample_csr_concat


def _uniform_batches(seed, steps, B, T, max_len):
    # multi-hot (empty samples and tables included), ids uniform over 64 bits: many new keys
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        values, offsets = [], []
        for t in range(T):
            lens = rng.integers(0, max_len + 1, B) if t != 2 or step % 2 else np.zeros(B, np.int64)
            off = np.zeros(B + 1, np.int64)
            np.cumsum(lens, out=off[1:])
            values.append(rng.integers(0, 2**64 - 1, int(off[-1]), dtype=np.uint64, endpoint=True) % np.uint64(3000))
            offsets.append(off)
        out.append(SampleBatch(np.zeros(B, np.float32), np.zeros((B, 0), np.float32), values, offsets))
    return out


def _strided(batch):
    # every other element of a doubled array: a non-contiguous view (concatenating path)
    values = []
    for v in batch.values:
        d = np.empty(2 * v.shape[0], np.uint64)
        d[::2] = v
        values.append(d[::2])
    return SampleBatch(batch.labels, batch.dense, values, list(batch.offsets))


def test_direct_and_concat_prepare_agree_with_growth():
    cfg = SchedulerConfig(
        num_workers=4, batch_size_per_worker=16, schedule="herald", cache_capacity_rows=10_000, seed=0
    )
    batches = _uniform_batches(3, 12, 64, 5, max_len=4)
    a = Scheduler(cfg, 5, 1)  # key state of 1025 slots: the lookup grows mid-batch
    b = Scheduler(cfg, 5, 1)
    c = Scheduler(cfg, 5, 1)
    for batch in batches:
        got = sample_csr(batch, a.snapshots, None)
        want = sample_csr_concat(batch, b.snapshots)
        strided = sample_csr(_strided(batch), c.snapshots, None)
        for x, y, z in zip(got, want, strided):
            assert x.dtype == y.dtype == z.dtype
            np.testing.assert_array_equal(x, y)
            np.testing.assert_array_equal(z, y)
    assert a.snapshots.num_keys == b.snapshots.num_keys > 1025
    n = a.snapshots.num_keys
    np.testing.assert_array_equal(a.snapshots.slot_ids[:n], b.snapshots.slot_ids[:n])
    np.testing.assert_array_equal(a.snapshots.slot_tab[:n], b.snapshots.slot_tab[:n])


def test_arrays_of_mixed_flags_take_the_direct_path():
    """An Arrow batch's zero-copy (read-only) columns beside copied (writeable) ones: one
    heterogeneous tuple numba cannot index; they are passed as read-only views instead."""
    cfg = SchedulerConfig(num_workers=2, batch_size_per_worker=16, schedule="herald", cache_capacity_rows=1000, seed=0)
    batch = _uniform_batches(5, 1, 32, 4, max_len=3)[0]
    values, offsets = [v.copy() for v in batch.values], [o.copy() for o in batch.offsets]
    for arrays in (values, offsets):
        for a in arrays[::2]:
            a.flags.writeable = False
    mixed = SampleBatch(batch.labels, batch.dense, values, offsets)
    got = sample_csr(mixed, Scheduler(cfg, 4, 1).snapshots, None)
    want = sample_csr_concat(batch, Scheduler(cfg, 4, 1).snapshots)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)
    assert all(v.flags.writeable for v in values[1::2])  # the caller's arrays are left as they were

"""ShuffleBuffer: dense and chunk stores give the same output (NOTE [shuffle buffer])."""

import numpy as np

from herald.loader import GlobalBatcher, open_source
from herald.loader.batch import SampleBatch
from herald.loader.shuffle import ShuffleBuffer


def _run(force_chunks: bool, batches, batch_size=64):
    buf = ShuffleBuffer(np.random.default_rng(5), batch_size)
    buf._dense_ok = not force_chunks
    buf.fill(SampleBatch.concat(batches[:3]))
    out = [buf.step(b) for b in batches[3:]]
    out.append(buf.drain(None))
    return SampleBatch.concat(out)


def test_dense_and_chunk_stores_agree():
    src = open_source("synthetic://criteo?rows=1600&seed=3")  # tables with missing ids
    batches = list(iter(lambda: src.read(64), None))
    dense, chunks = _run(False, batches), _run(True, batches)
    assert dense.equals(chunks) and len(dense) == 1600
    assert not dense.equals(SampleBatch.concat(batches))


def test_multi_hot_switches_store():
    def batch(i):
        lens = np.array([1, 2, 0, 3] * 16)
        off = np.zeros(65, np.int64)
        np.cumsum(lens, out=off[1:])
        return SampleBatch(
            np.full(64, i, np.float32),
            np.zeros((64, 0), np.float32),
            [np.arange(off[-1], dtype=np.uint64) + 1000 * i],
            [off],
            ["tags"],
        )

    single = [
        SampleBatch.from_single_hot(
            np.full(64, 100 + i, np.float32), np.zeros((64, 0), np.float32), np.full((64, 1), i, np.uint64), ["tags"]
        )
        for i in range(4)
    ]
    buf = ShuffleBuffer(np.random.default_rng(0), 64)
    buf.fill(SampleBatch.concat(single))
    outs = [buf.step(batch(i)) for i in range(4)]
    outs.append(buf.drain(None))
    total = SampleBatch.concat(outs)
    assert buf.store is None and len(total) == 64 * 8
    assert np.array_equal(
        np.sort(total.labels), np.sort(np.concatenate([b.labels for b in single] + [batch(i).labels for i in range(4)]))
    )


def test_batcher_shuffle_buffer_smaller_than_batch():
    sizes = [len(b) for b in GlobalBatcher(open_source("synthetic://criteo?rows=1000"), 300, shuffle_buffer=10)]
    assert sizes == [300, 300, 300, 100]

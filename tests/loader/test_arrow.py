"""SampleBatch <-> Arrow conversion (NOTE [arrow layout])."""

import numpy as np
import pyarrow as pa
import pytest

from herald.errors import DataError
from herald.loader.batch import SampleBatch
from herald.loader.formats.arrow import META_KEY, arrow_to_batch, batch_to_arrow


def _batch():
    return SampleBatch(
        np.array([1, 0, 1], np.float32),
        np.array([[0.1, 0.2], [0.0, 1.3], [2.0, 0.5]], np.float32),
        [np.array([7, 2**64 - 1, 7], np.uint64), np.array([11, 12, 13, 11], np.uint64), np.array([5, 6], np.uint64)],
        [np.array([0, 1, 2, 3], np.int64), np.array([0, 2, 2, 4], np.int64), np.array([0, 1, 1, 2], np.int64)],
        ["user", "tags", "opt"],
    )


def test_roundtrip_single_multi_and_missing():
    b = _batch()
    rb = batch_to_arrow(b)
    assert rb.schema.field("user").type == pa.uint64()
    assert rb.schema.field("tags").type == pa.list_(pa.uint64())
    assert rb.schema.field("opt").type == pa.uint64() and rb.column("opt").null_count == 1
    assert rb.schema.field("dense").type == pa.list_(pa.float32(), 2)
    assert META_KEY in rb.schema.metadata
    back = arrow_to_batch(rb)
    assert back.equals(b)
    assert back.values[0][1] == 2**64 - 1  # no float or 32-bit narrowing


def test_roundtrip_table_with_chunks_and_slices():
    b = _batch()
    rb = batch_to_arrow(b)
    table = pa.Table.from_batches([rb, rb])
    assert arrow_to_batch(table).equals(SampleBatch.concat([b, b]))
    assert arrow_to_batch(rb.slice(1, 2)).equals(b.slice(1, 3))


def test_zero_copy_single_hot_column():
    b = SampleBatch.from_single_hot(
        np.zeros(4, np.float32), np.zeros((4, 1), np.float32), np.arange(8, dtype=np.uint64).reshape(4, 2)
    )
    rb = batch_to_arrow(b)
    back = arrow_to_batch(rb)
    assert np.shares_memory(back.values[0], np.frombuffer(rb.column(2).buffers()[1], np.uint64))


def test_inferred_layout_without_metadata():
    t = pa.table(
        {
            "label": pa.array([1.0, 0.0], pa.float64()),
            "f1": [0.5, 1.5],
            "f2": [1.0, 2.0],
            "user": pa.array([3, 4], pa.int64()),
            "tags": pa.array([[1, 2], []], pa.list_(pa.int32())),
        }
    )
    b = arrow_to_batch(t)
    assert b.dense.tolist() == [[0.5, 1.0], [1.5, 2.0]]
    assert b.table_names == ("user", "tags") and b.values[1].tolist() == [1, 2]
    assert b.offsets[1].tolist() == [0, 2, 2]


def test_missing_label_raises():
    with pytest.raises(DataError):
        arrow_to_batch(pa.table({"x": [1, 2]}))

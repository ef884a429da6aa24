"""TorchRec KeyedJaggedTensor interop (NOTE [kjt layout] in herald/loader/torchrec_interop.py):
the round trip is lossless for every registered source, for ids >= 2^63, empty bags,
a batch of 1, and for a worker's micro-batch (``herald.worker.api.Batch``)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

if os.environ.get("CI", "").lower() != "true":  # CI installs torchrec (make torchrec): a missing one fails there
    pytest.importorskip("torchrec")
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from herald.contracts.microbatch import MicroBatch, make_sample_ids  # noqa: E402
from herald.contracts.plan import CachePlan  # noqa: E402
from herald.dispatch.microbatch import build_microbatch  # noqa: E402
from herald.errors import DataError  # noqa: E402
from herald.loader import convert, decode_records, open_source  # noqa: E402
from herald.loader.batch import SampleBatch  # noqa: E402
from herald.loader.formats.arrow import arrow_to_batch, batch_to_arrow  # noqa: E402
from herald.loader.registry import formats  # noqa: E402
from herald.loader.torchrec_interop import from_kjt, from_torchrec, to_kjt, to_torchrec  # noqa: E402
from herald.worker.api import Batch  # noqa: E402

CRITEO = "criteo/criteo_kaggle_sample_dev.tsv"
FILES = {
    "criteo": CRITEO,
    "avazu": "avazu/avazu_sample_dev.csv",
    "libfm": "frappe/frappe.test.libfm",
    "movielens-100k": "movielens/ml-100k/u.data",
    "movielens": "movielens/ml-latest-small/ratings.csv",
}
ROWS = 600


def _read(spec, rows: int = ROWS) -> SampleBatch:
    with open_source(spec) as source:
        return source.read(rows)


def _kafka_payloads(data_dir) -> SampleBatch:
    """What the Kafka source decodes: raw records of a registered format, and Arrow record batches."""
    lines = (data_dir / CRITEO).read_bytes().splitlines(keepends=True)[:ROWS]
    raw, skipped, _ = decode_records("criteo", lines, policy="strict")
    assert not skipped
    return SampleBatch.concat([raw, arrow_to_batch(batch_to_arrow(raw))])


def _source_batch(name: str, data_dir, tmp_path) -> SampleBatch:
    if name == "synthetic":
        return _read("synthetic://criteo?rows=1000&seed=3")
    if name == "parquet":
        out = tmp_path / "c.parquet"
        convert(data_dir / CRITEO, out, row_group_rows=100, progress=False)
        return _read(out)
    if name == "arrow":
        return arrow_to_batch(batch_to_arrow(_read(data_dir / FILES["avazu"])))
    if name == "kafka":
        return _kafka_payloads(data_dir)
    return _read(data_dir / FILES[name])


#: every registered format, and the Arrow layout (Kafka payloads, Parquet row groups)
SOURCES = ["synthetic", "criteo", "avazu", "libfm", "movielens", "movielens-100k", "parquet", "arrow", "kafka"]


def test_every_registered_format_is_covered():
    assert set(formats()) <= set(SOURCES), "a new format: add it to SOURCES of this test"


def _check_layout(kjt, batch: SampleBatch) -> None:
    """NOTE [kjt layout]: keys, dtypes, per-key values (uint64 bits) and lengths."""
    assert kjt.keys() == list(batch.table_names) and kjt.stride() == len(batch)
    assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype == torch.int32
    assert kjt.weights_or_none() is None
    for t, name in enumerate(batch.table_names):
        jt = kjt[name]
        np.testing.assert_array_equal(jt.values().numpy().view(np.uint64), batch.values[t])
        np.testing.assert_array_equal(jt.lengths().numpy(), batch.lengths(t))


def _round_trip(batch: SampleBatch) -> None:
    kjt = to_kjt(batch)
    assert isinstance(kjt, KeyedJaggedTensor)
    _check_layout(kjt, batch)
    back = from_kjt(kjt, batch.labels, batch.dense)
    assert back.equals(batch)
    assert all(v.dtype == np.uint64 for v in back.values) and all(o.dtype == np.int64 for o in back.offsets)
    assert from_torchrec(to_torchrec(batch)).equals(batch)
    as_torch = (torch.from_numpy(batch.labels.copy()), torch.from_numpy(batch.dense.copy()))
    assert from_kjt(kjt, *as_torch).equals(batch)


@pytest.mark.parametrize("name", SOURCES)
def test_round_trip_is_lossless_for_every_source(name, data_dir, tmp_path):
    batch = _source_batch(name, data_dir, tmp_path)
    assert len(batch) > 1
    _round_trip(batch)
    _round_trip(batch.slice(0, 1))  # a batch of 1
    _round_trip(batch.take(np.array([len(batch) - 1, 0, 0])))


def _edge_batch() -> SampleBatch:
    """ids >= 2^63 (negative as int64), empty bags, an all-empty table, multi-hot."""
    return SampleBatch(
        np.array([1, 0, 1], np.float32),
        np.array([[0.1, 0.2], [0.0, 1.3], [2.0, 0.5]], np.float32),
        [
            np.array([7, 2**64 - 1, 2**63], np.uint64),
            np.array([11, 2**63 + 5, 13, 11], np.uint64),
            np.zeros(0, np.uint64),
        ],
        [np.array([0, 1, 2, 3], np.int64), np.array([0, 2, 2, 4], np.int64), np.zeros(4, np.int64)],
        ["user", "tags", "never"],
    )


def test_ids_above_2_63_and_empty_bags_survive():
    batch = _edge_batch()
    kjt = to_kjt(batch)
    assert kjt["user"].values().tolist() == [7, -1, -(2**63)]  # the bits, as int64
    assert kjt["tags"].lengths().tolist() == [2, 0, 2] and kjt["never"].lengths().tolist() == [0, 0, 0]
    _round_trip(batch)
    back = from_kjt(kjt)
    assert back.values[0][1] == 2**64 - 1 and back.values[1][1] == 2**63 + 5
    assert back.dense.shape == (3, 0) and np.array_equal(back.labels, np.zeros(3, np.float32))


def test_batch_of_one_empty_batch_and_no_tables():
    batch = _edge_batch()
    for i in range(3):
        _round_trip(batch.slice(i, i + 1))  # sample 1 has an empty "tags" bag
    _round_trip(SampleBatch.empty(batch.schema))  # zero samples
    no_tables = SampleBatch(batch.labels, batch.dense, [], [], [])
    kjt = to_kjt(no_tables)
    assert kjt.keys() == [] and kjt.stride() == 3
    assert from_kjt(kjt, batch.labels, batch.dense).equals(no_tables)


def test_without_torchrec_the_error_names_the_install(monkeypatch):
    for name in ("torchrec", "torchrec.datasets.utils", "torchrec.sparse.jagged_tensor"):
        monkeypatch.setitem(sys.modules, name, None)  # importing them raises ImportError
    with pytest.raises(ImportError, match=r"fbgemm-gpu-cpu==1\.8\.0 .* && pip install --no-deps torchrec==1\.8\.0"):
        to_kjt(_edge_batch())
    with pytest.raises(ImportError, match="make torchrec"):
        _worker_batch(_edge_batch(), np.arange(3)).to_kjt()


def test_the_kjt_is_a_copy():
    batch = _edge_batch()
    kjt = to_kjt(batch)
    kjt.values()[0] = 99
    assert batch.values[0][0] == 7


def test_from_kjt_rejects_what_a_sample_batch_cannot_hold():
    keys, lengths = ["a"], torch.tensor([1, 1], dtype=torch.int32)
    weighted = KeyedJaggedTensor(
        keys=keys, values=torch.tensor([1, 2]), lengths=lengths, weights=torch.tensor([0.5, 1.0])
    )
    with pytest.raises(DataError, match="weights"):
        from_kjt(weighted)
    with pytest.raises(DataError, match="int64 or int32"):
        from_kjt(KeyedJaggedTensor(keys=keys, values=torch.tensor([1.0, 2.0]), lengths=lengths))
    with pytest.raises(DataError, match="negative int32"):
        from_kjt(KeyedJaggedTensor(keys=keys, values=torch.tensor([1, -2], dtype=torch.int32), lengths=lengths))
    vbe = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1], dtype=torch.int32),
        stride_per_key_per_rank=[[2], [1]],
    )
    with pytest.raises(DataError, match="variable batch size"):
        from_kjt(vbe)
    with pytest.raises(DataError, match="labels has shape .3,., the KJT holds 2 samples"):
        from_kjt(
            KeyedJaggedTensor(keys=keys, values=torch.tensor([1, 2]), lengths=lengths), labels=np.zeros(3, np.float32)
        )
    with pytest.raises(DataError, match="float32"):
        from_kjt(
            KeyedJaggedTensor(keys=keys, values=torch.tensor([1, 2]), lengths=lengths), labels=np.zeros(2, np.float64)
        )
    widened = from_kjt(KeyedJaggedTensor(keys=keys, values=torch.tensor([1, 2], dtype=torch.int32), lengths=lengths))
    assert widened.values[0].dtype == np.uint64 and widened.values[0].tolist() == [1, 2]


# ------------------------------------------------------- the worker's micro-batch
def _worker_batch(batch: SampleBatch, index: np.ndarray) -> Batch:
    """What ScheduledLoader yields: the micro-batch after the wire (uint16 inverse index)."""
    mb = build_microbatch(4, 1, batch, make_sample_ids(0, 0, len(index)), CachePlan.empty(), index=index)
    mb = MicroBatch.from_frames(*mb.to_frames())
    return Batch(
        torch.from_numpy(mb.labels.copy()),
        torch.from_numpy(mb.dense.copy()),
        mb.sample_ids,
        mb.step,
        mb,
        table_names=batch.table_names,
    )


@pytest.mark.parametrize("name", ["criteo", "movielens", "edge"])
def test_worker_batch_round_trip(name, data_dir, tmp_path):
    batch = _edge_batch() if name == "edge" else _source_batch(name, data_dir, tmp_path)
    index = np.array([len(batch) - 1, 0, 1, 0] + list(range(2, len(batch), 3)), np.int64)
    wb = _worker_batch(batch, index)
    kjt = wb.to_kjt()
    want = batch.take(index)
    _check_layout(kjt, want)
    back = from_kjt(kjt, wb.labels, wb.dense)
    assert back.equals(want)
    again = build_microbatch(4, 1, back, wb.sample_ids, CachePlan.empty())  # and back to a micro-batch
    for part in ("ids_flat", "id_bounds", "inverse_flat", "offsets_flat", "labels", "dense"):
        np.testing.assert_array_equal(getattr(again, part), getattr(wb.micro_batch, part))
    one = _worker_batch(batch, np.array([1]))  # a micro-batch of 1
    assert from_kjt(one.to_kjt(), one.labels, one.dense).equals(batch.slice(1, 2))


def test_worker_batch_needs_one_name_per_table():
    wb = _worker_batch(_edge_batch(), np.arange(3))
    wb.table_names = ("user",)
    with pytest.raises(DataError, match="table names"):
        wb.to_kjt()

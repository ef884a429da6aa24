"""Data validation at the loader boundary: NOTE [value checks] (labels and dense values of
columnar data), Parquet schema and type errors, directories, quarantine once per bad
record, and the skip counts a job reports (NOTE [bad records])."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from herald.errors import DataError
from herald.loader import open_source
from herald.loader.batch import SampleBatch
from herald.loader.formats.arrow import batch_to_arrow
from herald.loader.global_batches import GlobalBatches
from herald.loader.kafka.records import ArrowDecoder
from herald.loader.kernels import BAD_DENSE, BAD_LABEL
from herald.loader.splits import distinct_keys_per_table, open_train_eval
from herald.loader.validation import DENSE_LIMIT, value_status

from .resume_harness import check_batcher_resume, check_source_resume

N, BAD_ROWS = 3000, {100: "bad_dense", 200: "bad_dense", 300: "bad_label", 1400: "bad_label", 2999: "bad_dense"}


def _batch(n=N, seed=0, bad=True) -> SampleBatch:
    rng = np.random.default_rng(seed)
    labels = (rng.random(n) < 0.3).astype(np.float32)
    dense = rng.normal(size=(n, 4)).astype(np.float32)
    if bad:
        dense[100, 1], dense[200, 2], dense[2999, 0] = np.nan, 3e38, -np.inf
        labels[300], labels[1400] = np.nan, 2.0
    ids = rng.integers(0, 500, (n, 3)).astype(np.uint64)
    return SampleBatch.from_single_hot(labels, dense, ids, ["t0", "t1", "t2"])


def _write(path, batch, row_group_size=1000):
    pq.write_table(pa.Table.from_batches([batch_to_arrow(batch)]), path, row_group_size=row_group_size)
    return path


@pytest.fixture
def bad_parquet(tmp_path):
    return _write(tmp_path / "bad.parquet", _batch())


def test_value_status_flags_each_kind_of_bad_value():
    labels = np.array([0, 1, 0.5, np.nan, 2, -0.1, np.inf, 1], np.float32)
    dense = np.zeros((8, 2), np.float32)
    dense[7, 1] = np.nan
    assert value_status(labels[:3], dense[:3]) is None  # the common case: nothing allocated
    status = value_status(labels, dense)
    assert status.tolist() == [0, 0, 0, BAD_LABEL, BAD_LABEL, BAD_LABEL, BAD_LABEL, BAD_DENSE]
    big = np.array([[DENSE_LIMIT], [-DENSE_LIMIT], [3e38], [-2e30], [np.inf]], np.float32)
    assert value_status(np.zeros(5, np.float32), big).tolist() == [0, 0, BAD_DENSE, BAD_DENSE, BAD_DENSE]
    assert value_status(np.zeros(0, np.float32), np.zeros((0, 3), np.float32)) is None


def test_parquet_strict_names_file_and_row(bad_parquet):
    with open_source(bad_parquet) as src:
        assert src.num_rows == N  # strict: every row served is a metadata row
        first = src.read(5000)
        assert len(first) == 100  # the good rows before the bad one
        with pytest.raises(DataError) as info:
            src.read(5000)
    err = info.value
    assert (err.source, err.position, err.reason) == (str(bad_parquet), 100, "bad_dense")
    text = str(err)
    assert f"row 100 (0-based) of {bad_parquet}" in text and "nan" in text and "bad_records=skip" in text


def test_parquet_skip_counts_per_reason_and_quarantines_json(bad_parquet, tmp_path):
    q = tmp_path / "q.jsonl"
    with open_source(bad_parquet, bad_records="skip", quarantine_path=str(q)) as src:
        assert src.num_rows is None  # good rows are known only after decoding
        rows = SampleBatch.concat(list(src))
        assert src.stats["skipped"] == {"bad_dense": 3, "bad_label": 2}
    assert len(rows) == N - len(BAD_ROWS)
    assert np.isfinite(rows.dense).all() and ((rows.labels >= 0) & (rows.labels <= 1)).all()
    lines = [json.loads(line) for line in q.read_text().splitlines()]
    assert {(r["row"], r["reason"]) for r in lines} == set(BAD_ROWS.items())
    assert all(r["file"] == str(bad_parquet) for r in lines)


def test_parquet_skip_resume_keeps_exact_counts(bad_parquet):
    check_source_resume(lambda: open_source(bad_parquet, bad_records="skip"), max_read=450)


def test_arrow_records_drop_bad_samples_and_keep_row_indices():
    b = _batch(n=5, bad=False)
    b.labels[1] = np.nan
    b.dense[3, 0] = 1e31
    stream = pa.BufferOutputStream()
    rb = batch_to_arrow(b)
    with pa.ipc.new_stream(stream, rb.schema) as w:
        w.write_batch(rb)
    chunk = ArrowDecoder().decode(0, np.array([7], np.int64), [stream.getvalue().to_pybytes()])
    assert len(chunk.batch) == 3 and chunk.rows.tolist() == [0, 2, 4] and chunk.last.tolist() == [False, False, True]
    assert list(zip(chunk.bad_offsets.tolist(), chunk.bad_rows.tolist(), chunk.bad_reasons)) == [
        (7, 1, "bad_label"),
        (7, 3, "bad_dense"),
    ]


def test_string_label_names_file_column_and_fix(tmp_path):
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"label": ["1", "0"], "user": pa.array([1, 2], pa.uint64())}), path)
    with pytest.raises(DataError) as info:
        open_source(path)
    text = str(info.value)
    assert str(path) in text and "'label'" in text and "float or integer column" in text and "herald convert" in text


def test_string_label_with_herald_metadata_is_caught_too(tmp_path):
    good = batch_to_arrow(_batch(n=4, bad=False))
    table = pa.Table.from_batches([good]).set_column(0, "label", pa.array(["1", "0", "1", "0"]))
    path = tmp_path / "m.parquet"
    pq.write_table(table.replace_schema_metadata(good.schema.metadata), path)
    with pytest.raises(DataError, match="label must be a float or integer column"):
        open_source(path)


def test_no_table_column_and_unmapped_columns(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"label": [1.0, 0.0], "x": [0.5, 0.1]}), path)
    with pytest.raises(DataError, match="no table column") as info:
        open_source(path)
    assert str(path) in str(info.value)
    pq.write_table(pa.table({"label": [1.0, 0.0], "user": pa.array([1, 2], pa.uint64()), "city": ["a", "b"]}), path)
    with pytest.raises(DataError, match="'city' \\(string\\) map to nothing"):
        open_source(path)


def test_directory_checks_every_file_before_reading(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    _write(d / "a.parquet", _batch(bad=False))
    (d / "_SUCCESS").write_text("")  # Spark/Hadoop markers are metadata
    assert open_source(d).num_rows == N
    good = batch_to_arrow(_batch(n=2, bad=False))  # same herald layout, but a string label column
    table = pa.Table.from_batches([good]).set_column(0, "label", pa.array(["1", "0"]))
    pq.write_table(table.replace_schema_metadata(good.schema.metadata), d / "b.parquet")
    with pytest.raises(DataError) as info:
        open_source(d)  # at open: before any row is read
    assert str(d / "b.parquet") in str(info.value) and "label must be a float or integer" in str(info.value)
    (d / "b.parquet").unlink()
    _write(
        d / "c.parquet",
        SampleBatch.from_single_hot(
            np.zeros(2, np.float32), np.zeros((2, 7), np.float32), np.zeros((2, 3), np.uint64), ["t0", "t1", "t2"]
        ),
    )
    with pytest.raises(DataError, match="7 dense features"):
        open_source(d)


def test_directory_with_other_files_names_them(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    _write(d / "a.parquet", _batch(bad=False))
    (d / "day_1.tsv").write_text("1\t2\n")
    (d / "notes.txt").write_text("x")
    with pytest.raises(DataError) as info:
        open_source(d)
    text = str(info.value)
    assert "day_1.tsv" in text and "notes.txt" in text and "herald convert" in text
    only_tsv = tmp_path / "tsv_only"
    only_tsv.mkdir()
    (only_tsv / "x.tsv").write_text("1\t2\n")
    with pytest.raises(DataError, match="x.tsv"):
        open_source(only_tsv)


def test_job_passes_quarantine_each_bad_record_once(bad_parquet, tmp_path):
    """The row-count pre-pass quarantines; the distinct-keys pre-pass, the epochs of the
    training split and the held-out split never do (they re-read records)."""
    q = tmp_path / "q.jsonl"
    q.write_text("stale line of an earlier run\n")
    options = {"bad_records": "skip", "quarantine_path": str(q)}
    train, ev, info = open_train_eval(str(bad_parquet), 0.1, options)
    assert info["total_rows"] == N - len(BAD_ROWS)
    distinct_keys_per_table(str(bad_parquet), options, info["train_rows"])
    with GlobalBatches(train, 64, epochs=3) as batches:
        list(batches)
        train_skipped = batches.skipped
    while ev.read(500) is not None:
        pass
    rows = [json.loads(line)["row"] for line in q.read_text().splitlines()]
    assert sorted(rows) == sorted(BAD_ROWS)  # once each, the stale line gone
    assert train_skipped == {"bad_dense": 2, "bad_label": 2}  # not x3 for three epochs
    assert ev.stats["skipped"] == {"bad_dense": 1}  # the held-out split's own (row 2999)
    ev.close()


def test_global_batches_carry_skip_counts_through_resume(bad_parquet):
    def make():
        return GlobalBatches(open_source(bad_parquet, bad_records="skip"), 128, epochs=2)

    check_batcher_resume(make, trials=3)
    with make() as b:
        for _ in range(10):
            next(b)
        state = json.loads(json.dumps(b.state_dict()))
    assert state["skipped"] == {"bad_dense": 2, "bad_label": 1}  # rows 100, 200, 300 are before 10 x 128
    with make() as b2:
        b2.load_state_dict(state)
        assert b2.skipped == state["skipped"]
        list(b2)
        assert b2.skipped == {"bad_dense": 3, "bad_label": 2}

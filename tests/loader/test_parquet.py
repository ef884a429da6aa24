"""Parquet source, convert for every raw format, datagen/convert command lines."""

import pyarrow.parquet as pq
import pytest

from herald.cli import main
from herald.errors import DataError
from herald.loader import convert, open_source
from herald.loader.batch import SampleBatch

RAW = ["criteo/criteo_kaggle_sample_dev.tsv", "avazu/avazu_sample_dev.csv",
       "frappe/frappe.test.libfm", "movielens/ml-100k/u.data", "movielens/ml-latest-small/ratings.csv"]


@pytest.mark.parametrize("rel", RAW)
def test_convert_every_raw_format_roundtrips(tmp_path, data_dir, rel):
    out = tmp_path / "x.parquet"
    res = convert(data_dir / rel, out, row_group_rows=5000, progress=False)
    with open_source(data_dir / rel) as raw, open_source(out) as pqs:
        a = SampleBatch.concat(list(raw))
        assert pqs.num_rows == len(a) == res["rows"]
        b = SampleBatch.concat(list(pqs))
    assert a.equals(b)


def test_directory_of_files_and_resume_across_files(tmp_path, data_dir):
    d = tmp_path / "ds"
    convert(data_dir / "criteo/criteo_kaggle_sample_dev.tsv", d / "a.parquet", row_group_rows=100, progress=False)
    convert(data_dir / "criteo/criteo_kaggle_sample_test.tsv", d / "b.parquet", row_group_rows=100, progress=False)
    from .resume_harness import check_source_resume

    full = check_source_resume(lambda: open_source(d), max_read=150)
    assert len(full) == 409 + 391


def test_no_file_raises(tmp_path):
    with pytest.raises(DataError):
        open_source(tmp_path / "none.parquet")


def test_cli_convert_and_datagen(tmp_path, data_dir, capsys):
    out = tmp_path / "c.parquet"
    assert main(["convert", str(data_dir / "avazu/avazu_sample_train.csv"), str(out), "--quiet"]) == 0
    assert pq.ParquetFile(out).metadata.num_rows == 8087
    assert main(["datagen", "--out", str(tmp_path / "syn"), "--rows", "3000", "--seed", "5",
                 "--fit", str(data_dir / "criteo/criteo_kaggle_sample_dev.tsv"), "--quiet"]) == 0
    with open_source(tmp_path / "syn") as s:
        assert s.num_rows == 3000 and s.schema.num_tables == 26 and s.schema.dense_dim == 13
        assert b"herald.synthetic" in s.metadata
    assert main(["datagen", "--out", str(tmp_path / "p.parquet"), "--rows", "100",
                 "--preset", "nope", "--quiet"]) == 1
    assert "unknown synthetic preset" in capsys.readouterr().err


def test_cli_convert_skip_with_quarantine(tmp_path):
    src = tmp_path / "bad.tsv"
    good = "0\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["ab"] * 26)
    src.write_text(good + "\n" + "garbage\n" + good + "\n")
    q = tmp_path / "q.txt"
    out = tmp_path / "o.parquet"
    assert main(["convert", str(src), str(out), "--bad-records", "skip", "--quarantine", str(q), "--quiet"]) == 0
    assert q.read_text() == "garbage\n" and pq.ParquetFile(out).metadata.num_rows == 2
    assert main(["convert", str(src), str(tmp_path / "o2.parquet"), "--quiet"]) == 1


def test_multi_hot_list_columns_roundtrip(tmp_path):
    import numpy as np
    import pyarrow as pa

    from herald.loader.formats.arrow import batch_to_arrow

    b = SampleBatch(np.array([1, 0, 1], np.float32), np.zeros((3, 0), np.float32),
                    [np.array([7, 9, 7], np.uint64), np.array([11, 12, 13, 2 ** 64 - 2], np.uint64)],
                    [np.array([0, 1, 2, 3], np.int64), np.array([0, 2, 2, 4], np.int64)], ["user", "tags"])
    pq.write_table(pa.Table.from_batches([batch_to_arrow(b)] * 3), tmp_path / "m.parquet", row_group_size=4)
    with open_source(tmp_path / "m.parquet") as s:
        assert s.multi_hot_tables == frozenset({"tags"})
        got = SampleBatch.concat(list(iter(lambda: s.read(2), None)))
    assert got.equals(SampleBatch.concat([b, b, b]))


def test_convert_synthetic_url(tmp_path):
    res = convert("synthetic://criteo?rows=3000&seed=2", tmp_path / "s.parquet", row_group_rows=1000, progress=False)
    assert res["rows"] == 3000 and pq.ParquetFile(tmp_path / "s.parquet").num_row_groups == 3


def test_bench_smoke(tmp_path, data_dir):
    from herald.bench.loader import report, run

    results = run(8192, 1024, 1, 2048, str(data_dir / "criteo/criteo_kaggle_sample_dev.tsv"), str(tmp_path))
    assert set(results) == {"parquet", "parquet+batcher", "parquet+shuffle64k", "criteo_tsv", "torch_dl_w0", "torch_dl_w2",
                            "herald_dl_w0", "herald_dl_w2"}
    assert all(v > 0 for v in results.values()) and "x torch w0" in report(results)

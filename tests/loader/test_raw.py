"""Raw-format sources on the real files in ../shared/data (row counts from the data READMEs)."""

import math

import numpy as np
import pytest

from herald.errors import DataError
from herald.hashing import hash_value
from herald.loader import open_source
from herald.loader.batch import SampleBatch

ROW_COUNTS = [
    ("criteo/criteo_kaggle_sample_train.tsv", "criteo", 7200, 1549),
    ("criteo/criteo_kaggle_sample_dev.tsv", "criteo", 409, 93),
    ("criteo/criteo_kaggle_sample_test.tsv", "criteo", 391, 86),
    ("criteo/criteo_terabyte_day11_first3k.tsv", "criteo", 3000, 92),
    ("avazu/avazu_sample_train.csv", "avazu", 8087, None),
    ("avazu/avazu_sample_dev.csv", "avazu", 480, None),
    ("avazu/avazu_sample_test.csv", "avazu", 432, None),
    ("frappe/frappe.validation.libfm", "libfm", 57722, 19063),
    ("frappe/frappe.test.libfm", "libfm", 28860, 9536),
    ("movielens/ml-latest-small/ratings.csv", "movielens", 100836, None),
    ("movielens/ml-100k/u.data", "movielens", 100000, 34174 + 21201),
]


def read_all(path, **options):
    with open_source(path, **options) as s:
        return SampleBatch.concat(list(s)), s


@pytest.mark.parametrize("rel,fmt,rows,positives", ROW_COUNTS)
def test_row_counts_on_real_files(data_dir, rel, fmt, rows, positives):
    batch, source = read_all(data_dir / rel)
    assert source.format_name == fmt
    assert len(batch) == rows and source.stats["rows"] == rows
    assert source.stats["skipped"] == {}
    if positives is not None:
        assert int(batch.labels.sum()) == positives


def test_avazu_clicks_over_all_files(data_dir):
    clicks = sum(
        int(read_all(data_dir / f"avazu/avazu_sample_{p}.csv")[0].labels.sum()) for p in ("train", "dev", "test")
    )
    assert clicks == 1563


def test_criteo_first_row_exact(data_dir):
    batch, _ = read_all(data_dir / "criteo/criteo_kaggle_sample_train.tsv")
    # 0 1 1 5 0 1382 4 15 2 181 1 2 <empty> 2 68fd1e64 80e26c9b ... C22 empty
    expected = [math.log1p(x) for x in (1, 1, 5, 0, 1382, 4, 15, 2, 181, 1, 2, 0, 2)]
    np.testing.assert_allclose(batch.dense[0], np.float32(expected), rtol=1e-6)
    assert batch.labels[0] == 0.0
    assert batch.values[0][0] == hash_value("68fd1e64", 0)
    assert batch.values[1][0] == hash_value("80e26c9b", 1)
    assert batch.values[25][0] == hash_value("9727dd16", 25)
    assert batch.lengths(21)[0] == 0  # C22 is empty in row 1
    assert batch.values[0].dtype == np.uint64


def test_criteo_negative_dense_clamped(tmp_path):
    line = "1\t-5\t" + "\t".join(["3"] * 12) + "\t" + "\t".join(["ab"] * 26) + "\n"
    p = tmp_path / "neg.tsv"
    p.write_text(line)
    batch, _ = read_all(p)
    assert batch.dense[0, 0] == 0.0 and batch.dense[0, 1] == np.float32(math.log1p(3))


def test_avazu_values_and_header(data_dir):
    batch, _ = read_all(data_dir / "avazu/avazu_sample_train.csv")
    assert batch.table_names[0] == "hour" and batch.num_tables == 22 and batch.dense_dim == 0
    # first data row: 10000169349117863715,0,14102100,1005,0,1fbe01fe,...
    assert batch.labels[0] == 0.0
    assert batch.values[0][0] == hash_value("14102100", 0)
    assert batch.values[1][0] == hash_value("1005", 1)
    assert batch.values[3][0] == hash_value("1fbe01fe", 3)


def test_libfm_values(data_dir):
    batch, _ = read_all(data_dir / "frappe/frappe.test.libfm")
    # -1 204:1 4798:1 5041:1 5046:1 5053:1 5055:1 5058:1 5060:1 5073:1 5183:1
    assert batch.labels[0] == 0.0 and batch.labels[1] == 1.0
    assert [int(v[0]) for v in batch.values] == [204, 4798, 5041, 5046, 5053, 5055, 5058, 5060, 5073, 5183]
    ranges = {"user": (0, 954), "item": (957, 5038), "city": (5149, 5381)}
    for t, name in enumerate(batch.table_names):
        if name in ranges:
            lo, hi = ranges[name]
            assert lo <= batch.values[t].min() and batch.values[t].max() <= hi


def test_movielens_sorted_and_threshold(data_dir):
    path = data_dir / "movielens/ml-latest-small/ratings.csv"
    with open_source(path) as s:
        ts = s.timestamps
        batch = SampleBatch.concat(list(s))
        ratings = s.ratings
    assert np.all(np.diff(ts) >= 0)
    assert np.array_equal(batch.labels, (ratings >= 4.0).astype(np.float32))
    assert len(np.unique(batch.values[0])) == 610 and len(np.unique(batch.values[1])) == 9724
    with open_source(path, threshold=3.0) as s3:
        b3 = SampleBatch.concat(list(s3))
    assert b3.labels.sum() > batch.labels.sum()


def test_movielens_u_data_values(data_dir):
    batch, s = read_all(data_dir / "movielens/ml-100k/u.data")
    assert len(np.unique(batch.values[0])) == 943 and len(np.unique(batch.values[1])) == 1682
    # stable sort: the earliest rating in u.data
    assert s.timestamps[0] == s.timestamps.min()


BAD_CRITEO = "1\tx\t" + "\t".join(["3"] * 12) + "\t" + "\t".join(["ab"] * 26) + "\n"


def _criteo_with_bad(tmp_path, data_dir):
    good = (data_dir / "criteo/criteo_kaggle_sample_dev.tsv").read_bytes().splitlines(keepends=True)
    p = tmp_path / "mixed.tsv"
    p.write_bytes(b"".join(good[:5]) + BAD_CRITEO.encode() + b"\xff\xfe\n" + b"".join(good[5:10]))
    return p


def test_strict_names_file_line_reason(tmp_path, data_dir):
    p = _criteo_with_bad(tmp_path, data_dir)
    with open_source(p) as s:
        first = s.read(100)
        assert len(first) == 5  # good rows before the bad one are delivered first
        with pytest.raises(DataError) as info:
            s.read(100)
    err = info.value
    assert err.reason == "bad_int" and err.position == 6 and str(p) in err.source
    assert "mixed.tsv:6" in str(err)


def test_skip_counts_and_quarantine(tmp_path, data_dir):
    p = _criteo_with_bad(tmp_path, data_dir)
    q = tmp_path / "quarantine.txt"
    batch, s = read_all(p, bad_records="skip", quarantine_path=str(q))
    assert len(batch) == 10
    assert s.stats["skipped"] == {"bad_int": 1, "bad_utf8": 1}
    assert q.read_bytes() == BAD_CRITEO.encode() + b"\xff\xfe\n"


def test_quarantine_needs_skip(tmp_path, data_dir):
    from herald.errors import ConfigError

    with pytest.raises(ConfigError):
        open_source(data_dir / "criteo/criteo_kaggle_sample_dev.tsv", quarantine_path=str(tmp_path / "q"))


def test_movielens_strict_and_skip(tmp_path):
    p = tmp_path / "ratings.csv"
    p.write_text("userId,movieId,rating,timestamp\n1,2,4.0,10\n1,x,3.0,5\n2,3,5.0,1\n")
    with pytest.raises(DataError) as info:
        open_source(p)
    assert info.value.position == 3 and info.value.reason == "bad_int"
    batch, s = read_all(p, bad_records="skip")
    assert s.stats["skipped"] == {"bad_int": 1}
    assert batch.values[0].tolist() == [2, 1] and batch.labels.tolist() == [1.0, 1.0]


def test_small_chunks_same_rows(data_dir):
    path = data_dir / "criteo/criteo_kaggle_sample_dev.tsv"
    a, _ = read_all(path)
    b, _ = read_all(path, chunk_bytes=100)  # every line is longer: chunks grow
    assert a.equals(b)

"""Record-level resume for every source and for the GlobalBatcher (one shared harness)."""

import functools

import pytest

from herald.errors import ConfigError, DataError
from herald.loader import GlobalBatcher, convert, open_source

from .resume_harness import check_batcher_resume, check_source_resume

BAD = b"1\tx\t" + b"\t".join([b"3"] * 12) + b"\t" + b"\t".join([b"ab"] * 26) + b"\n"


@pytest.fixture(scope="module")
def parquet_path(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("pq") / "criteo_dev.parquet"
    convert(data_dir / "criteo/criteo_kaggle_sample_train.tsv", out, row_group_rows=1000, progress=False)
    return out


@pytest.fixture(scope="module")
def criteo_with_bad(tmp_path_factory, data_dir):
    lines = (data_dir / "criteo/criteo_kaggle_sample_dev.tsv").read_bytes().splitlines(keepends=True)
    p = tmp_path_factory.mktemp("bad") / "mixed.tsv"
    p.write_bytes(b"".join(line + (BAD if i % 37 == 0 else b"") + (b"\n" if i % 53 == 0 else b"")
                           for i, line in enumerate(lines)))
    return p


@pytest.mark.parametrize("rel,options", [
    ("criteo/criteo_kaggle_sample_dev.tsv", {}),
    ("criteo/criteo_kaggle_sample_dev.tsv", {"chunk_bytes": 4096}),
    ("avazu/avazu_sample_train.csv", {"chunk_bytes": 65536}),
    ("avazu/avazu_sample_dev.csv", {}),
    ("frappe/frappe.test.libfm", {"chunk_bytes": 300000}),
    ("movielens/ml-100k/u.data", {}),
    ("movielens/ml-latest-small/ratings.csv", {}),
])
def test_resume_real_files(data_dir, rel, options):
    max_read = 3000 if "movielens" in rel or "frappe" in rel else 300
    check_source_resume(functools.partial(open_source, data_dir / rel, **options), max_read=max_read)


def test_resume_skip_policy_counts(criteo_with_bad, tmp_path):
    full = check_source_resume(functools.partial(open_source, criteo_with_bad, bad_records="skip",
                                                 chunk_bytes=8192), trials=4)
    assert len(full) == 409


def test_resume_parquet(parquet_path):
    check_source_resume(functools.partial(open_source, parquet_path), max_read=2500)


def test_resume_synthetic():
    check_source_resume(functools.partial(open_source, "synthetic://criteo?rows=5000&seed=7"), max_read=900)


@pytest.mark.parametrize("kwargs", [
    {},
    {"drop_last": True, "epochs": 2},
    {"shuffle_buffer": 1000, "seed": 3, "epochs": 2},
    {"shuffle_buffer": 700, "seed": 1, "drop_last": True},
])
def test_resume_batcher(parquet_path, kwargs):
    make = lambda: GlobalBatcher(open_source(parquet_path), 512, **kwargs)  # noqa: E731
    full = check_batcher_resume(make, trials=2)
    if kwargs.get("drop_last"):
        assert all(len(b) == 512 for b in full)
    assert sum(len(b) for b in full) <= 7200 * kwargs.get("epochs", 1)


def test_resume_batcher_text_source(data_dir):
    make = lambda: GlobalBatcher(open_source(data_dir / "avazu/avazu_sample_train.csv", chunk_bytes=50000),  # noqa: E731
                                 1000, shuffle_buffer=2000, epochs=2)
    check_batcher_resume(make, trials=2)


def test_malformed_states(data_dir, parquet_path):
    with open_source(data_dir / "criteo/criteo_kaggle_sample_dev.tsv") as s:
        good = s.state_dict()
        for bad in [None, {}, {**good, "format": "avazu"}, {**good, "offset": -1},
                    {**good, "offset": "x"}, {**good, "path": "other.tsv"},
                    {**good, "offset": 10 ** 12}, {**good, "skipped": [1]}]:
            with pytest.raises(DataError):
                s.load_state_dict(bad)
    with open_source(parquet_path) as s:
        with pytest.raises(DataError):
            s.load_state_dict({**s.state_dict(), "file": "nope.parquet"})
    b = GlobalBatcher(open_source(parquet_path), 64)
    with pytest.raises(ConfigError):
        GlobalBatcher(open_source(parquet_path), 128).load_state_dict(b.state_dict())
    with pytest.raises(DataError):
        b.load_state_dict({"format": "global_batcher", "epoch": -1})

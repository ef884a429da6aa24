"""open_source: format inference, options, registry, decode_records."""

import pytest

from herald.errors import ConfigError, DataError
from herald.loader import decode_records, open_source, register_format
from herald.loader.registry import infer_format
from herald.loader.synthetic import SyntheticSource, preset_spec


def test_infer_format(data_dir, tmp_path):
    assert infer_format(str(data_dir / "criteo/criteo_kaggle_sample_dev.tsv")) == "criteo"
    assert infer_format(str(data_dir / "avazu/avazu_sample_dev.csv")) == "avazu"
    assert infer_format(str(data_dir / "movielens/ml-latest-small/ratings.csv")) == "movielens"
    assert infer_format(str(data_dir / "movielens/ml-100k/u.data")) == "movielens"
    assert infer_format(str(data_dir / "frappe/frappe.test.libfm")) == "libfm"
    assert infer_format(str(tmp_path)) == "parquet"
    assert infer_format("x.parquet") == "parquet"
    assert infer_format("kafka://broker/topic") == "kafka"
    with pytest.raises(ConfigError):
        infer_format("x.unknown")


def test_unknown_option_lists_known(data_dir):
    with pytest.raises(ConfigError) as info:
        open_source(data_dir / "criteo/criteo_kaggle_sample_dev.tsv", thresold=3)
    assert "bad_records" in str(info.value) and "bucket_count" in str(info.value)
    with pytest.raises(ConfigError):
        open_source("synthetic://criteo?rows=10&colour=red")
    with pytest.raises(ConfigError):
        open_source(data_dir / "criteo/criteo_kaggle_sample_dev.tsv", bad_records="ignore")
    with pytest.raises(ConfigError):
        open_source("kafka://x/y")


def test_bucket_count(data_dir):
    with open_source(data_dir / "criteo/criteo_kaggle_sample_dev.tsv", bucket_count=1000) as s:
        b = s.read(500)
    assert all(v.max() < 1000 for v in b.values if v.size)


def test_register_format(monkeypatch):
    from herald.loader import registry

    # the registry is process-wide: a copy keeps "fake" out of later tests (test_kjt lists every format)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_format("fake", lambda spec, **o: SyntheticSource(preset_spec("criteo-kaggle"), rows=3))
    with open_source("fake://anything") as s:
        assert len(s.read(10)) == 3
    assert "fake" in registry.formats()


def test_decode_records_strict_and_skip(data_dir):
    lines = (data_dir / "criteo/criteo_kaggle_sample_dev.tsv").read_bytes().splitlines(keepends=True)[:20]
    records = lines[:10] + [b"1\t2\n"] + lines[10:]
    with pytest.raises(DataError) as info:
        decode_records("criteo", records, policy="strict", source_name="topic/0", first_position=100)
    assert info.value.position == 110 and info.value.source == "topic/0"
    assert info.value.reason == "field_count"
    batch, skipped, bad = decode_records("criteo", records, policy="skip")
    assert len(batch) == 20 and skipped == {"field_count": 1} and bad == [b"1\t2\n"]
    with open_source(data_dir / "criteo/criteo_kaggle_sample_dev.tsv") as s:
        assert batch.equals(s.read(20))
    with pytest.raises(ConfigError):
        decode_records("libfm", records)


def test_decode_lines_status_per_record():
    from herald.loader.formats.decode import decode_lines

    good = b"1,0," + b",".join([b"ab"] * 22)
    d = decode_lines("avazu", [good, b"", good + b"\n", b"x\ny", None])
    assert d.status.tolist() == [0, 1, 0, 3, 1]
    assert len(d.batch()) == 2

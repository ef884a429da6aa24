"""Parquet source, convert for every raw format, datagen/convert command lines, page
checksums (NOTE [page checksums])."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from herald.cli import main
from herald.errors import DataError
from herald.loader import convert, datagen, open_source
from herald.loader.batch import SampleBatch
from herald.loader.conversion import WRITER_OPTIONS
from herald.loader.formats.arrow import batch_to_arrow

from .resume_harness import check_source_resume

RAW = [
    "criteo/criteo_kaggle_sample_dev.tsv",
    "avazu/avazu_sample_dev.csv",
    "frappe/frappe.test.libfm",
    "movielens/ml-100k/u.data",
    "movielens/ml-latest-small/ratings.csv",
]


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
    d.mkdir()  # convert creates no missing folder (NOTE [no input destroyed])
    convert(data_dir / "criteo/criteo_kaggle_sample_dev.tsv", d / "a.parquet", row_group_rows=100, progress=False)
    convert(data_dir / "criteo/criteo_kaggle_sample_test.tsv", d / "b.parquet", row_group_rows=100, progress=False)
    full = check_source_resume(lambda: open_source(d), max_read=150)
    assert len(full) == 409 + 391


def test_no_file_raises(tmp_path):
    with pytest.raises(DataError):
        open_source(tmp_path / "none.parquet")


def test_cli_convert_and_datagen(tmp_path, data_dir, capsys):
    out = tmp_path / "c.parquet"
    assert main(["convert", str(data_dir / "avazu/avazu_sample_train.csv"), str(out), "--quiet"]) == 0
    assert pq.ParquetFile(out).metadata.num_rows == 8087
    assert (
        main(
            [
                "datagen",
                "--out",
                str(tmp_path / "syn"),
                "--rows",
                "3000",
                "--seed",
                "5",
                "--fit",
                str(data_dir / "criteo/criteo_kaggle_sample_dev.tsv"),
                "--quiet",
            ]
        )
        == 0
    )
    with open_source(tmp_path / "syn") as s:
        assert s.num_rows == 3000 and s.schema.num_tables == 26 and s.schema.dense_dim == 13
        assert b"herald.synthetic" in s.metadata
    assert main(["datagen", "--out", str(tmp_path / "p.parquet"), "--rows", "100", "--preset", "nope", "--quiet"]) == 1
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
    b = SampleBatch(
        np.array([1, 0, 1], np.float32),
        np.zeros((3, 0), np.float32),
        [np.array([7, 9, 7], np.uint64), np.array([11, 12, 13, 2**64 - 2], np.uint64)],
        [np.array([0, 1, 2, 3], np.int64), np.array([0, 2, 2, 4], np.int64)],
        ["user", "tags"],
    )
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
    assert set(results) == {
        "parquet",
        "parquet+batcher",
        "parquet+shuffle64k",
        "criteo_tsv",
        "torch_dl_w0",
        "torch_dl_w2",
        "herald_dl_w0",
        "herald_dl_w2",
    }
    assert all(v > 0 for v in results.values()) and "x torch w0" in report(results)


# ---------------------------------------------------------------- page checksums
GROUP = 128  # rows per row group; 128 distinct ids per group, so every dictionary index a flip makes is valid


def _unique_ids_batch(n=4 * GROUP) -> SampleBatch:
    rng = np.random.default_rng(3)
    ids = (np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(1))[:, None]
    return SampleBatch.from_single_hot(
        (rng.random(n) < 0.3).astype(np.float32), rng.normal(size=(n, 2)).astype(np.float32), ids, ["user"]
    )


def _write_unchecked(path, batch):
    """A file as herald wrote it before page checksums (same options, no CRC in the page headers)."""
    pq.write_table(
        pa.Table.from_batches([batch_to_arrow(batch)]),
        path,
        row_group_size=GROUP,
        **{**WRITER_OPTIONS, "write_page_checksum": False},
    )
    return path


def _flip_page(path, row_group, column="user", nbytes=16):
    """Flip ``nbytes`` bytes in the middle of the data page of ``column`` in ``row_group``
    (the page's values, past its header; the byte range comes from the footer)."""
    md = pq.ParquetFile(path).metadata.row_group(row_group)
    chunk = next(md.column(i) for i in range(md.num_columns) if md.column(i).path_in_schema == column)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    page, stop = chunk.data_page_offset, start + chunk.total_compressed_size
    mid = (page + stop) // 2
    assert page + 32 <= mid - nbytes // 2 and mid + nbytes // 2 <= stop  # well past the page header
    data = bytearray(path.read_bytes())
    data[mid - nbytes // 2 : mid + nbytes // 2] = bytes(b ^ 0xFF for b in data[mid - nbytes // 2 : mid + nbytes // 2])
    path.write_bytes(bytes(data))


@pytest.fixture
def checked(tmp_path):
    """(the rows, a file herald convert wrote from them, with row group 1 corrupted)."""
    b = _unique_ids_batch()
    out = tmp_path / "checked.parquet"
    convert(_write_unchecked(tmp_path / "src.parquet", b), out, row_group_rows=GROUP, progress=False)
    _flip_page(out, 1)
    return b, out


def test_without_checksums_the_flip_reads_silently(tmp_path):
    """The corruption the checksum tests use would otherwise alter ids and raise nothing."""
    b = _unique_ids_batch()
    path = _write_unchecked(tmp_path / "old.parquet", b)
    _flip_page(path, 1)
    with open_source(path) as src:
        got = SampleBatch.concat(list(src))
        assert src.stats["skipped"] == {}
    assert len(got) == len(b) and not got.equals(b)
    changed = np.flatnonzero(got.values[0] != b.values[0])
    assert changed.size and GROUP <= changed.min() and changed.max() < 2 * GROUP  # only row group 1's ids


def test_checksum_mismatch_under_strict_names_file_and_row_group(checked):
    b, path = checked
    with open_source(path) as src:
        assert src.read(10 * GROUP).equals(b.slice(0, GROUP))  # row group 0 is intact
        with pytest.raises(DataError) as info:
            src.read(10 * GROUP)
    err = info.value
    assert (err.source, err.position, err.reason) == (str(path), GROUP, "bad_checksum")
    text = str(err)
    assert f"row group 1 (rows {GROUP} to {2 * GROUP - 1}, 0-based) of {path}" in text
    assert "CRC checksum" in text and "herald convert" in text and "bad_records=skip" in text


def test_checksum_mismatch_under_skip_counts_the_group_and_reads_on(checked, tmp_path):
    b, path = checked
    q = tmp_path / "q.jsonl"
    with open_source(path, bad_records="skip", quarantine_path=str(q)) as src:
        got = SampleBatch.concat(list(src))
        assert src.stats["skipped"] == {"bad_checksum": GROUP}
    assert got.equals(SampleBatch.concat([b.slice(0, GROUP), b.slice(2 * GROUP, len(b))]))
    (line,) = [json.loads(x) for x in q.read_text().splitlines()]
    assert (line["file"], line["row_group"], line["rows"], line["reason"]) == (
        str(path),
        1,
        [GROUP, 2 * GROUP],
        "bad_checksum",
    )
    check_source_resume(lambda: open_source(path, bad_records="skip"), max_read=GROUP + 50)


def test_files_without_checksums_still_read(tmp_path):
    b = _unique_ids_batch()
    with open_source(_write_unchecked(tmp_path / "old.parquet", b)) as src:
        assert SampleBatch.concat(list(src)).equals(b)


def test_datagen_writes_page_checksums(tmp_path):
    out = tmp_path / "syn.parquet"
    datagen(out, rows=300, seed=1, row_group_rows=100, progress=False)
    _flip_page(out, 2, column="dense.list.element")
    with open_source(out) as src, pytest.raises(DataError) as info:
        list(src)
    assert (info.value.reason, info.value.position) == ("bad_checksum", 200)

"""NOTE [no input destroyed] (herald/loader/conversion.py): ``herald convert`` and
``herald datagen`` never write over an input, overwrite only with ``--force``, and create
no folder but the output's own."""

from __future__ import annotations

import os

import pytest

from herald.cli import main
from herald.errors import ConfigError, DataError
from herald.loader import convert, datagen, open_source

CRITEO = "criteo/criteo_kaggle_sample_dev.tsv"


@pytest.fixture
def tsv(tmp_path, data_dir):
    path = tmp_path / "a.tsv"
    path.write_bytes((data_dir / CRITEO).read_bytes())
    return path


def test_convert_onto_its_input_is_refused_and_the_input_kept(tsv, capsys):
    before = tsv.read_bytes()
    assert main(["convert", str(tsv), str(tsv), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "would destroy the input" in err and "Traceback" not in err
    assert main(["convert", str(tsv), str(tsv), "--quiet", "--force"]) == 1  # --force never overwrites an input
    link = tsv.with_name("link.tsv")
    os.link(tsv, link)  # the same file under another name
    with pytest.raises(ConfigError, match="would destroy the input"):
        convert(tsv, link, progress=False)
    sym = tsv.with_name("sym.parquet")
    sym.symlink_to(tsv)
    with pytest.raises(ConfigError, match="would destroy the input"):
        convert(tsv, sym, progress=False)
    assert tsv.read_bytes() == before
    assert sorted(p.name for p in tsv.parent.iterdir()) == ["a.tsv", "link.tsv", "sym.parquet"]  # no temporary left


def test_an_output_inside_an_input_folder_is_refused(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    datagen(folder / "a.parquet", rows=50, seed=1, progress=False)
    with pytest.raises(ConfigError, match="would destroy the input"):
        convert(folder, folder / "b.parquet", progress=False)


def test_an_existing_output_needs_force(tsv, tmp_path):
    out = tmp_path / "out.parquet"
    out.write_bytes(b"keep me")
    with pytest.raises(ConfigError, match="--force"):
        convert(tsv, out, progress=False)
    assert out.read_bytes() == b"keep me"
    res = convert(tsv, out, progress=False, force=True)
    with open_source(out) as src:
        assert src.num_rows == res["rows"] > 0


def test_only_the_output_folder_is_created(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        datagen(tmp_path / "missing" / "deeper" / "x.parquet", rows=10, progress=False)
    with pytest.raises(ConfigError, match="does not exist"):
        datagen(tmp_path / "missing" / "deeper", rows=10, progress=False)
    assert not (tmp_path / "missing").exists()
    out = datagen(tmp_path / "ds", rows=10, progress=False)  # DIR: its own folder is made
    assert out["path"] == str(tmp_path / "ds" / "part-00000.parquet")


def test_a_failed_write_leaves_the_old_output(tmp_path, data_dir):
    out = tmp_path / "out.parquet"
    out.write_bytes(b"old")
    bad = tmp_path / "bad.tsv"
    bad.write_text("not\ta\tcriteo\trow\n")
    with pytest.raises(DataError):
        convert(bad, out, progress=False, force=True, format="criteo")
    assert out.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv", "out.parquet"]

"""NOTE [no code from the current folder] (herald/procs.py): a ``herald.py`` and a
``herald/`` package in the folder a job is started from never run inside its roles."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

from herald.contracts.tables import TableConfig
from herald.contracts.train import TrainConfig
from herald.job.launcher import run_train
from herald.procs import Supervisor
from herald.ps import LocalShards, PSClient

pytestmark = pytest.mark.integration


@pytest.fixture
def hostile_cwd(tmp_path, monkeypatch) -> pathlib.Path:
    """A current folder holding a ``herald.py`` and a ``herald/`` package that each leave
    a marker file when imported (and break the import when they are)."""
    folder = tmp_path / "cwd"
    (folder / "herald").mkdir(parents=True)
    marker = tmp_path / "imported"
    code = f"open({str(marker)!r}, 'a').write(__file__ + '\\n')\nraise SystemExit('hostile herald imported')\n"
    (folder / "herald.py").write_text(code)
    (folder / "herald" / "__init__.py").write_text(code)
    (folder / "herald" / "__main__.py").write_text(code)
    monkeypatch.chdir(folder)
    return marker


def test_a_child_role_imports_the_installed_herald(hostile_cwd, tmp_path):
    with Supervisor(tmp_path / "logs") as sup:
        p = sup.start("probe", [sys.executable, "-c", "import herald, sys; print(herald.__file__)"])
        assert p.wait(60) == 0, sup.tail("probe")
        out = sup.tail("probe").strip()
    assert not hostile_cwd.exists()
    assert pathlib.Path(out).resolve() != (pathlib.Path.cwd() / "herald" / "__init__.py").resolve()


def test_ps_shards_started_from_a_hostile_folder_serve(hostile_cwd):
    tables = [TableConfig("a", 4)]
    with LocalShards(num_shards=1, tables=tables, seed=1) as shards:
        with PSClient(shards.addresses, tables, timeout_ms=30_000) as client:
            client.ping()
    assert not hostile_cwd.exists()


@pytest.mark.slow
def test_herald_train_from_a_hostile_folder(hostile_cwd, tmp_path):
    cfg = TrainConfig.from_flags(
        source="synthetic://criteo?rows=4000&seed=0",
        workers=2,
        batch_size=32,
        steps=4,
        eval_fraction=0.0,
        run_dir=str(tmp_path / "run"),
        timeout_ms=60_000,
    )
    result = run_train(cfg, progress=False)
    assert result["steps"] == 4
    assert not hostile_cwd.exists(), hostile_cwd.read_text()
    assert os.getcwd().endswith("cwd")

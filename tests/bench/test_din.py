"""``herald bench din`` run tiny (3 steps, 1 seed, real jobs): every figure is there, the
three runs share the split, and herald din equals the plain PyTorch DIN (BSP is one process)."""

from __future__ import annotations

import argparse
import json

import pytest

from herald.bench import din
from herald.bench.options import add_din_arguments

pytestmark = pytest.mark.integration


def test_bench_din_tiny(tmp_path, data_dir, capsys):
    p = argparse.ArgumentParser()
    add_din_arguments(p)
    args = p.parse_args(
        [
            "--source",
            str(data_dir / "movielens" / "ml-latest-small" / "ratings.csv"),
            "--seeds",
            "3",
            "--steps",
            "3",
            "--batch-size",
            "32",
            "--history",
            "5",
            "--eval-fraction",
            "0.02",
            "--run-dir",
            str(tmp_path / "runs"),
            "--out",
            str(tmp_path / "din.json"),
        ]
    )
    result = din.run(args)
    assert json.loads((tmp_path / "din.json").read_text()) == json.loads(json.dumps(result))
    (row,) = result["runs"]
    assert row["seed"] == 3
    for name in din.RUNS:
        assert set(row[name]) == {"auc", "logloss", "eval_rows", "steps", "seconds"}
        assert row[name]["steps"] == 3 and 0.0 < row[name]["auc"] < 1.0
    assert result["same_split"] and result["same_steps"] and row["herald_din"]["eval_rows"] > 1000
    assert row["auc_diff"] == abs(row["herald_din"]["auc"] - row["plain_din"]["auc"]) < din.TARGET_AUC_DIFF
    assert set(result["median"]) == {"herald_din_auc", "plain_din_auc", "herald_ncf_auc", "auc_diff"}
    assert result["settings"]["history"] == 5 and result["within_target"]
    out = capsys.readouterr().out
    assert "| seed | herald din AUC | plain din AUC |" in out and "| median |" in out

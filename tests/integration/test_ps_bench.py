"""``herald bench ps`` runs end to end (tiny sizes) through the CLI registry."""

from __future__ import annotations

import json

import pytest

from herald.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_bench_ps_cli_smoke(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "ps",
            "--dim",
            "8",
            "--keys",
            "100",
            "--threads",
            "1",
            "2",
            "--seconds",
            "0.1",
            "--repeats",
            "1",
            "--table-rows",
            "1000",
            "--transport",
            "tcp",
            "ipc",
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 0
    assert "| tcp | pull |" in capsys.readouterr().out
    results = json.loads((tmp_path / "r.json").read_text())
    assert (
        len(results) == 12
        and {r["transport"] for r in results} == {"tcp", "ipc"}
        and {r["op"] for r in results} == {"pull", "push_grad", "push_rows"}
    )
    assert all(r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in results)

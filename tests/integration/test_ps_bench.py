"""``herald bench ps`` runs end to end (tiny sizes) through the CLI registry."""

from __future__ import annotations

import json

import pytest

from herald.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_bench_ps_cli_smoke(capsys):
    rc = main(["bench", "ps", "--dim", "8", "--keys", "100", "--threads", "1", "2", "--seconds", "0.1",
               "--repeats", "1", "--table-rows", "1000", "--transport", "tcp", "ipc"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    results = json.loads(out[-1])
    assert len(results) == 12 and {r["transport"] for r in results} == {"tcp", "ipc"} and {r["op"] for r in results} == {"pull", "push_grad", "push_rows"}
    assert all(r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in results)

"""``herald bench step``: one shard's CPU time per global step, replayed in process."""

import json

import pytest

from herald.cli import main

KEYS = {
    "shard_ms_per_step",
    "requests_per_worker_per_shard",
    "parts_per_request",
    "rows_per_step",
    "per_request_us",
    "per_row_ns",
    "numba_limit_ns_per_row",
    "ratio_vs_numba_limit",
    "repeats",
    "settings",
    "arrivals",
}


def test_bench_step_writes_its_figures(tmp_path):
    out = tmp_path / "step.json"
    rc = main(
        [
            "bench",
            "step",
            "--workers",
            "2",
            "--shards",
            "2",
            "--batch-size",
            "32",
            "--steps",
            "2",
            "--warmup",
            "2",
            "--cache-ratio",
            "0.5",
            "--repeats",
            "3",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert KEYS <= set(res)
    assert res["settings"]["workers"] == 2 and res["settings"]["shards"] == 2 and res["settings"]["steps"] == 2
    assert res["shard_ms_per_step"] > 0 and res["rows_per_step"] > 0 and res["numba_limit_ns_per_row"] > 0
    # three replays of the same messages by fresh shards: the same rows, each its own timing and limit
    assert len(res["repeats"]) == 3 and res["settings"]["repeats"] == 3
    ratios = sorted(r["ratio_vs_numba_limit"] for r in res["repeats"])
    assert res["ratio_vs_numba_limit"] == ratios[1] > 0
    assert all(r["shard_ns_per_row"] > 0 and r["numba_limit_ns_per_row"] > 0 for r in res["repeats"])
    # the real client packing: one step message per worker per shard, one flat part per op section
    assert res["parts_per_request"] == 1.0 and res["requests_per_worker_per_shard"] == 1.0
    assert 1 <= res["sections_per_request"] <= 4  # with the dense section (NOTE [dense gradients on the shards])
    assert res["settings"]["dense_params"] == 27_601  # herald's DLRM on the synthetic Criteo rows
    assert {"pull", "push_grad"} <= set(res["per_row_ns"]) <= {"push_rows", "push_grad", "pull"}
    # NOTE [step arrivals]: every replayed step (warm-up in), the rank replayed last came last
    arr = res["arrivals"]
    assert arr["steps"] == 4 and [p[1] for p in arr["per_step"]] == [1, 1, 1, 1]
    assert all(p[2] > 0 for p in arr["per_step"]) and [r["rank"] for r in arr["by_rank"]] == [0, 1]


def test_bench_step_refuses_no_repeat():
    with pytest.raises(SystemExit, match="--repeats must be >= 1"):
        main(
            [
                "bench",
                "step",
                "--workers",
                "2",
                "--shards",
                "1",
                "--batch-size",
                "8",
                "--steps",
                "1",
                "--warmup",
                "1",
                "--repeats",
                "0",
            ]
        )

"""``herald bench kernels`` runs and reports both sides (ours and FBGEMM)."""

import json

from herald.bench.kernel_speed import fbgemm_modules
from herald.cli import main


def test_bench_kernels_smoke_reports_ours_and_fbgemm(tmp_path):
    out = tmp_path / "kernels.json"
    rc = main(
        [
            "bench",
            "kernels",
            "--batch",
            "8",
            "--tables",
            "2",
            "--dims",
            "4",
            "--bags",
            "1",
            "3",
            "--rows-per-table",
            "50",
            "--optimizers",
            "sgd",
            "rowwise_adagrad",
            "adam",
            "--reps",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert len(res["cases"]) == 2 * 3
    for c in res["cases"]:
        assert c["ours_ms"] > 0 and c["ours_fused_ms"] > 0 and c["distinct_rows"] > 0
    have_fbgemm = fbgemm_modules() is not None
    assert res["fbgemm"]["available"] is have_fbgemm
    by_opt = {c["optimizer"]: c for c in res["cases"]}
    if have_fbgemm:  # fbgemm-gpu-cpu is an optional dependency (pip install herald[torchrec])
        assert by_opt["sgd"]["fbgemm_ms"] > 0 and by_opt["rowwise_adagrad"]["fbgemm_ms"] > 0
        assert by_opt["adam"]["fbgemm_ms"] is None and "adam" in by_opt["adam"]["fbgemm_why"]
        arith = res["arithmetic"]["rowwise_adagrad"]["4"]
        assert arith["supported"] and arith["max_rel_diff_embedding"] >= 0 and "within_1e-6" in arith
        assert res["arithmetic"]["adam"]["4"]["supported"] is False
    else:
        assert "pip install" in res["fbgemm"]["install"] and all(c["fbgemm_ms"] is None for c in res["cases"])

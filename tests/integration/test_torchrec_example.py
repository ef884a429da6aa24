"""examples/train_torchrec_dlrm.py: TorchRec's DLRM dense part trained on herald's
micro-batches, with herald's PS and dispatcher as real processes (docs/torchrec.md)."""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

if os.environ.get("CI", "").lower() != "true":  # CI installs torchrec (make torchrec): a missing one fails there
    pytest.importorskip("torchrec")

pytestmark = pytest.mark.integration

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS = 30


def test_torchrec_dlrm_example_trains_and_the_job_completes():
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "train_torchrec_dlrm.py"),
            "--steps",
            str(STEPS),
            "--batch-size",
            "128",
            "--log-every",
            "10",
            "--source",
            "synthetic://criteo?rows=20000&seed=0",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=400,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert "step 0: loss" in out
    summary = re.search(r"trained (\d+) steps: mean loss of the first \d+ (\S+), of the last \d+ (\S+)", out)
    assert summary is not None, out[-3000:]
    steps, first, last = int(summary[1]), float(summary[2]), float(summary[3])
    assert steps == STEPS  # every step of the job reached the worker
    assert math.isfinite(first) and math.isfinite(last)
    assert last < first, out[-3000:]  # it learns (deterministic: seeded data, PS, model)

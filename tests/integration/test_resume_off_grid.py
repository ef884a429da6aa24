"""``herald train --resume`` from a checkpoint off the checkpoint grid: a job ended by
``--steps``, by SIGTERM, or rolled back by a failover to such a checkpoint, and resumed,
ends with the uninterrupted run's model bit for bit (PS rows with their optimizer state,
dense parameters), under bsp and under bounded staleness.

Why it is exact: NOTE [warm resume] (herald/dispatch/warm.py). The uninterrupted run has no
barrier where the stopped one ended, so its caches stay warm and its scheduler goes on;
the final barrier off the grid saves the scheduler's warm state, every worker's cache
(rows, slot map, HET's clocks) and the PS rows' clocks, and the resumed job loads them.
Without them the resumed allocation differs from the first resumed step, and under bounded
staleness other copies are read stale (the gaps measured: docs/results/2026-12-resume.md).

The runs are small (4,000 synthetic rows, 2 workers x 32, 60 steps, a checkpoint every 20).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from proc_tree import descendants

from herald.contracts.train import TrainConfig
from herald.job.launcher import run_train
from herald.loader import datagen

pytestmark = pytest.mark.integration

WORKERS, BATCH, EVERY, STEPS = 2, 32, 20, 60
GB = WORKERS * BATCH
#: --consistency flags: bsp, and bounded at s = 1, where the copies' clocks decide the stale reads
MODES = {"bsp": {}, "bounded": {"consistency": "bounded", "staleness": 1}}
#: A job with declared tables (NOTE [tables and features] in herald/contracts/features.py): C1
#: and C2 share one table (C2 mean-pooled), at widths 8 (sgd), 2 and 4 (adagrad): NOTE [mixed widths]
LAYOUT = """
[tables.shared]
dim = 8
optimizer = "sgd"
lr = 0.2
[tables.narrow]
dim = 2
[features.C1]
table = "shared"
[features.C2]
table = "shared"
pooling = "mean"
[features.C3]
table = "narrow"
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("off-grid") / "synthetic.parquet"
    datagen(path, rows=4000, seed=11, progress=False)  # 62 global batches: one epoch holds STEPS
    (path.parent / "tables.toml").write_text(LAYOUT)
    return path


@pytest.fixture(scope="module")
def whole(tmp_path_factory, source):
    """``whole(mode)``: the run folder of the uninterrupted job of ``mode`` (run once per module)."""
    runs: dict[str, pathlib.Path] = {}

    def get(mode: str) -> pathlib.Path:
        if mode not in runs:
            runs[mode] = tmp_path_factory.mktemp(f"whole-{mode}")
            _train(source, runs[mode], STEPS, mode)
        return runs[mode]

    return get


def _flags(source, run_dir, steps: int, mode: str) -> dict:
    return {
        "source": str(source),
        "workers": WORKERS,
        "batch_size": BATCH,
        "cache_rows": 1200,
        "embedding_dim": 4,
        "optimizer": "adagrad",
        "dense_optimizer": "adam",
        "dense_lr": 0.01,
        "steps": steps,
        "eval_fraction": 0.0,
        "seed": 3,
        "checkpoint_every": EVERY,
        "run_dir": str(run_dir),
        "timeout_ms": 60_000,
        "log_sample_ids": True,
        **(MODES[mode] if mode != "layout" else {"tables": str(source.parent / "tables.toml"), "model": "dcn"}),
    }


def _train(source, run_dir, steps: int, mode: str, resume: bool = False) -> dict:
    return run_train(TrainConfig.from_flags(**_flags(source, run_dir, steps, mode), resume=resume), progress=False)


def _cli(source, run_dir, steps: int, mode: str, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "herald", "train", "--quiet"]
    for key, value in _flags(source, run_dir, steps, mode).items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args + list(extra)


def _ps_rows(checkpoint: pathlib.Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Every PS row (embedding + optimizer state) of a checkpoint: table -> (keys, rows), key-sorted."""
    out = {}
    for manifest in sorted(checkpoint.glob("ps/shard-*/manifest.json")):
        for t, entry in enumerate(json.loads(manifest.read_text())["tables"]):
            keys = np.fromfile(manifest.parent / entry["keys"]["file"], entry["keys"]["dtype"])
            rows = np.fromfile(manifest.parent / entry["rows"]["file"], entry["rows"]["dtype"])
            rows = rows.reshape(entry["rows"]["shape"])
            have_k, have_r = out.get(t, (np.zeros(0, np.uint64), np.zeros((0, rows.shape[1]), np.float32)))
            out[t] = (np.concatenate([have_k, keys]), np.concatenate([have_r, rows]))
    return {t: (k[np.argsort(k)], r[np.argsort(k)]) for t, (k, r) in out.items()}


def _ids(run_dir) -> np.ndarray:
    return np.fromfile(pathlib.Path(run_dir) / "trained_sample_ids.u64", np.uint64)


def _checkpoint_step(run_dir) -> int:
    root = pathlib.Path(run_dir) / "checkpoints"
    return json.loads((root / (root / "latest").read_text().strip() / "meta.json").read_text())["step"]


def _assert_warm_checkpoint(run_dir, step: int) -> None:
    """The checkpoint of ``step`` (off the grid) holds the warm state: NOTE [warm resume]."""
    folder = pathlib.Path(run_dir) / "checkpoints" / f"step-{step:08d}"
    assert (step + 1) % EVERY != 0, f"step {step} is on the checkpoint grid"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["dispatcher"]["warm"]["file"] == "scheduler-warm.npz", meta["dispatcher"]
    for name in ["scheduler-warm.npz"] + [f"cache-rank{r}.npz" for r in range(WORKERS)]:
        assert (folder / name).is_file(), f"{folder} has no {name}"
    manifests = [json.loads(m.read_text()) for m in folder.glob("ps/shard-*/manifest.json")]
    assert manifests and all("clocks" in t for m in manifests for t in m["tables"]), "no PS clocks saved"


def _assert_bit_identical(resumed: pathlib.Path, whole: pathlib.Path) -> None:
    """The same samples trained in the same steps, and the same model bit for bit."""
    assert np.array_equal(_ids(resumed), _ids(whole)[: _ids(resumed).size]) and _ids(resumed).size >= STEPS * GB
    final = f"checkpoints/step-{STEPS - 1:08d}"
    a, b = _ps_rows(resumed / final), _ps_rows(whole / final)
    assert a.keys() == b.keys() and a
    for t in a:
        assert np.array_equal(a[t][0], b[t][0]), f"table {t}: the resumed job's PS holds other keys"
        worst = float(np.abs(a[t][1] - b[t][1]).max())
        assert np.array_equal(a[t][1], b[t][1]), f"table {t}: PS rows differ by up to {worst}"
    da = torch.load(resumed / "dense-rank0.pt", weights_only=True)
    db = torch.load(whole / "dense-rank0.pt", weights_only=True)
    assert da.keys() == db.keys()
    for k in da:
        worst = float((da[k] - db[k]).abs().max())
        assert torch.equal(da[k], db[k]), f"dense parameter {k} differs by up to {worst}"


@pytest.mark.slow  # ~40 s a case (2 shared cores): a job stopped by --steps, then resumed
@pytest.mark.parametrize("stop", [25, 27])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_job_ended_by_steps_off_the_grid_resumes_bit_for_bit(tmp_path, source, whole, mode, stop):
    parts = tmp_path / "parts"
    _train(source, parts, stop, mode)
    _assert_warm_checkpoint(parts, stop - 1)
    rep = _train(source, parts, STEPS, mode, resume=True)
    assert rep["steps"] == STEPS - stop
    _assert_bit_identical(parts, whole(mode))


def _wait_for_ids(job: subprocess.Popen, run_dir: pathlib.Path, size: int, timeout_s: float = 120) -> None:
    """Wait until ``size`` sample ids are logged (steps acked), failing if the job ends first."""
    ids, deadline = run_dir / "trained_sample_ids.u64", time.monotonic() + timeout_s
    while not (ids.exists() and ids.stat().st_size >= 8 * size):
        assert job.poll() is None, f"herald train ended too early: {job.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"fewer than {size} samples trained within {timeout_s} s"
        time.sleep(0.01)


@pytest.mark.slow  # ~40 s a case (2 shared cores)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_job_stopped_by_sigterm_off_the_grid_resumes_bit_for_bit(tmp_path, source, whole, mode):
    """SIGTERM after step 21: the job trains the steps already read, writes its final checkpoint
    off the grid, exits 143; resumed, it ends with the uninterrupted model."""
    parts = tmp_path / "parts"
    job = subprocess.Popen(_cli(source, parts, STEPS, mode), stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_ids(job, parts, 22 * GB)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
    assert job.returncode == 143, err[-3000:]
    stopped = _checkpoint_step(parts)
    assert 21 <= stopped < 2 * EVERY - 1, f"the job stopped at step {stopped}"
    _assert_warm_checkpoint(parts, stopped)
    _train(source, parts, STEPS, mode, resume=True)
    _assert_bit_identical(parts, whole(mode))


@pytest.mark.slow  # ~40 s (2 shared cores)
def test_a_job_of_shared_tables_and_several_widths_resumes_bit_for_bit(tmp_path, source, whole):
    """Declared tables (a shared one, three widths, two optimizers) through a stop off the grid
    and a resume: the uninterrupted model bit for bit."""
    test_a_job_ended_by_steps_off_the_grid_resumes_bit_for_bit(tmp_path, source, whole, "layout", 25)
    report = json.loads((tmp_path / "parts" / "report.json").read_text())
    assert [t["dim"] for t in report["embeddings"]["tables"][:2]] == [8, 2]


@pytest.mark.slow  # ~60 s (2 shared cores): a job, its resume, a kill -9 and a rollback
@pytest.mark.parametrize("mode", ["bsp", "layout"])
def test_a_failover_back_to_a_checkpoint_off_the_grid_is_bit_for_bit(tmp_path, source, whole, mode):
    """A job ended by --steps 25 is resumed to 60 with --worker-restarts 1; worker rank 1 is
    killed -9 two steps later, the job rolls back to the warm checkpoint of step 24 (NOTE
    [worker failover] in herald/job/recovery/rollback.py) and ends with the uninterrupted model."""
    parts = tmp_path / "parts"
    _train(source, parts, 25, mode)
    before = _ids(parts).size
    args = _cli(source, parts, STEPS, mode, "--resume", "--worker-restarts", "1")
    job = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_ids(job, parts, before + 2 * GB)
        victim = next(pid for pid, cmd in descendants(job.pid) if "serve worker" in cmd and "--rank 1 " in cmd)
        os.kill(victim, signal.SIGKILL)
        _, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
    assert job.returncode == 0, err[-3000:]
    failovers = json.loads((parts / "report.json").read_text())["failovers"]
    assert [f["rolled_back_to"] for f in failovers] == ["step-00000024"], failovers
    # the steps between the checkpoint and the kill were trained twice: compare past them
    ids, want = _ids(parts), _ids(whole(mode))
    assert np.array_equal(ids[: 25 * GB], want[: 25 * GB])
    assert np.array_equal(ids[-(STEPS - 25) * GB :], want[25 * GB : STEPS * GB])
    final = f"checkpoints/step-{STEPS - 1:08d}"
    a, b = _ps_rows(parts / final), _ps_rows(whole(mode) / final)
    assert a.keys() == b.keys() and all(
        np.array_equal(a[t][0], b[t][0]) and np.array_equal(a[t][1], b[t][1]) for t in a
    )
    da = torch.load(parts / "dense-rank0.pt", weights_only=True)
    db = torch.load(whole(mode) / "dense-rank0.pt", weights_only=True)
    assert all(torch.equal(da[k], db[k]) for k in db)

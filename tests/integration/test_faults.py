"""``herald train`` under faults, as a user runs it (real processes, the CLI): corrupt
data, a diverging loss, SIGINT / SIGTERM. Each case is small (3,000 rows, batch 32,
2 workers); docs/operations.md lists what the user sees and what to do.
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
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from herald.job.checkpoints import Checkpointer, latest
from herald.loader.batch import SampleBatch
from herald.loader.formats.arrow import batch_to_arrow

pytestmark = pytest.mark.integration

ROWS = 3000
BAD = {100: "bad_dense", 200: "bad_dense", 300: "bad_label", 400: "bad_label", 2990: "bad_dense"}


def _parquet(path: pathlib.Path, bad: bool) -> pathlib.Path:
    rng = np.random.default_rng(5)
    labels = (rng.random(ROWS) < 0.3).astype(np.float32)
    dense = rng.normal(size=(ROWS, 4)).astype(np.float32)
    if bad:  # NaN and 3e38 dense values, NaN and out-of-range labels; row 2990 is in the held-out split
        dense[100, 1], dense[200, 2], dense[2990, 3] = np.nan, 3e38, np.inf
        labels[300], labels[400] = np.nan, 2.0
    ids = rng.integers(0, 400, (ROWS, 3)).astype(np.uint64)
    batch = SampleBatch.from_single_hot(labels, dense, ids, ["t0", "t1", "t2"])
    pq.write_table(pa.Table.from_batches([batch_to_arrow(batch)]), path, row_group_size=1000)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return {"bad": _parquet(root / "bad.parquet", True), "good": _parquet(root / "good.parquet", False)}


def _cmd(source, run_dir, *extra):
    return [
        sys.executable,
        "-m",
        "herald",
        "train",
        "--source",
        str(source),
        "--workers",
        "2",
        "--batch-size",
        "32",
        "--embedding-dim",
        "4",
        "--eval-fraction",
        "0.1",
        "--run-dir",
        str(run_dir),
        "--timeout-ms",
        "60000",
        *extra,
    ]


def _run(*args, timeout=240):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def _report(run_dir) -> dict:
    return json.loads((pathlib.Path(run_dir) / "report.json").read_text())


def test_corrupt_data_strict_names_the_file_and_row_before_training(tmp_path, data):
    done = _run(*_cmd(data["bad"], tmp_path / "run", "--quiet"))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert f"bad record at row 100 (0-based) of {data['bad']}: bad_dense: dense feature 1 is nan" in done.stderr
    assert "bad_records=skip" in done.stderr
    assert not (tmp_path / "run" / "worker-0.log").exists()  # found by the pre-pass, nothing started


def test_corrupt_data_skipped_counted_reported_and_quarantined_once(tmp_path, data):
    q = tmp_path / "quarantine.jsonl"
    run_dir = tmp_path / "run"
    done = _run(
        *_cmd(
            data["bad"],
            run_dir,
            "--source-option",
            "bad_records=skip",
            "--source-option",
            f"quarantine_path={q}",
            "--eval-every",
            "10",
        )
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rep = _report(run_dir)
    assert rep["skipped"] == {"train": {"bad_dense": 2, "bad_label": 2}, "eval": {"bad_dense": 1}}
    assert np.isfinite(rep["final_loss"]) and np.isfinite(rep["metrics"]["logloss"])
    assert rep["metrics"]["dense_replicas_equal"] is True
    text = (run_dir / "report.txt").read_text()
    assert "bad records skipped (training split): 4 (bad_dense 2, bad_label 2)" in text
    assert "bad records skipped (held-out split): 1 (bad_dense 1)" in text
    assert "(bad records skipped: bad_dense 2, bad_label 2)" in done.stdout + done.stderr  # the progress lines
    quarantined = [json.loads(line) for line in q.read_text().splitlines()]
    assert sorted((r["row"], r["reason"]) for r in quarantined) == sorted(BAD.items())  # each bad record once


def test_diverging_loss_stops_the_job_naming_step_rank_and_cause(tmp_path, data):
    done = _run(
        *_cmd(
            data["good"],
            tmp_path / "run",
            "--quiet",
            "--cache-rows",
            "500",
            "--dense-optimizer",
            "sgd",
            "--dense-lr",
            "1e30",
        )
    )
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("herald: error: rank "), done.stderr[-3000:]
    assert "at step " in last and "training diverged" in last and "learning rate too high" in last
    assert "--dense-lr 1e+30" in last and "bad input" in last
    assert not (tmp_path / "run" / "report.json").exists()


def _wait_for_checkpoint(run_dir: pathlib.Path, job: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while latest(run_dir / "checkpoints") is None:
        assert job.poll() is None, "training ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.1)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_run_exits_128_plus_signal_and_says_so(tmp_path, data, sig, code):
    run_dir = tmp_path / "run"
    args = _cmd(
        data["bad"],
        run_dir,
        "--quiet",
        "--cache-rows",
        "500",
        "--checkpoint-every",
        "5",
        "--epochs",
        "30",
        "--source-option",
        "bad_records=skip",
    )
    job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_checkpoint(run_dir, job)
        os.kill(job.pid, sig)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == code, err[-3000:]
    rep = _report(run_dir)
    stop = rep["interrupted"]
    assert stop["signal"] == sig.name and stop["at_step"] == rep["steps"] > 0
    ckpt = latest(run_dir / "checkpoints")
    assert stop["checkpoint"] == ckpt.path.name and ckpt.meta["dispatcher"]["next_step"] == stop["at_step"]
    assert (run_dir / "report.txt").read_text().startswith(f"interrupted at step {stop['at_step']} by {sig.name}")
    assert err.strip().splitlines()[-1].startswith(f"herald: interrupted by {sig.name} at step {stop['at_step']}")
    if sig == signal.SIGTERM:
        return
    # the checkpoint carries the skip counts, and a resumed run reports those of the whole job
    assert ckpt.meta["skipped"] == ckpt.meta["dispatcher"]["batches"]["skipped"]
    assert set(ckpt.meta["skipped"]) <= {"bad_dense", "bad_label"} and ckpt.meta["skipped"]
    done = _run(*args, "--steps", str(stop["at_step"] + 50), "--resume")  # into the second epoch
    assert done.returncode == 0, done.stderr[-3000:]
    assert _report(run_dir)["skipped"]["train"] == {"bad_dense": 2, "bad_label": 2}


def test_checkpoint_meta_holds_the_skip_counts(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", lambda path: os.makedirs(path))
    state = {"format": "dispatcher", "batches": {"format": "global_batches", "skipped": {"bad_label": 3}}}
    ckpt.save(7, 7, ckpt.staging_path(7), state)
    assert latest(tmp_path / "ckpt").meta["skipped"] == {"bad_label": 3}


@pytest.mark.slow  # ~45 s (2 shared cores): a job killed, then resumed
def test_kill_9_leftovers_are_removed_by_the_resumed_run_and_checkpoints_are_private(tmp_path, data):
    """NOTE [run leftovers] and NOTE [private files] on a real job: its PS folder, its
    dispatcher's socket folder and its store file outlive a kill -9; the resumed run
    removes them (and leaves none of its own)."""
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))  # the job's PS and socket folders where this test looks
    args = _cmd(data["good"], run_dir, "--quiet", "--cache-rows", "500", "--checkpoint-every", "5", "--epochs", "30")
    old = os.umask(0o022)
    try:
        job = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    finally:
        os.umask(old)
    try:
        _wait_for_checkpoint(run_dir, job)
        os.kill(job.pid, signal.SIGKILL)
        job.wait(60)
    finally:
        if job.poll() is None:
            job.kill()
    left = [
        *sorted(tmp.glob("herald-ps-*")),
        *sorted(tmp.glob("herald-dispatch-*")),
        *sorted(run_dir.glob(".dist-store-*")),
    ]
    assert len(left) == 3 and [p.name for p in run_dir.glob(".owner-*.json")] == [f".owner-{job.pid}.json"]
    ckpts = run_dir / "checkpoints"  # written under umask 022 by the job, its shards and its rank 0
    entries = [ckpts, *ckpts.rglob("*")]
    files = {p.name: p.stat().st_mode & 0o777 for p in entries if p.is_file()}
    assert {p.stat().st_mode & 0o777 for p in entries if p.is_dir()} == {0o700}
    assert set(files.values()) == {0o600} and {"dense.pt", "meta.json", "latest", "manifest.json"} <= set(files)
    done = subprocess.run(
        [*args, "--resume", "--steps", str(latest(ckpts).step + 3)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"removed what the killed run (pid {job.pid}) left: " in done.stderr
    assert not any(p.exists() for p in left) and list(tmp.glob("herald-*")) == []
    assert not list(run_dir.glob(".owner-*")) and not list(run_dir.glob(".dist-store-*"))
    assert {p.stat().st_mode & 0o777 for p in run_dir.glob("dense-rank*.pt")} == {0o600}

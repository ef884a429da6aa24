"""``herald train --resume`` for file sources: a job stopped after a checkpoint (at a
checkpoint step, or by a real kill -9 of ``herald train``) and resumed from the same
run folder trains exactly the model of an uninterrupted run.

Why it is exact: NOTE [checkpoint barrier] (herald/dispatch/dispatcher.py). At a
barrier the caches are emptied and a fresh scheduler starts, so the job goes on from
the PS rows, the dense state and the dispatcher's state (next step, next batch, the
producer's source position) alone, which is what a checkpoint holds.
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

from herald.contracts.job import JobSpec
from herald.contracts.tables import TableConfig
from herald.contracts.train import TrainConfig
from herald.dispatch.dispatcher import Dispatcher, DispatcherConfig
from herald.errors import ConfigError, DataError, HeraldError
from herald.job.launcher import run_train
from herald.loader import datagen, open_source
from herald.loader.global_batches import GlobalBatches

pytestmark = pytest.mark.integration

WORKERS, BATCH, EVERY, STEPS = 2, 32, 8, 24
GB = WORKERS * BATCH


@pytest.fixture(scope="module")
def sources(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("resume-data")
    pq = root / "synthetic.parquet"
    datagen(pq, rows=3000, seed=11, progress=False)
    tsv = root / "criteo_prefix.tsv"  # a prefix of the real Criteo sample
    lines = (data_dir / "criteo" / "criteo_kaggle_sample_train.tsv").read_bytes().splitlines(keepends=True)
    tsv.write_bytes(b"".join(lines[:2500]))
    return {"parquet": pq, "tsv": tsv}


def _flags(source, run_dir, steps):
    return {
        "source": str(source),
        "workers": WORKERS,
        "batch_size": BATCH,
        "cache_rows": 1200,
        "embedding_dim": 4,
        "dense_optimizer": "adam",
        "dense_lr": 0.01,
        "steps": steps,
        "eval_fraction": 0.0,
        "seed": 3,
        "checkpoint_every": EVERY,
        "run_dir": str(run_dir),
        "timeout_ms": 60_000,
        "log_sample_ids": True,
    }


def _train(source, run_dir, steps, resume=False):
    return run_train(TrainConfig.from_flags(**_flags(source, run_dir, steps), resume=resume), progress=False)


def _cli(source, run_dir, steps):
    args = [sys.executable, "-m", "herald", "train", "--quiet"]
    for key, value in _flags(source, run_dir, steps).items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


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


def _assert_same_model(resumed: pathlib.Path, whole: pathlib.Path) -> None:
    final = f"checkpoints/step-{STEPS - 1:08d}"
    a, b = _ps_rows(resumed / final), _ps_rows(whole / final)
    assert a.keys() == b.keys() and a
    for t in a:
        assert np.array_equal(a[t][0], b[t][0]), f"table {t}: the resumed job's PS holds other keys"
        worst = float(np.abs(a[t][1] - b[t][1]).max())
        assert worst <= 1e-6, f"table {t}: PS rows differ by {worst}"
    da = torch.load(resumed / "dense-rank0.pt", weights_only=True)
    db = torch.load(whole / "dense-rank0.pt", weights_only=True)
    assert da.keys() == db.keys()
    worst = max(float((da[k] - db[k]).abs().max()) for k in da)
    assert worst <= 1e-6, f"dense parameters differ by {worst}"


def _kill_after_first_checkpoint(args: list[str], run_dir: pathlib.Path) -> int:
    """Run ``herald train`` and kill -9 it as soon as a checkpoint is complete; the step of it."""
    job = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        latest = run_dir / "checkpoints" / "latest"
        deadline = time.monotonic() + 120
        while not latest.exists():
            assert job.poll() is None, f"herald train ended before its first checkpoint: {job.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.01)
        children = [pid for pid, _ in descendants(job.pid)]
        os.kill(job.pid, signal.SIGKILL)
        assert job.wait(10) == -signal.SIGKILL, "herald train had already finished: kill it earlier"
        gone = time.monotonic() + 10  # its PS shard and workers die with it
        while any(pathlib.Path(f"/proc/{c}").exists() for c in children) and time.monotonic() < gone:
            time.sleep(0.05)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
        job.stderr.close()
    step = json.loads((run_dir / "checkpoints" / latest.read_text().strip() / "meta.json").read_text())["step"]
    assert step < STEPS - 1, f"the killed job had already checkpointed step {step}"
    return step


@pytest.mark.slow  # ~25 s a case (2 shared cores): a job, then its resumed run
@pytest.mark.parametrize("kind,stop", [("parquet", "at_checkpoint_step"), ("tsv", "kill_minus_9")])
def test_resumed_job_trains_the_uninterrupted_model(tmp_path, sources, kind, stop):
    source = sources[kind]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    rep = _train(source, whole, STEPS)
    assert rep["steps"] == STEPS and rep["transmissions"]["evict_push"] > 0, "the cache was never under pressure"

    if stop == "at_checkpoint_step":
        _train(source, parts, 2 * EVERY)  # stops right after the checkpoint of step 2 * EVERY - 1
        stopped_at = 2 * EVERY - 1
        trained_before = _ids(parts).size
    else:
        stopped_at = _kill_after_first_checkpoint(_cli(source, parts, STEPS), parts)
        trained_before = _ids(parts).size  # may include steps after the checkpoint (replayed)
    assert (stopped_at + 1) % EVERY == 0

    rep = _train(source, parts, STEPS, resume=True)
    assert rep["steps"] == STEPS - stopped_at - 1, "--steps counts the job's total steps"
    # the resumed dispatcher continues at the next step and the next global batch
    ids = _ids(whole)
    assert np.array_equal(_ids(parts)[trained_before:], ids[(stopped_at + 1) * GB :])
    assert np.array_equal(_ids(parts)[: (stopped_at + 1) * GB], ids[: (stopped_at + 1) * GB])
    _assert_same_model(parts, whole)
    meta = json.loads((parts / f"checkpoints/step-{STEPS - 1:08d}/meta.json").read_text())
    assert meta["dispatcher"]["next_step"] == meta["dispatcher"]["next_batch"] == STEPS
    assert meta["dispatcher"]["batches"]["info"]["batches"] == STEPS


def test_dispatcher_state_is_validated(sources):
    tables = tuple(TableConfig(name=f"t{i}", dim=4) for i in range(26))
    job = JobSpec(tables=tables, dense_dim=13, ps=("ipc:///nowhere",))
    batches = GlobalBatches(open_source(sources["parquet"]), GB)
    with Dispatcher(DispatcherConfig(num_workers=WORKERS), batches, lambda: None, job) as disp:
        good = json.loads(json.dumps(disp.state_dict()))
        assert good["next_step"] == good["next_batch"] == 0 and good["batches"]["format"] == "global_batches"
        for bad, err in [
            (None, DataError),
            ({**good, "format": "scheduler"}, DataError),
            ({**good, "next_step": -1}, DataError),
            ({**good, "next_batch": "2"}, DataError),
            ({**good, "checkpoints": [5]}, DataError),
            ({**good, "num_workers": 3}, ConfigError),
            ({**good, "batches": {**good["batches"], "global_batch": 32}}, ConfigError),
        ]:
            with pytest.raises(err):
                disp.load_state_dict(bad)
        disp.load_state_dict({**good, "next_step": 7, "next_batch": 7, "checkpoints": [3]})
        assert disp.next_step == 7 and disp.state_dict()["checkpoints"] == [3]
    batches.close()
    with Dispatcher(DispatcherConfig(num_workers=WORKERS), [], lambda: None, job) as disp:
        with pytest.raises(ConfigError, match="cannot load"):
            disp.load_state_dict(good)
        disp.barriers.at_barrier = False  # as between two barriers
        with pytest.raises(HeraldError, match="checkpoint barrier"):
            disp.state_dict()


#: --consistency flags of the failover tests: BSP, and GBA with iota = 0 (NOTE [gba checkpoints]).
_FAILOVER_MODES = {"bsp": {}, "gba": {"consistency": "gba", "gba_threshold": 0}}


def _kill_mid_job(tmp_path, source, extra: dict, flags: list[str], role: tuple[str, ...]):
    """A job run whole, then the same job with ``flags``, whose process with every string of
    ``role`` in its command line (a child, or further down: a Ray actor's) is killed -9 after
    the first checkpoint (step EVERY - 1) and
    two more steps. The job must roll back once and end with the whole run's model. Returns (the
    failed-over job's run folder, its stderr, its report, the kill's Unix time)."""
    whole, failed = tmp_path / "whole", tmp_path / "failover"
    run_train(TrainConfig.from_flags(**_flags(source, whole, STEPS), **extra), progress=False)
    args = _cli(source, failed, STEPS) + flags
    for key, value in extra.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        latest, ids = failed / "checkpoints" / "latest", failed / "trained_sample_ids.u64"
        deadline = time.monotonic() + 120
        # the first checkpoint (step EVERY - 1) and 2 steps after it acked (their sample ids logged)
        while not (latest.exists() and ids.exists() and ids.stat().st_size >= (EVERY + 2) * GB * 8):
            assert job.poll() is None and time.monotonic() < deadline, "no checkpoint before the end of the job"
            time.sleep(0.01)
        victim = next(pid for pid, cmd in descendants(job.pid) if all(part in cmd for part in role))
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        out, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
    assert job.returncode == 0, err[-3000:]
    assert "rolling the job back to checkpoint" in err, err[-3000:]
    _assert_same_model(failed, whole)
    return failed, err, json.loads((failed / "report.json").read_text()), killed_at


def _assert_one_rollback(failed: pathlib.Path, report: dict) -> tuple[int, int]:
    """The report of a job rolled back once after step EVERY + 1: its failover, every attempt
    counted (herald/job/report/attempts.py). Returns (the checkpoint's step, the last step acked before)."""
    assert len(report["failovers"]) == 1 and report["failovers"][0]["rolled_back_to"].startswith("step-")
    failover = report["failovers"][0]
    rolled_back, last = int(failover["rolled_back_to"][len("step-") :]), failover["last_acked_step"]
    assert failover["checkpoint_step"] == rolled_back and last >= EVERY + 1 and last > rolled_back
    assert failover["steps_rolled_back"] == last - rolled_back and failover["lost_at_step"] == last + 1
    assert failover["recovered_s"] > 0
    # every attempt counted: steps 0..last, then the checkpoint's next step to the end; the steps
    # between the checkpoint and the failure were trained twice
    attempts = report["attempts"]
    assert [(a["first_step"], a["last_step"], a["steps"]) for a in attempts] == [
        (0, last, last + 1),
        (rolled_back + 1, STEPS - 1, STEPS - rolled_back - 1),
    ]
    assert report["steps"] == last + 1 + STEPS - rolled_back - 1 == sum(a["steps"] for a in attempts)
    assert report["samples"] == report["steps"] * GB == sum(a["samples"] for a in attempts)
    assert report["retrained_steps"] == [[rolled_back + 1, last]]
    assert report["train_seconds"] == pytest.approx(sum(a["train_seconds"] for a in attempts))
    text = (failed / "report.txt").read_text()
    assert f"steps {report['steps']} " in text, text
    assert f"steps trained again: {rolled_back + 1}-{last} ({last - rolled_back} steps)" in text, text
    return rolled_back, last


@pytest.mark.slow  # ~25 s a case (2 shared cores)
@pytest.mark.parametrize("mode", sorted(_FAILOVER_MODES))
def test_a_killed_ps_shard_fails_over_to_the_latest_checkpoint(tmp_path, sources, mode):
    """NOTE [ps failover] (herald/job/launcher.py): kill -9 of the PS shard after the
    first checkpoint and two more steps; with --ps-restarts 1 the job rolls back to that
    checkpoint, goes on, and ends with the model of an uninterrupted run of the same mode.
    The report counts both attempts' steps and samples and names the steps trained twice
    (herald/job/report/attempts.py).

    Under GBA the replacement shard's gradient buffer lives as long as the shard (NOTE
    [gba tokens] in herald/ps/gba.py): it must start at the checkpoint's next global step
    (the ``base`` of every GBA request, NOTE [gba checkpoints]), so the resumed attempt
    applies exactly M = 2 fresh contributions for each global step after the checkpoint."""
    failed, err, report, _ = _kill_mid_job(
        tmp_path, sources["parquet"], _FAILOVER_MODES[mode], ["--ps-restarts", "1"], ("serve ps",)
    )
    assert "PS shard 0" in err, err[-3000:]
    rolled_back, _ = _assert_one_rollback(failed, report)
    assert report["failovers"][0]["part"] == "ps"
    consistency = report["consistency"]
    assert consistency["mode"] == mode
    if mode == "gba":
        # shard 0's replies: every contribution of tokens rolled_back + 1 .. STEPS - 1 reached the
        # replacement buffer standing at its own token (staleness 0; iota = 0 gates every read, so
        # no push comes before its step): the buffer started at the checkpoint's next global step
        assert consistency["contributions"] == WORKERS * (STEPS - rolled_back - 1)
        assert consistency["max_staleness_observed"] == 0 and consistency["mean_staleness"] == 0.0
        assert consistency["dropped_or_decayed"] == 0
        meta = json.loads((failed / f"checkpoints/step-{STEPS - 1:08d}/meta.json").read_text())
        assert meta["consistency"]["mode"] == "gba" and meta["dispatcher"]["next_step"] == STEPS


@pytest.mark.slow  # ~30 s a case (2 shared cores)
@pytest.mark.parametrize("mode", sorted(_FAILOVER_MODES))
def test_a_killed_worker_fails_over_to_the_latest_checkpoint(tmp_path, sources, mode):
    """NOTE [worker failover] (herald/job/recovery/rollback.py): kill -9 of worker rank 1 after the
    first checkpoint and two more steps; with --worker-restarts 1 the job rolls back to that
    checkpoint (every process restarted, as for a lost PS shard), goes on, and ends with the
    model of an uninterrupted run of the same mode. The report names the lost rank, the step
    it was lost at and the steps trained again; ``recovered_s`` is the time from the loss
    seen to the next step acked by every worker."""
    failed, err, report, killed_at = _kill_mid_job(
        tmp_path, sources["parquet"], _FAILOVER_MODES[mode], ["--worker-restarts", "1"], ("serve worker", "--rank 1 ")
    )
    assert "herald train: worker-1 was killed by signal 9 (SIGKILL)" in err, err[-3000:]
    _, last = _assert_one_rollback(failed, report)
    failover = report["failovers"][0]
    assert failover["part"] == "worker" and failover["ranks"] == [1], failover
    assert failover["cause"] == "worker-1 was killed by signal 9 (SIGKILL)"
    assert failover["detected_unix_s"] >= killed_at
    assert 0 <= failover["stopped_s"] <= failover["recovered_s"]
    seen_s = failover["detected_unix_s"] - killed_at
    print(
        f"\nworker failover ({mode}): loss seen {seen_s:.2f} s after the kill, the attempt stopped "
        f"{failover['stopped_s']:.2f} s later, training again {failover['recovered_s']:.2f} s after the loss was "
        f"seen: {seen_s + failover['recovered_s']:.2f} s from the kill to the next acked step; steps "
        f"{failover['checkpoint_step'] + 1}-{last} trained twice"
    )
    assert (
        "failover 1: worker-1 was killed by signal 9 (SIGKILL); rolled back to checkpoint"
        in (failed / "report.txt").read_text()
    )


@pytest.mark.slow  # ~60 s (2 shared cores): each run starts and stops a local Ray instance
def test_a_killed_worker_fails_over_under_the_ray_launcher(tmp_path, sources, ray):
    """The same under ``--launcher ray`` (docs/cluster.md): worker rank 1's process, a Ray
    actor's child, killed -9; the job rolls back (new actors), and ends with the model of an
    uninterrupted Ray run, which equals the local launcher's (tests/integration/test_ray.py)."""
    failed, err, report, _ = _kill_mid_job(
        tmp_path, sources["parquet"], {"launcher": "ray"}, ["--worker-restarts", "1"], ("serve worker", "--rank 1 ")
    )
    # one rollback, of the lost rank, counted in the report (which checkpoint: not asserted;
    # Ray's process tree is large, and the kill may land after the next checkpoint)
    assert len(report["failovers"]) == 1 and len(report["attempts"]) == 2, report["failovers"]
    failover = report["failovers"][0]
    assert failover["part"] == "worker" and failover["ranks"] == [1], failover
    assert report["steps"] == sum(a["steps"] for a in report["attempts"]) >= STEPS
    assert not ray.is_initialized(), "the job's Ray connection outlived it"

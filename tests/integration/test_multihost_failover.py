"""PS failover across the test bed's hosts (NOTE [test bed failover] in herald/testbed/job.py,
NOTE [ps failover across hosts] in herald/job/recovery/failover.py; Persia §4.4).

The PS host's ``herald serve ps`` is killed with SIGKILL mid-training; the bed's
supervisor restarts it, the dispatcher with ``--resume`` (which restores the shard from
the latest checkpoint) and the workers; the job finishes and its model equals the
single-process reference within test_train_exact.py's tolerances, the model of an
uninterrupted run (test_multihost.py proves an uninterrupted bed job equals it too).
No namespace and no process is left afterwards.

Needs root, ``ip`` and ``tc``: under ``CI=true`` their absence fails the test, elsewhere
it skips it with the reason.
"""

from __future__ import annotations

import os
import pathlib
import signal
import threading
import time
import types

import numpy as np
import pytest
import torch
from test_multihost import TOLERANCE, _alive, _config
from test_train_exact import BATCH, STEPS, _reference

from herald.contracts.job import JobSpec
from herald.job.data import JobData
from herald.job.recovery.failover import SHARD_FAILED_EXIT, shard_lost
from herald.ps.checkpoint import load as load_ps_checkpoint
from herald.testbed import TestBed, TestBedError, cleanup_stale, list_namespaces
from herald.testbed.dispatcher import last_step
from herald.testbed.job import bed_hosts, run_job
from herald.testbed.links import check_tools

EVERY = 10  # checkpoint every 10 of the 50 steps


@pytest.fixture
def bed_tools():
    """Root, ip and tc, or fail (CI) / skip (elsewhere) naming what is missing."""
    try:
        check_tools(shaping=True)
    except TestBedError as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the multi-host test bed cannot run here: {exc}", pytrace=False)
        pytest.skip(f"the multi-host test bed cannot run here: {exc} (set CI=true to make this a failure)")
    cleanup_stale()


def _kill_ps_mid_training(bed: TestBed, run_dir: pathlib.Path, killed: dict) -> None:
    """Once a checkpoint exists and the job is 3 steps past the first one, SIGKILL the PS
    host's shard (a thread of the test; every wait bounded)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        step = last_step(run_dir)
        if (run_dir / "checkpoints" / "latest").exists() and step is not None and step >= EVERY + 2:
            proc = bed.children.procs["job-ps-0"]
            killed.update(pid=proc.pid, at_step=step)
            os.kill(proc.pid, signal.SIGKILL)
            return
        time.sleep(0.01)


def _assert_reference_model(run: pathlib.Path, cfg, source: str) -> None:
    """The PS rows (embeddings + optimizer state) of ``run/ps-final`` and rank 0's dense
    parameters equal single-process training (test_train_exact.py's tolerances)."""
    data = JobData(cfg)
    job = JobSpec.build(cfg, data, ["tcp://ps:6000"])
    data.close()
    ref_model, ref_rows = _reference(job, source, cfg.workers * BATCH)
    tables = [types.SimpleNamespace(cfg=t, width=t.row_width) for t in job.tables]
    shard = load_ps_checkpoint(run / "ps-final", 0, 1, cfg.seed, tables)
    got = {(t, int(k)): row for t, (keys, rows) in enumerate(shard) for k, row in zip(keys, rows)}
    missing = [key for key in ref_rows if key not in got]
    assert not missing, f"{len(missing)} trained rows are not on the PS, e.g. {missing[:3]}"
    dim = job.tables[0].dim
    diff = max(float(np.abs(got[key][:dim] - ref[:dim]).max()) for key, ref in ref_rows.items())
    state = max(
        float((np.abs(got[key][dim:] - ref[dim:]) / np.maximum(1.0, np.abs(ref[dim:]))).max())
        for key, ref in ref_rows.items()
    )
    assert diff < TOLERANCE, f"embeddings differ from the uninterrupted model by {diff}"
    assert state < TOLERANCE, f"optimizer state differs from the uninterrupted model by {state} (relative)"
    dense = torch.load(run / "dense-rank0.pt", weights_only=True)
    ref = ref_model.state_dict()
    worst = max(float((dense[k] - ref[k]).abs().max()) for k in ref)
    assert worst < TOLERANCE, f"dense parameters differ from the uninterrupted model by {worst}"
    other = torch.load(run / "dense-rank1.pt", weights_only=True)
    assert all(torch.equal(other[k], dense[k]) for k in dense), "rank 1's dense replica diverged"


@pytest.mark.integration
@pytest.mark.multihost
@pytest.mark.slow  # ~50 s (2 shared cores)
@pytest.mark.usefixtures("bed_tools")
def test_a_killed_ps_host_fails_over_and_the_job_ends_with_the_uninterrupted_model(tmp_path, data_dir):
    source = str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv")
    run = tmp_path / "run"
    cfg = _config(tmp_path, source, checkpoint_every=EVERY, ps_restarts=1, timeout_ms=30_000)
    killed: dict = {}
    with TestBed(bed_hosts(2), rate="1gbit", delay_ms=0, log_dir=tmp_path / "logs") as bed:
        namespaces = list(bed.namespaces)
        killer = threading.Thread(target=_kill_ps_mid_training, args=(bed, run, killed), daemon=True)
        killer.start()
        rep = run_job(bed, cfg, save_ps=str(run / "ps-final"), timeout_s=480)
        killer.join(5)
        restarted = bed.children.procs["job-ps-0"].pid
    assert not [ns for ns in list_namespaces() if ns in namespaces], "the bed's namespaces outlived it"
    assert not _alive(bed.pids_seen), "a process the bed started outlived it"
    assert killed and restarted != killed["pid"], "the PS was never killed (the job ended first?)"

    (failover,) = rep["failovers"]
    assert failover["cause"].startswith("PS shard 0 (job-ps-0 on host ps) was killed by signal 9"), failover
    assert failover["rolled_back_to"] == f"step-{failover['checkpoint_step']:08d}"
    assert (failover["checkpoint_step"] + 1) % EVERY == 0 and failover["checkpoint_step"] < killed["at_step"]
    assert failover["last_acked_step"] >= killed["at_step"] and failover["steps_rolled_back"] >= 1, failover
    assert failover["restart_s"] > 0 and failover["recovered_s"] >= failover["restart_s"], failover
    # the resumed attempt trains the steps after the checkpoint: --steps counts the whole job
    assert rep["steps"] == STEPS - failover["checkpoint_step"] - 1
    _assert_reference_model(run, cfg, source)


def test_a_lost_shard_names_the_latest_checkpoint_and_exits_75(tmp_path):
    """What ``herald serve dispatcher`` says and returns when a PS shard is lost."""
    from herald.job.checkpoints import Checkpointer

    err = shard_lost("PS shard 1 at tcp://10.0.0.1:6001 answered no ping for 5000 ms (limit 5000 ms)\nmore", None)
    assert err.exit_code == SHARD_FAILED_EXIT == 75
    assert str(err).startswith("PS shard 1 at tcp://10.0.0.1:6001") and "--checkpoint-every" in str(err)
    err = shard_lost("PS shard 0 lost", str(tmp_path))
    assert f"no checkpoint in {tmp_path.resolve() / 'checkpoints'}" in str(err)
    ckpt = Checkpointer(tmp_path / "checkpoints", lambda path: os.makedirs(path))
    ckpt.save(9, 9, ckpt.staging_path(9), {"next_step": 10})
    err = shard_lost("PS shard 0 lost", str(tmp_path))
    assert f"latest checkpoint: {tmp_path.resolve() / 'checkpoints' / 'step-00000009'} (step 9)" in str(err)
    assert "--resume" in str(err), str(err)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.slow  # ~48 s (2 shared cores)
def test_serve_dispatcher_exits_75_on_a_lost_shard_and_resumes(tmp_path, data_dir):
    """``herald serve dispatcher --run-dir --checkpoint-every`` (loopback, no namespaces):
    SIGKILL of ``herald serve ps`` after a checkpoint ends the dispatcher with status 75,
    naming the shard and the latest checkpoint; a fresh shard, the dispatcher with
    ``--resume`` and fresh workers then finish the job from that checkpoint."""
    import subprocess
    import sys

    from herald.job.checkpoints import latest

    repo = pathlib.Path(__file__).resolve().parents[2]
    source = data_dir / "criteo" / "criteo_kaggle_sample_train.tsv"
    run, steps = tmp_path / "run", 30
    ps_addr = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(repo), HERALD_PS_TOKEN="t" * 32)
    procs: list[subprocess.Popen] = []

    def start(argv, output=subprocess.DEVNULL):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "herald", "serve", *argv],
                env=env,
                text=True,
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        )
        return procs[-1]

    def attempt(resume: bool):
        ps = start(
            [
                "ps",
                "--shard",
                "0",
                "--num-shards",
                "1",
                "--bind",
                ps_addr,
                "--checkpoint-root",
                str(tmp_path),
                "--max-contributors",
                "2",
            ]
        )
        disp_addr = f"tcp://127.0.0.1:{_free_port()}"
        disp = start(
            [
                "dispatcher",
                "--source",
                str(source),
                "--workers",
                "2",
                "--batch-size",
                "16",
                "--embedding-dim",
                "4",
                "--steps",
                str(steps),
                "--ps",
                ps_addr,
                "--bind",
                disp_addr,
                "--timeout-ms",
                "30000",
                "--run-dir",
                str(run),
                "--checkpoint-every",
                "5",
                "--dist-init",
                f"tcp://127.0.0.1:{_free_port()}",
                *(["--resume"] if resume else []),
            ],
            output=subprocess.PIPE,
        )
        for r in range(2):
            start(["worker", "--dispatcher", disp_addr, "--rank", str(r), "--world-size", "2", "--timeout-ms", "30000"])
        return ps, disp

    try:
        ps, disp = attempt(resume=False)
        pointer, deadline = run / "checkpoints" / "latest", time.monotonic() + 180
        while not pointer.exists():
            if disp.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no checkpoint before the end of the job:\n{disp.communicate(timeout=30)[0][-3000:]}")
            time.sleep(0.01)
        ps.kill()
        out = disp.communicate(timeout=120)[0]
        assert disp.returncode == SHARD_FAILED_EXIT, out[-3000:]
        found = latest(run / "checkpoints")
        assert f"PS shard 0 at {ps_addr}" in out and f"latest checkpoint: {found.path} (step {found.step})" in out, out[
            -3000:
        ]
        for p in procs:  # the workers end on their own PS timeout; do not wait for it
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
        procs.clear()

        ps, disp = attempt(resume=True)
        out = disp.communicate(timeout=240)[0]
        assert disp.returncode == 0, out[-3000:]
        assert f"{steps - found.step - 1} steps acked by all 2 workers" in out, out[-3000:]
        assert latest(run / "checkpoints").step == steps - 1  # the final checkpoint
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)

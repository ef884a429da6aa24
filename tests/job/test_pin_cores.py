"""``herald train --pin-cores`` end to end: while the job trains, every thread of each of
its processes (both workers, the PS shard, the ``herald train`` process with its
dispatcher) runs on the cores :func:`herald.procs.core_plan` planned for it, and the
report holds the job's CPU time per sample and its PS requests per worker, shard and step."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from herald.procs import core_plan
from tests.integration.proc_tree import children

REPO = pathlib.Path(__file__).resolve().parents[2]
WORKERS, SHARDS = 2, 1

pytestmark = pytest.mark.integration


def threads_cores(pid: int) -> set[frozenset[int]]:
    """The distinct core sets of ``pid``'s threads (threads that end meanwhile left out)."""
    found = set()
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            found.add(frozenset(os.sched_getaffinity(int(task.name))))
        except (ProcessLookupError, FileNotFoundError):
            pass
    return found


def snapshot(train_pid: int) -> dict[str, tuple[set[frozenset[int]], str | None]] | None:
    """Role -> (its threads' core sets, its OMP_NUM_THREADS) once both workers run, else None."""
    roles = {}
    for pid, cmd in children(train_pid):
        argv = cmd.split()
        if "worker" in argv and "serve" in argv:
            name = f"worker-{argv[argv.index('--rank') + 1]}"
        elif "ps" in argv and "serve" in argv:
            name = f"ps-shard-{argv[argv.index('--shard') + 1]}"
        else:
            continue
        env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        omp = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"OMP_NUM_THREADS=")), None)
        roles[name] = (threads_cores(pid), omp)
    if sum(name.startswith("worker-") for name in roles) < WORKERS:
        return None
    roles["dispatcher"] = (threads_cores(train_pid), None)
    return roles


def test_pin_cores_pins_every_process_of_the_job_and_the_report_counts_its_cpu_time(tmp_path):
    available = sorted(os.sched_getaffinity(0))
    plan = core_plan(WORKERS + SHARDS + 1, available)  # workers first, then the shards, then this process
    expected = {"worker-0": plan[0], "worker-1": plan[1], "ps-shard-0": plan[2], "dispatcher": plan[3]}
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "herald",
        "train",
        "--source",
        "synthetic://criteo?rows=20000&seed=0",
        "--workers",
        str(WORKERS),
        "--ps-shards",
        str(SHARDS),
        "--batch-size",
        "64",
        "--steps",
        "80",
        "--pin-cores",
        "--quiet",
        "--run-dir",
        str(run_dir),
    ]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with open(tmp_path / "stderr.log", "wb") as err:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        seen, deadline = None, time.monotonic() + 240
        while seen is None and proc.poll() is None and time.monotonic() < deadline:
            try:
                seen = snapshot(proc.pid)
            except (ProcessLookupError, FileNotFoundError):  # a process ended while being read
                seen = None
            time.sleep(0.05)
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (tmp_path / "stderr.log").read_text()
    assert code == 0, log
    assert seen is not None, f"never saw both workers running:\n{log}"
    assert {name: cores for name, (cores, _) in seen.items()} == {
        name: {frozenset(cores)} for name, cores in expected.items()
    }
    assert seen["worker-0"][1] == str(len(plan[0])) and seen["worker-1"][1] == str(len(plan[1]))
    line = next(line for line in log.splitlines() if line.startswith("--pin-cores: "))
    assert line.startswith("--pin-cores: worker-0 on ")
    assert ("round-robin" in line) == (len(plan) > len(available))  # said once, when processes share cores

    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["steps"] == 80 and rep["config"]["pin_cores"] is True
    assert rep["cpu_scope"] == "local processes (dispatcher, PS shards, workers)"
    assert rep["cpu_seconds"] > 0 and rep["cpu_us_per_sample"] == pytest.approx(
        1e6 * rep["cpu_seconds"] / rep["samples"]
    )
    # NOTE [steady cpu]: without the start-up (every process's imports), the evaluation, the report
    assert 0 < rep["steady_cpu_us_per_sample"] < rep["cpu_us_per_sample"]
    assert isinstance(rep["ps_requests"], int) and rep["ps_requests"] >= 0
    assert rep["ps_requests_per_worker_per_shard_per_step"] == pytest.approx(
        rep["ps_requests"] / (WORKERS * SHARDS * rep["steps"])
    )
    text = (run_dir / "report.txt").read_text()
    assert "per worker per shard per step" in text and "us per trained sample" in text
    # the start-up milestones, seconds after herald train started, in the order they happen
    marks = [rep["startup"][k] for k in ("imported", "data_ready", "ps_ready", "workers_ready", "first_step")]
    assert 0 < marks[0] and marks == sorted(marks) and marks[-1] < 240
    assert "start-up (seconds after herald train started): imported " in text

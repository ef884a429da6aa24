"""The live child processes of a process, read from /proc (for tests that kill one role),
and a real `herald train` job stopped mid-way for such a test."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

FAULT_TIMEOUT_MS = 10_000  # the jobs' --timeout-ms


def _processes() -> dict[int, tuple[int, str]]:
    """Every process now: ``pid -> (parent pid, command line)``, from one pass over /proc."""
    out = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        out[int(stat.parent.name)] = (ppid, cmd)
    return out


def children(pid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every process whose parent is ``pid``."""
    return [(p, cmd) for p, (ppid, cmd) in _processes().items() if ppid == pid]


def parent_of(pid: int) -> int | None:
    """The parent pid of process ``pid`` (None: no such process)."""
    found = _processes().get(pid)
    return None if found is None else found[0]


def descendants(pid: int) -> list[tuple[int, str]]:
    """:func:`children` of ``pid``, their children, and so on (e.g. a Ray actor's role
    process), children first, from one pass over /proc (a test kills one mid-job: a pass
    per process would let the job run on for several steps)."""
    procs = _processes()
    out, level = [], [pid]
    while level:
        found = [(p, cmd) for p, (ppid, cmd) in procs.items() if ppid in set(level)]
        out += found
        level = [p for p, _ in found]
    return out


def train_until_mid_job(tmp_path, data_dir, *role: str) -> tuple[subprocess.Popen, int]:
    """Start a 2-worker ``herald train`` job (MovieLens ratings, ``--timeout-ms``
    :data:`FAULT_TIMEOUT_MS`); once 10 steps are trained return it and the pid of its child
    whose command line holds every string of ``role`` (e.g. ``"serve ps", "--shard 0"``)."""
    source = data_dir / "movielens" / "ml-latest-small" / "ratings.csv"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "herald",
            "train",
            "--quiet",
            "--source",
            str(source),
            "--workers",
            "2",
            "--batch-size",
            "64",
            "--epochs",
            "20",
            "--run-dir",
            str(tmp_path),
            "--timeout-ms",
            str(FAULT_TIMEOUT_MS),
            "--log-sample-ids",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    pid = None
    log = tmp_path / "trained_sample_ids.u64"
    while pid is None or not log.exists() or log.stat().st_size < 10 * 128 * 8:  # ten steps trained
        assert job.poll() is None and time.monotonic() < deadline, (
            f"training ended or stalled before the fault: {job.communicate(timeout=30)[1][-3000:]}"
        )
        pid = pid or next((p for p, cmd in children(job.pid) if all(part in cmd for part in role)), None)
        time.sleep(0.05)
    return job, pid


@contextlib.contextmanager
def stopped(pid: int):
    """Process ``pid`` stopped (SIGSTOP) while the block runs, continued after (if it still exists)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

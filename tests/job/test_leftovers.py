"""NOTE [run leftovers]: what a killed job names in its run folder is removed by the next
job there once its owner is gone, and left while it runs. (``herald train`` killed with
SIGKILL, then resumed: tests/integration/test_faults.py.)"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

from herald.job.parts import dense_store
from herald.job.recovery import leftovers

# a job process: makes and names a PS folder and a store file, says so, then waits to be killed
OWNER = """
import pathlib, sys, tempfile, time
from herald.job.recovery import leftovers
run = pathlib.Path(sys.argv[1]).resolve()
ps = tempfile.mkdtemp(prefix=leftovers.PS_PREFIX)
leftovers.record(run, ps)
(pathlib.Path(ps) / "shard-0.ipc").write_text("")
store = run / (leftovers.STORE_PREFIX + sys.argv[2])
leftovers.record(run, store)
store.write_text("")
print(ps, store, flush=True)
time.sleep(600)
"""


def _owner(run_dir: pathlib.Path, name: str, tmp: pathlib.Path) -> tuple[subprocess.Popen, list[pathlib.Path]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(run_dir), name],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TMPDIR=str(tmp)),
    )
    return proc, [pathlib.Path(p) for p in proc.stdout.readline().split()]


def test_a_gone_owners_paths_are_removed_and_a_live_owners_left(tmp_path, capsys):
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    run_dir.mkdir()
    tmp.mkdir()
    killed, killed_paths = _owner(run_dir, "killed", tmp)
    alive, alive_paths = _owner(run_dir, "alive", tmp)
    try:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(30)
        assert all(p.exists() for p in killed_paths + alive_paths)
        precious = tmp_path / "precious"  # an owner file may name anything: only the two kinds go
        precious.mkdir()
        reused = {
            "pid": alive.pid,
            "start": 1,
            "host": socket.gethostname(),  # the pid, now another process's
            "paths": [str(precious), str(tmp / "herald-ps-reused")],
        }
        (tmp / "herald-ps-reused").mkdir()
        (run_dir / ".owner-999999999.json").write_text(json.dumps(reused))
        removed = leftovers.clean(run_dir)
        err = capsys.readouterr().err
        assert sorted(removed) == sorted([str(p) for p in killed_paths] + [str(tmp / "herald-ps-reused")])
        assert not any(p.exists() for p in killed_paths) and all(p.exists() for p in alive_paths)
        assert precious.exists() and not (tmp / "herald-ps-reused").exists()
        assert [p.name for p in run_dir.glob(".owner-*")] == [f".owner-{alive.pid}.json"]
        assert f"removed what the killed run (pid {killed.pid}) left" in err
        assert f"in use by process {alive.pid}, still running: its paths are left" in err and "--run-dir" in err
        assert oct(os.stat(run_dir / f".owner-{alive.pid}.json").st_mode & 0o777) == "0o600"
    finally:
        alive.kill()
        alive.wait(30)
    assert leftovers.clean(run_dir) == [str(p) for p in alive_paths]  # now gone too
    assert list(run_dir.iterdir()) == [] and list(tmp.iterdir()) == []


def test_an_owner_on_another_host_and_this_process_are_left(tmp_path, capsys):
    store = tmp_path / ".dist-store-x"
    store.write_text("")
    (tmp_path / ".owner-1.json").write_text(
        json.dumps({"pid": 1, "start": 0, "host": "elsewhere", "paths": [str(store)]})
    )
    with dense_store(tmp_path) as init:  # this process's own paths: named while in use, then dropped
        path = pathlib.Path(init[len("file://") :])
        assert json.loads((tmp_path / f".owner-{os.getpid()}.json").read_text())["paths"] == [str(path)]
        assert leftovers.clean(tmp_path) == []
    assert "names a job on host elsewhere" in capsys.readouterr().err and store.exists()
    assert not (tmp_path / f".owner-{os.getpid()}.json").exists()


def test_a_killed_runs_checkpoint_staging_goes_at_the_next_start_unless_a_job_is_live(tmp_path, capsys):
    """A checkpoint being assembled when its job was killed (``checkpoints/.tmp-step-*``) is
    never named in ``latest``: the next start or resume in the run folder removes it, complete
    checkpoints stay; while another job lives in the folder its staging may be in use: left."""
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    root = run_dir / "checkpoints"
    staging, done = root / ".tmp-step-00000009", root / "step-00000004"
    for folder in (staging / "ps", done):
        folder.mkdir(parents=True)
    (root / "latest").write_text(done.name)
    alive, alive_paths = _owner(run_dir, "alive", tmp)
    try:
        leftovers.clean(run_dir)
        assert staging.is_dir(), "a live job's staging folder was removed"
        assert "still running" in capsys.readouterr().err
    finally:
        alive.kill()
        alive.wait(30)
    removed = leftovers.clean(run_dir)
    assert str(staging) in removed and not staging.exists()
    assert done.is_dir() and (root / "latest").read_text() == done.name
    assert f"removed the unfinished checkpoint(s) a killed run left: {staging}" in capsys.readouterr().err
    assert leftovers.clean(run_dir) == []  # once

"""What a killed ``herald train`` leaves behind, removed by the next job in its run folder.

NOTE [run leftovers]
~~~~~~~~~~~~~~~~~~~~
A ``herald train`` killed with SIGKILL (or by the OOM killer) runs no cleanup. Its
children die with it (``PR_SET_PDEATHSIG``), but these paths stay: its local PS shards'
folder (``$TMPDIR/herald-ps-*``: tables file, ready files, ipc sockets), its dispatchers'
socket folder (``$TMPDIR/herald-dispatch-*``: NOTE [local job sockets] in
herald/job/parts/local_workers.py), its workers' torch.distributed file store
(``RUN_DIR/.dist-store-*``) and, under ``--launcher ray`` on one node, its roles' private
folders (``$TMPDIR/herald-ps-*``, ``$TMPDIR/herald-worker-*``: NOTE [ray job]; the launcher
removes the folder of a role whose actor died itself, :meth:`herald.job.ray.cluster.RayCluster.stop`);
and a job killed while it wrote a checkpoint leaves that checkpoint's staging folder
(``RUN_DIR/checkpoints/.tmp-step-*``, never named in ``latest``). So the job names each such path
in an owner file of its run folder as it creates it (:func:`record`) and drops it once
the path is removed (:func:`forget`; the owner file goes with its last path):
``RUN_DIR/.owner-<pid>.json`` = ``{"pid", "start" (the process's start time,
:func:`herald.procs.start_time`), "host", "paths"}``, mode 0600.

A job that starts or resumes in the run folder (:func:`clean`, from
:func:`herald.job.parts.local_ps.prepare_run`) reads every owner file. An owner that is gone (no
process with its pid on this host, or one that started at another time: a reused pid)
has its paths removed, then its owner file. A live owner's paths (a job still running in
this folder) and those of an owner on another host (which cannot be checked from here)
are left, and :func:`clean` says so on stderr; so are this process's own (an earlier
attempt of this job: NOTE [ps failover]). Whatever an owner file says, only paths of
those kinds are removed: a folder named ``herald-ps-*``, ``herald-dispatch-*`` or
``herald-worker-*`` (not a symlink) and a file ``.dist-store-*`` directly in the run folder. The staging folders
need no owner file: when no live owner (nor one on another host) uses the run folder, every
``checkpoints/.tmp-step-*`` folder is a killed job's, or an earlier attempt's of this one
(NOTE [ps failover]), and is removed (:func:`herald.job.checkpoints.remove_staging`); only
there, at the start or resume of a job in that run folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import socket
import sys
import tempfile

from herald.files import write_private
from herald.job.checkpoints import remove_staging
from herald.procs import is_alive, start_time

OWNER_PREFIX = ".owner-"
#: Name prefix of a local PS shards' folder (:class:`herald.ps.LocalShards`).
PS_PREFIX = "herald-ps-"
#: Name prefix of a local job's folder of dispatcher sockets (:class:`herald.job.parts.local_workers.LocalWorkers`).
DISPATCH_PREFIX = "herald-dispatch-"
#: Name prefix of a Ray role's private folder on its node (:class:`herald.job.ray.role.RoleHost`;
#: a PS shard's is :data:`PS_PREFIX`).
WORKER_PREFIX = "herald-worker-"
#: Name prefix of the workers' torch.distributed file store in the run folder.
STORE_PREFIX = ".dist-store-"


def _owner_file(run_dir: pathlib.Path, pid: int) -> pathlib.Path:
    return run_dir / f"{OWNER_PREFIX}{pid}.json"


def _read(path: pathlib.Path) -> dict | None:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("paths"), list) else None


def _write(path: pathlib.Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    write_private(tmp, json.dumps(state), sync=False)
    os.replace(tmp, path)


def record(run_dir: str | os.PathLike, path: str | os.PathLike) -> None:
    """Name ``path`` (a ``herald-ps-*``, ``herald-dispatch-*`` or ``herald-worker-*`` folder, a ``.dist-store-*``
    file) in this process's owner file of ``run_dir`` (NOTE [run leftovers]).

    Raises:
        StorageError: the owner file cannot be written.
    """
    run_dir = pathlib.Path(run_dir)
    owner = _owner_file(run_dir, os.getpid())
    state = _read(owner) or {
        "pid": os.getpid(),
        "start": start_time(os.getpid()),
        "host": socket.gethostname(),
        "paths": [],
    }
    if str(path) not in state["paths"]:
        state["paths"].append(str(path))
        _write(owner, state)


def private_folder(run_dir: str | os.PathLike, prefix: str, stack: contextlib.ExitStack) -> str:
    """A fresh folder ``$TMPDIR/<prefix>XXXX`` of mode 0700 (``tempfile.mkdtemp``; ``prefix``:
    :data:`PS_PREFIX` or :data:`DISPATCH_PREFIX`), named in this process's owner file of
    ``run_dir`` (:func:`record`) until ``stack`` ends: then the folder is removed and its name
    dropped (NOTE [run leftovers]). Returns its path.

    Raises:
        StorageError: the owner file cannot be written (the folder is removed).
    """
    folder = tempfile.mkdtemp(prefix=prefix)
    stack.callback(_drop, run_dir, folder)
    record(run_dir, folder)
    return folder


def _drop(run_dir: str | os.PathLike, folder: str) -> None:
    """Remove a :func:`private_folder` and its name in the run folder."""
    shutil.rmtree(folder, ignore_errors=True)
    forget(run_dir, folder)


def forget(run_dir: str | os.PathLike, path: str | os.PathLike) -> None:
    """Drop ``path`` (removed by its user) from this process's owner file; the owner file
    goes with its last path."""
    owner = _owner_file(pathlib.Path(run_dir), os.getpid())
    state = _read(owner)
    if state is None or str(path) not in state["paths"]:
        return
    state["paths"].remove(str(path))
    if state["paths"]:
        _write(owner, state)
    else:
        owner.unlink(missing_ok=True)


def clean(run_dir: str | os.PathLike, who: str = "herald train") -> list[str]:
    """Remove what the gone owners of ``run_dir`` left (NOTE [run leftovers]); say on stderr
    what was removed and which live owners' paths were left (``who``: the command).

    Returns:
        The paths removed.
    """
    run_dir = pathlib.Path(run_dir)
    removed: list[str] = []
    in_use = False  # a live owner, or one that cannot be checked: its checkpoint may be staging
    for owner in sorted(run_dir.glob(f"{OWNER_PREFIX}*.json")):
        state = _read(owner) or {"paths": []}  # unreadable: names nothing to remove
        pid = state.get("pid")
        if pid == os.getpid():
            continue
        paths = [p for p in state["paths"] if isinstance(p, str)]
        if state.get("host", socket.gethostname()) != socket.gethostname():
            print(
                f"{who}: {owner} names a job on host {state.get('host')} (pid {pid}), which cannot be checked "
                f"from here: its paths are left ({', '.join(paths) or 'none'})",
                file=sys.stderr,
            )
            in_use = True
            continue
        if is_alive(pid, state.get("start")):
            print(
                f"{who}: run folder {run_dir} is in use by process {pid}, still running: its paths are left "
                f"({', '.join(paths) or 'none'}); two jobs in one run folder overwrite each other's checkpoints "
                "and report: give this one another --run-dir",
                file=sys.stderr,
            )
            in_use = True
            continue
        gone = [p for p in paths if _remove(run_dir, pathlib.Path(p))]
        owner.unlink(missing_ok=True)
        if gone:
            print(f"{who}: removed what the killed run (pid {pid}) left: {', '.join(gone)}", file=sys.stderr)
        removed += gone
    if not in_use:
        staging = remove_staging(run_dir / "checkpoints")
        if staging:
            print(
                f"{who}: removed the unfinished checkpoint(s) a killed run left: {', '.join(staging)}", file=sys.stderr
            )
        removed += staging
    return removed


def _remove(run_dir: pathlib.Path, path: pathlib.Path) -> bool:
    """Remove ``path`` if it is one of the kinds a job records; whether it was removed."""
    if (
        path.name.startswith((PS_PREFIX, DISPATCH_PREFIX, WORKER_PREFIX))
        and path.is_absolute()
        and path.is_dir()
        and not path.is_symlink()
    ):
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()
    if (
        path.name.startswith(STORE_PREFIX)
        and path.parent == run_dir.resolve()
        and path.is_file()
        and not path.is_symlink()
    ):
        path.unlink(missing_ok=True)
        return True
    return False

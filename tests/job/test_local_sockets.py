"""NOTE [local job sockets] (herald/job/parts/local_workers.py): a ``herald train`` job's dispatcher
listens on an ``ipc://`` socket in a folder of mode 0700, which another local user cannot
reach, and its workers' rendezvous file is 0600."""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import socket
import tempfile

import pytest

from herald import wire
from herald.contracts.train import TrainConfig
from herald.dispatch.channel import PeerChannel
from herald.dispatch.config import DispatcherConfig
from herald.errors import ConfigError
from herald.job.parts import ExternalWorkers, LocalWorkers, WorkerLauncher
from herald.job.recovery import leftovers
from tests.asuser import as_nobody
from tests.fakes import dealer


def _as_nobody(path: pathlib.Path) -> str:
    """What user nobody gets for ``path`` (a Unix socket): ``"access=<bool> connect=<errno
    name or ok>"``."""

    def reach() -> str:
        said = f"access={os.access(path, os.W_OK)} "
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(path))
            return said + "connect=ok"
        except OSError as exc:
            return said + f"connect={errno.errorcode.get(exc.errno, exc.errno)}"
        finally:
            s.close()

    return as_nobody(reach)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_the_dispatcher_of_a_local_job_is_out_of_other_users_reach(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    workers = LocalWorkers()
    with contextlib.ExitStack() as stack:
        workers.open(TrainConfig.from_flags(run_dir=str(run_dir)), stack)
        address = workers.dispatcher_bind(0)
        assert address.startswith("ipc://") and workers.dispatcher_bind(1) != address
        path = pathlib.Path(address[len("ipc://") :])
        folder = path.parent
        assert folder.name.startswith(leftovers.DISPATCH_PREFIX)
        assert (folder.stat().st_mode & 0o777, folder.stat().st_uid) == (0o700, os.getuid())
        store = pathlib.Path(workers.dist_init.removeprefix("file://"))
        assert store.parent == run_dir.resolve() and store.stat().st_mode & 0o777 == 0o600
        old_umask = os.umask(0)  # the socket file itself 0777: only its folder keeps others out
        try:
            channel = PeerChannel(DispatcherConfig(num_workers=1, bind=address))  # binds as the job's dispatcher
        finally:
            os.umask(old_umask)
        worker = dealer(address, b"worker-0")
        try:
            assert channel.address == address and path.is_socket() and path.stat().st_mode & 0o777 == 0o777
            assert _as_nobody(path) == "access=False connect=EACCES"
            worker.send_multipart(wire.pack({"op": "hello", "rank": 0, "world_size": 1}))
            channel.wait_for_hellos()  # the job's own workers reach it
        finally:
            worker.close(linger=0)
            channel.close()
    assert not folder.exists() and not store.exists()  # removed with the job
    assert not list(run_dir.glob(f"{leftovers.OWNER_PREFIX}*"))


def test_other_worker_parts_leave_the_bind_to_the_dispatcher():
    # herald serve dispatcher --bind, the test bed's address
    assert WorkerLauncher().dispatcher_bind(0) is None and ExternalWorkers().dispatcher_bind(0) is None


def test_a_tmpdir_too_long_for_a_unix_socket_is_named(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    (tmp_path / "run").mkdir()
    with contextlib.ExitStack() as stack, pytest.raises(ConfigError, match="longer than the 107 .*set TMPDIR"):
        LocalWorkers().open(TrainConfig.from_flags(run_dir=str(tmp_path / "run")), stack)
    assert list(deep.iterdir()) == []  # its folder removed all the same

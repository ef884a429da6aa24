"""NOTE [private files]: checkpoint files 0600 in 0700 folders whatever the umask, and a
failed write that names the path, why and the fix (a full and a read-only tmpfs, a
parent that is a file, an unprivileged user)."""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import stat
import subprocess

import numpy as np
import pytest
import torch

from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import StorageError
from herald.files import private_dir, storage_error, write_private
from herald.ps import CheckpointError, checkpoint
from herald.ps.table import EmbeddingTable
from herald.worker.dense import DenseSync
from tests.asuser import as_nobody

SHORT_WRITE = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")


def _mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def _tmpfs(path: pathlib.Path, options: str):
    """A tmpfs mounted at ``path`` (root only: skipped elsewhere), unmounted at exit."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _model() -> DenseSync:
    model = torch.nn.Linear(256, 256)  # ~260 KB: more than the tiny file system holds
    return DenseSync(model, torch.optim.Adam(model.parameters()), world_size=1)


def test_checkpoint_files_are_private_whatever_the_umask(tmp_path):
    with _umask(0o022):
        (tmp_path / "open").mkdir(mode=0o755)
        folder = private_dir(tmp_path / "open" / "new" / "deeper")
        assert _mode(folder) == _mode(folder.parent) == 0o700
        assert _mode(private_dir(tmp_path / "open")) == 0o700  # an existing folder of ours is set
        (tmp_path / "was-public").write_text("x")
        os.chmod(tmp_path / "was-public", 0o644)
        write_private(tmp_path / "was-public", "y")  # an existing file is set too
        assert _mode(tmp_path / "was-public") == 0o600 and (tmp_path / "was-public").read_text() == "y"
        dense = _model().save(tmp_path / "step")
        assert _mode(dense) == 0o600 and _mode(dense.parent) == 0o700
        assert set(torch.load(dense, weights_only=True)) == {"model", "optimizer"}
        table = EmbeddingTable(TableConfig("a", 4, OptimizerConfig("adam")), 0, 9)
        shard = checkpoint.save(tmp_path / "ps", 0, 1, 9, [table])
        assert {_mode(p) for p in shard.iterdir()} == {0o600} and _mode(shard) == _mode(shard.parent) == 0o700


def test_a_full_disk_is_named_with_the_path_and_the_fix(tmp_path):
    with _tmpfs(tmp_path / "full", "size=64k") as fs:
        with pytest.raises(StorageError, match=f"cannot write file {fs}/blob: disk full .*free space") as info:
            write_private(fs / "blob", b"\0" * 200_000)
        assert info.value.errno == errno.ENOSPC and not (fs / "blob").exists()  # the partial file is gone
        # torch.save's own error is "unexpected pos"; through PrivateFile the write's errno is kept
        with pytest.raises(StorageError, match=r"dense.pt.tmp: disk full \(errno ENOSPC\)"):
            _model().save(fs / "step")
        assert list((fs / "step").iterdir()) == []
        table = EmbeddingTable(TableConfig("a", 4, OptimizerConfig("adam")), 0, 9)
        table.push_grad(
            np.arange(5000, dtype=np.uint64), np.ones((5000, 4), np.float32), np.ones(5000, np.uint16), 0, 0
        )
        with pytest.raises(CheckpointError, match="cannot write checkpoint file .*: disk full") as info:
            checkpoint.save(fs / "ps", 0, 1, 9, [table])
        assert info.value.reason == "write" and list((fs / "ps").iterdir()) == []  # the partial checkpoint too
        # a short write torch made itself (no errno): the free space of the folder tells
        with contextlib.suppress(OSError), open(fs / "filler", "wb") as f:
            f.write(b"\0" * 200_000)  # fills the file system and stays
        assert str(storage_error(fs / "x.pt", SHORT_WRITE)).startswith(
            f"cannot write file {fs}/x.pt: disk full (RuntimeError: [enforce fail"
        )
    assert str(storage_error(tmp_path / "x.pt", SHORT_WRITE)).startswith(
        f"cannot write file {tmp_path}/x.pt: RuntimeError: [enforce fail"
    )  # not full: torch's message


def test_an_unwritable_place_is_named(tmp_path):
    (tmp_path / "plain").write_text("a file")
    with pytest.raises(StorageError, match="plain/ckpt: a part of the path is not a folder"):
        private_dir(tmp_path / "plain" / "ckpt")
    with pytest.raises(StorageError, match="plain/x: a part of the path is not a folder"):
        write_private(tmp_path / "plain" / "x", "data")
    with _tmpfs(tmp_path / "ro", "size=64k,ro") as fs:
        with pytest.raises(StorageError, match="read-only file system .*writable file system"):
            write_private(fs / "meta.json", "{}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_permission_denied_is_named(tmp_path):
    target = private_dir(tmp_path / "root-only") / "latest"  # 0700, root's: user nobody may not write there

    def write() -> str:
        try:
            write_private(target, "x")
            return "written"
        except StorageError as exc:
            return f"{exc}|{exc.errno}"

    said = as_nobody(write)
    message, code = said.rsplit("|", 1)
    assert (
        message.startswith(f"cannot write file {target}: permission denied (errno EACCES); make ")
        and int(code) == errno.EACCES
    )

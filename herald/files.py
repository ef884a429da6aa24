"""Private files and folders, and what a failed write says (NOTE [private files]).

NOTE [private files]
~~~~~~~~~~~~~~~~~~~~
Checkpoints hold the model: the PS shards' files (``t<i>.keys``, ``t<i>.rows``,
``manifest.json``), ``dense.pt``, ``meta.json`` and ``latest`` under
``RUN_DIR/checkpoints``, and the final dense replicas ``RUN_DIR/dense-rank<r>.pt``. They
are written mode 0600 (:class:`PrivateFile`, :func:`write_private`) in folders of mode
0700 (:func:`private_dir`), whatever the umask: a file is opened with mode 0600 and
``fchmod``-ed (an existing file would keep its mode), a folder made with mode 0700 and
``chmod``-ed (an existing one of ours would keep its mode; one of another user is left
as it is). A write that fails raises :class:`~herald.errors.StorageError` naming the
path, why (from the ``OSError``'s errno: disk full, permission denied, read-only file
system, ...) and the fix, and removes the partial file. ``torch.save`` reports a short
write as ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos ...``:
given a :class:`PrivateFile` it writes through it, which keeps the ``OSError`` its
``write`` raised; for one torch wrote itself, the free space of the folder tells a full
disk (:func:`storage_error`).
"""

from __future__ import annotations

import errno
import io
import os
import pathlib
import shutil
import zipfile

import numpy as np

from herald.errors import DataError, StorageError

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
#: Free bytes under which a file system counts as full (a short write with no errno).
FULL_BELOW_BYTES = 1 << 20

_FREE = "free space on the file system of {folder} (`df -h {folder}`) or write to another one"
_DENIED = "make {folder} writable by this user (uid {uid}) or write to another folder"
#: errno -> (why, the fix; ``{folder}``: the file's folder, ``{uid}``: this user)
_REASONS = {
    errno.ENOSPC: ("disk full", _FREE),
    errno.EDQUOT: ("disk quota exceeded", _FREE),
    errno.EFBIG: ("file too large", _FREE),
    errno.EACCES: ("permission denied", _DENIED),
    errno.EPERM: ("permission denied", _DENIED),
    errno.EROFS: ("read-only file system", "write to a folder on a writable file system ({folder} is not)"),
    errno.ENOTDIR: (
        "a part of the path is not a folder",
        "move the file that stands in the way or write to another folder",
    ),
    errno.EIO: ("input/output error", "check the disk (`dmesg`) or write to another one"),
}
_OTHER = "fix the file system of {folder} or write to another folder"


def storage_error(path: str | os.PathLike, exc: BaseException, what: str = "file") -> StorageError:
    """The :class:`StorageError` of a failed write of ``path`` (a ``what``: "file", "folder",
    "checkpoint file", ...) that raised ``exc``.

    Why: an ``OSError``'s errno (``ENOSPC`` -> "disk full", ``EACCES`` -> "permission
    denied", ...); any other ``exc`` (torch's ``RuntimeError`` of a short write) is "disk
    full" when the folder's file system has under :data:`FULL_BELOW_BYTES` free, else
    ``exc``'s own message.
    """
    path = pathlib.Path(path)
    code = exc.errno if isinstance(exc, OSError) else None
    if code is not None:
        why, fix = _REASONS.get(code, (os.strerror(code), _OTHER))
        why += f" (errno {errno.errorcode.get(code, code)})"
    elif _free_bytes(path.parent) < FULL_BELOW_BYTES:
        why, fix = f"disk full ({type(exc).__name__}: {exc})", _FREE
    else:
        why, fix = f"{type(exc).__name__}: {exc}", _OTHER
    return StorageError(
        f"cannot write {what} {path}: {why}; {fix.format(folder=path.parent, uid=os.geteuid())}",
        path=str(path),
        errno=code,
    )


def _free_bytes(folder: pathlib.Path) -> int:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return FULL_BELOW_BYTES  # unknown: not reported as full


def is_short_write(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's error for a file it could not write (``torch.save``)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text)


def private_dir(path: str | os.PathLike) -> pathlib.Path:
    """Make folder ``path`` and its missing parents mode 0700; an existing ``path`` of this
    user is set to 0700 (NOTE [private files]). Returns the path.

    Raises:
        StorageError: the folder cannot be made (naming why and the fix).
    """
    path = pathlib.Path(path)
    missing, folder = [], path
    while not os.path.lexists(folder) and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    try:
        for folder in reversed(missing):
            folder.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
        path.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)  # a file there: FileExistsError
        st = path.stat()
        if st.st_uid == os.geteuid() and st.st_mode & 0o777 != PRIVATE_DIR_MODE:
            os.chmod(path, PRIVATE_DIR_MODE)
    except OSError as exc:
        raise storage_error(path, exc, "folder") from None
    return path


class PrivateFile:
    """``path`` opened for writing, mode 0600 whatever the umask (NOTE [private files]); a
    context manager whose ``write``/``flush`` are a binary file's (give it to ``torch.save``).

    On a clean exit the data is flushed and (``sync``) fsync'ed. A failed write (an
    ``OSError``, or torch's short-write ``RuntimeError``) raises :class:`StorageError`
    naming ``path``, why and the fix; any error removes the partial file, and errors that
    are no write failure pass as they are.

    Args:
        path: the file (created or truncated).
        what: what it is, for the message ("checkpoint file").
        sync: fsync it before closing.
    """

    def __init__(self, path: str | os.PathLike, what: str = "file", *, sync: bool = True):
        self.path, self.what, self.sync = pathlib.Path(path), what, sync
        self._file = None
        self._error: OSError | None = None  # what the file's write raised (torch hides it)

    def __enter__(self) -> PrivateFile:
        try:
            fd = os.open(
                self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, PRIVATE_FILE_MODE
            )
        except OSError as exc:
            raise storage_error(self.path, exc, self.what) from None
        try:
            os.fchmod(fd, PRIVATE_FILE_MODE)  # an existing file keeps its mode otherwise
        except OSError as exc:
            os.close(fd)
            raise storage_error(self.path, exc, self.what) from None
        self._file = os.fdopen(fd, "wb")
        return self

    def write(self, data: bytes | bytearray | memoryview) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            self._error = self._error or exc
            raise

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as exc:
            self._error = self._error or exc
            raise

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc is None:
                self._file.flush()
                if self.sync:
                    os.fsync(self._file.fileno())
            self._file.close()
        except OSError as err:
            self._error = self._error or err
            if not self._file.closed:
                try:
                    self._file.close()
                except OSError:
                    pass
        if exc is None and self._error is None:
            return False
        self.path.unlink(missing_ok=True)
        failed = self._error or (exc if isinstance(exc, OSError) or is_short_write(exc) else None)
        if failed is None:
            return False  # not a write failure (e.g. an object torch cannot pickle): ``exc`` goes on
        raise storage_error(self.path, failed, self.what) from (exc if exc is not None else self._error)


def write_private(path: str | os.PathLike, data: bytes | str, what: str = "file", *, sync: bool = True) -> None:
    """Write ``data`` (str: UTF-8) to ``path``, mode 0600 (:class:`PrivateFile`).

    Raises:
        StorageError: the write failed (naming ``path``, why and the fix).
    """
    with PrivateFile(path, what, sync=sync) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def write_arrays(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
    """``arrays`` to ``path`` as an uncompressed ``.npz``, 0600 (NOTE [private files]).

    Raises:
        StorageError: the write failed (naming the file, why and the fix).
    """
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_private(path, buf.getbuffer(), "checkpoint file")


def read_arrays(path: pathlib.Path) -> dict[str, np.ndarray]:
    """The arrays of :func:`write_arrays` (never unpickled).

    Raises:
        DataError: the file is missing, torn or not such a file (naming it).
    """
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DataError(
            f"checkpoint file {path} is unreadable ({exc}); resume from another checkpoint, or delete "
            f"{path.parent} to fall back to the one before it"
        ) from None

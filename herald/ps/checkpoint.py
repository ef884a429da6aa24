"""Atomic shard checkpoints (Persia §4.2.4: the array-list layout makes a checkpoint a
memory copy).

Layout: ``<dir>/shard-<I>-of-<N>/`` holding, per table ``t``, ``t<index>.keys``
(uint64 [n] raw little-endian) and ``t<index>.rows`` (float32 [n, row_width] raw), when
asked ``t<index>.clocks`` (uint64 [n]: the rows' c_g, NOTE [embedding clocks] in
herald/ps/table.py; a checkpoint off the grid needs them: NOTE [warm resume] in
herald/dispatch/warm.py; without them a restored table starts its clocks at 0), and a
``manifest.json`` written last: format version, shard, num_shards, seed, table configs,
and for each file its dtype, shape, byte size and SHA-256.

Atomicity: everything is written into ``<dir>/.shard-<I>-of-<N>.tmp-<pid>``, each file
fsync'ed, then the folder is renamed over the final name (the previous checkpoint is
moved aside first and removed after), and ``<dir>`` is fsync'ed. A crash leaves either
the old or the new checkpoint, plus at most a temporary folder. Files are 0600 in 0700
folders (NOTE [private files] in herald/files.py); a write that fails (disk full,
permission denied, ...) removes the temporary folder and raises :class:`CheckpointError`
(reason ``"write"``) naming the file, why and the fix. Restore verifies the
manifest, every size and every checksum before changing anything, and raises
:class:`CheckpointError` naming the file on any mismatch (torn or corrupt checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil

import numpy as np

from herald.errors import DataError, StorageError
from herald.files import PrivateFile, private_dir, write_private

FORMAT = 1


class CheckpointError(DataError):
    """A checkpoint is missing, torn or corrupt, or belongs to another job layout; or it
    could not be written (``reason`` ``"write"``: disk full, permission denied, ...)."""


def shard_dir(root: str | os.PathLike, shard: int, num_shards: int) -> pathlib.Path:
    return pathlib.Path(root) / f"shard-{shard}-of-{num_shards}"


def _write(path: pathlib.Path, arr: np.ndarray) -> dict:
    arr = np.ascontiguousarray(arr)
    data = arr.reshape(-1).view(np.uint8).data
    with PrivateFile(path, "checkpoint file") as f:  # fsync'ed
        f.write(data)
    return {
        "file": path.name,
        "dtype": arr.dtype.str,
        "shape": list(arr.shape),
        "bytes": int(arr.nbytes),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def fsync_dir(path: pathlib.Path) -> None:
    """fsync a directory, so that renames inside it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root, shard: int, num_shards: int, seed: int, tables, clocks: bool = False) -> pathlib.Path:
    """Write ``tables`` (list of :class:`~herald.ps.table.EmbeddingTable`) atomically; with
    ``clocks`` their rows' clocks too.

    Returns:
        The final checkpoint folder.

    Raises:
        CheckpointError: a file or folder could not be written (reason ``"write"``; the
            message names it, why and the fix); nothing of this checkpoint is left.
    """
    root = pathlib.Path(root)
    final = shard_dir(root, shard, num_shards)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    try:
        private_dir(root)
        if tmp.exists():
            shutil.rmtree(tmp)
        private_dir(tmp)
        entries = []
        for t in tables:
            keys, rows = t.snapshot()
            entry = {
                "name": t.cfg.name,
                "config": t.cfg.to_dict(),
                "n_rows": int(keys.shape[0]),
                "keys": _write(tmp / f"t{t.index}.keys", keys),
                "rows": _write(tmp / f"t{t.index}.rows", rows),
            }
            if clocks:
                entry["clocks"] = _write(tmp / f"t{t.index}.clocks", t.clocks[: keys.shape[0]])
            entries.append(entry)
        manifest = {"format": FORMAT, "shard": shard, "num_shards": num_shards, "seed": int(seed), "tables": entries}
        write_private(tmp / "manifest.json", json.dumps(manifest, indent=1), "checkpoint file")
    except StorageError as exc:  # free what the partial checkpoint holds (a full disk)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(str(exc), reason="write") from exc
    fsync_dir(tmp)
    old = root / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(root)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    return final


def _read(folder: pathlib.Path, meta: dict) -> np.ndarray:
    try:
        path = folder / str(meta["file"])
        dtype = np.dtype(str(meta["dtype"]))
        shape = tuple(int(d) for d in meta["shape"])
        size, digest = int(meta["bytes"]), str(meta["sha256"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint manifest in {folder} has a bad file entry ({exc})", source=str(folder), reason="manifest"
        ) from None
    if dtype.kind not in "uf" or path.parent != folder:
        raise CheckpointError(f"checkpoint manifest in {folder} has a bad file entry", source=str(folder))
    if not path.is_file() or path.stat().st_size != size:
        raise CheckpointError(
            f"checkpoint file {path} is missing or has the wrong size (torn write?); restore an older checkpoint",
            source=str(path),
            reason="size",
        )
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(
            f"checkpoint file {path} fails its SHA-256 check (corrupt); restore an older checkpoint",
            source=str(path),
            reason="checksum",
        )
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != size:
        raise CheckpointError(
            f"checkpoint file {path}: shape {shape} disagrees with its size", source=str(path), reason="shape"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def load(root, shard: int, num_shards: int, seed: int, tables, with_clocks: bool = False) -> list[tuple]:
    """Read and verify this shard's checkpoint; returns ``[(keys, rows)]`` per table, with
    ``with_clocks`` ``[(keys, rows, clocks uint64 [n] or None)]`` (None: saved without them).

    Raises:
        CheckpointError: missing/torn/corrupt files, or a layout (shard count, table
            configs) different from the running shard's.
    """
    folder = shard_dir(root, shard, num_shards)
    mpath = folder / "manifest.json"
    if not mpath.is_file():
        raise CheckpointError(
            f"no checkpoint manifest at {mpath}: the checkpoint is missing or was never completed",
            source=str(mpath),
            reason="missing",
        )
    try:
        manifest = json.loads(mpath.read_text())
        entries = manifest["tables"]
        ok = (
            manifest["format"] == FORMAT
            and manifest["shard"] == shard
            and manifest["num_shards"] == num_shards
            and manifest["seed"] == int(seed)
            and isinstance(entries, list)
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint manifest {mpath} is unreadable ({exc})", source=str(mpath), reason="manifest"
        ) from None
    if not ok:
        raise CheckpointError(
            f"checkpoint {folder} is for another format, shard layout or seed", source=str(mpath), reason="layout"
        )
    if [e.get("config") for e in entries] != [t.cfg.to_dict() for t in tables]:
        raise CheckpointError(
            f"checkpoint {folder} was written with other table declarations; declare the same tables before restoring",
            source=str(mpath),
            reason="tables",
        )
    out = []
    for e, t in zip(entries, tables):
        keys, rows = _read(folder, e["keys"]), _read(folder, e["rows"])
        if (
            keys.dtype != np.uint64
            or rows.dtype != np.float32
            or keys.ndim != 1
            or rows.shape != (keys.shape[0], t.width)
        ):
            raise CheckpointError(
                f"checkpoint {folder}: table {t.cfg.name!r} arrays have wrong shapes",
                source=str(folder),
                reason="shape",
            )
        if np.unique(keys).shape[0] != keys.shape[0]:
            raise CheckpointError(
                f"checkpoint {folder}: table {t.cfg.name!r} has duplicate keys", source=str(folder), reason="keys"
            )
        out.append((keys, rows, _clocks(folder, e, keys, t.cfg.name)) if with_clocks else (keys, rows))
    return out


def _clocks(folder: pathlib.Path, entry: dict, keys: np.ndarray, name: str) -> np.ndarray | None:
    """A table's clocks (uint64 [n]) in a checkpoint, None when saved without them.

    Raises:
        CheckpointError: a torn or corrupt file, or the wrong shape.
    """
    if "clocks" not in entry:
        return None
    clocks = _read(folder, entry["clocks"])
    if clocks.dtype != np.uint64 or clocks.shape != keys.shape:
        raise CheckpointError(f"checkpoint {folder}: table {name!r} clocks have the wrong shape", source=str(folder))
    return clocks

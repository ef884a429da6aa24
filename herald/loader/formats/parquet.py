"""Parquet source: row groups read with pyarrow, converted by :mod:`herald.loader.formats.arrow`.

A path is one ``.parquet`` file or a directory (its ``*.parquet`` files in name
order, one dataset). Every file's schema is checked when the source opens (the column
types of NOTE [arrow layout], the same layout and dense width in every file), so a
bad file is named before anything is read; in a directory, any other file is an error
that names it (names starting with ``_`` or ``.``, such as Spark's ``_SUCCESS`` and
``.crc`` files, are metadata and ignored). Each row group's labels and dense values
are checked when it is decoded (NOTE [value checks] in :mod:`herald.loader.validation`)
and bad rows follow NOTE [bad records] (:mod:`herald.loader.policy`): ``strict`` raises
naming the file and the row (0-based, within the file), ``skip`` counts per reason
and quarantines one JSON line per bad row.

NOTE [page checksums]: pyarrow checks the CRC32 of every page that carries one
(``READ_OPTIONS``; ``herald convert`` and ``herald datagen`` write one per page,
:data:`herald.loader.conversion.WRITER_OPTIONS`); pages without one (files from other
writers, or herald's own from before checksums) are read unchecked. A mismatch means
the bytes changed after writing; which rows the page held is not known, so every row
of the row group is a bad record (``bad_checksum``): ``strict`` raises naming the file
and the row group, ``skip`` counts the group's rows from the position on, quarantines
one JSON line for the group (file, row_group, rows [first, stop), reason, error) and
reads on with the next group.

Position = (file index, row group, row within the row group, bad rows included);
resume reads that row group again and skips the rows before the position.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from herald.config import require
from herald.errors import DataError
from herald.loader.batch import SampleBatch, Schema
from herald.loader.formats.arrow import arrow_to_batch, infer_layout
from herald.loader.kernels import BAD_CHECKSUM, REASONS
from herald.loader.policy import BadRecordLog, BadRecordSettings
from herald.loader.source import Source, state_int
from herald.loader.validation import describe, value_status

# NOTE [page checksums]: verify every page that carries a CRC.
READ_OPTIONS = types.MappingProxyType({"page_checksum_verification": True})
# pyarrow raises a plain OSError for a CRC mismatch; this is the part of its message that says so.
_CHECKSUM_MESSAGE = "CRC checksum verification failed"


@dataclasses.dataclass(frozen=True)
class ParquetSettings:
    """Args: use_threads: let pyarrow decode columns of a row group in parallel."""

    use_threads: bool = True

    def __post_init__(self) -> None:
        require(isinstance(self.use_threads, bool), "use_threads must be a bool")


def dataset_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The ``*.parquet`` files of ``folder`` in name order.

    Raises:
        DataError: the folder holds other entries (not starting with ``_`` or ``.``),
            naming them: herald would not read them, and a silently smaller dataset
            is worse than an error.
    """
    files, others = [], []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(("_", ".")):
            continue
        (files if entry.is_file() and entry.name.endswith(".parquet") else others).append(entry.name)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise DataError(
            f"{folder} holds {len(others)} entr{'y' if len(others) == 1 else 'ies'} herald does not "
            f"read: {shown}. A directory source reads only *.parquet files (names starting with '_' "
            "or '.' are ignored as metadata); convert the others with herald convert (e.g. a .tsv to "
            ".parquet) or move them out of the directory",
            source=str(folder),
        )
    return [folder / name for name in files]


class ParquetSource(Source):
    """Rows of one Parquet file or a directory of them (NOTE [arrow layout] columns).

    Args:
        path: a ``.parquet`` file or a directory of them.
        settings: :class:`ParquetSettings`; bad: the bad-record policy (NOTE [bad records]).

    Raises:
        DataError: no such file, entries other than ``.parquet`` files in the directory,
            an unreadable file, files with different layouts, a column that cannot be
            mapped (each naming the file and column); bad rows under ``strict`` (file, row);
            a page that fails its checksum under ``strict`` (file, row group; NOTE [page
            checksums]).
    """

    format_name = "parquet"

    def __init__(
        self, path, *, settings: ParquetSettings = ParquetSettings(), bad: BadRecordSettings = BadRecordSettings()
    ):
        super().__init__()
        p = pathlib.Path(path)
        self.path = os.fspath(path)
        files = dataset_files(p) if p.is_dir() else [p]
        if not files or not files[0].exists():
            raise DataError(
                f"no Parquet file at {path}; write one with herald convert or herald datagen", source=self.path
            )
        self._settings = settings
        self._files = []
        for f in files:
            try:
                self._files.append(pq.ParquetFile(f, **READ_OPTIONS))
            except (OSError, ValueError, pa.ArrowException) as exc:
                raise DataError(
                    f"cannot read Parquet file {f}: {exc}; rewrite it with herald convert", source=str(f)
                ) from exc
        self._paths = [str(f) for f in files]
        self._names = [f.name for f in files]
        self._layout = infer_layout(self._files[0].schema_arrow, self._paths[0])
        dense_dim = self._dense_dim(self._files[0].schema_arrow)
        for f, where in zip(self._files[1:], self._paths[1:]):
            if infer_layout(f.schema_arrow, where) != self._layout:
                raise DataError(
                    f"{where} has another column layout than {self._paths[0]}; a directory must hold "
                    "one dataset (the same label, dense and table columns in every file)",
                    source=self.path,
                )
            if self._dense_dim(f.schema_arrow) != dense_dim:
                raise DataError(
                    f"{where} has {self._dense_dim(f.schema_arrow)} dense features, {self._paths[0]} "
                    f"has {dense_dim}; a directory must hold one dataset",
                    source=self.path,
                )
        self._schema = Schema(tuple(t["name"] for t in self._layout["tables"]), dense_dim)
        self._log = BadRecordLog(bad, self.path)
        self._pos = (0, 0, 0)
        self._group: SampleBatch | None = None
        self._status: np.ndarray | None = None  # NOTE [record status] codes of the group, None: all good
        self._good: np.ndarray | None = None  # rows to serve (strict: only those before the first bad one)

    def _dense_dim(self, schema) -> int:
        spec = self._layout.get("dense")
        if isinstance(spec, str):
            return schema.field(spec).type.list_size
        return len(spec or [])

    @property
    def schema(self) -> Schema:
        return self._schema

    @property
    def multi_hot_tables(self) -> frozenset[str]:
        return frozenset(t["name"] for t in self._layout["tables"] if t.get("kind") == "multi")

    @property
    def num_rows(self) -> int | None:
        """Rows in the files' metadata under ``strict`` (a bad row raises, so every row
        served is one of them); None under ``skip``, where the good rows are known only
        after decoding."""
        if not self._log.strict:
            return None
        return sum(f.metadata.num_rows for f in self._files)

    @property
    def metadata(self) -> dict[bytes, bytes]:
        """Key-value metadata of the first file (e.g. ``herald.synthetic``)."""
        return dict(self._files[0].schema_arrow.metadata or {})

    def _skipped(self) -> dict:
        return self._log.skipped

    # ----------------------------------------------------------------- reading
    def _load_group(self, fi: int, gi: int, row: int) -> bool:
        """Decode row group ``gi`` of file ``fi`` into ``self._group``; False when a page
        failed its checksum and ``skip`` dropped the group (NOTE [page checksums])."""
        try:
            table = self._files[fi].read_row_group(gi, use_threads=self._settings.use_threads)
            group = arrow_to_batch(table, self._layout)
        except DataError as exc:
            raise DataError(f"{self._paths[fi]}, row group {gi}: {exc}", source=self._paths[fi]) from exc
        except (OSError, ValueError, TypeError, pa.ArrowException) as exc:
            if isinstance(exc, OSError) and _CHECKSUM_MESSAGE in str(exc):
                self._drop_group(fi, gi, row, exc)
                return False
            raise DataError(
                f"cannot decode row group {gi} of {self._paths[fi]}: {exc}; rewrite the file with herald convert",
                source=self._paths[fi],
            ) from exc
        self._group = group
        self._status = value_status(group.labels, group.dense)
        self._good = None
        if self._status is not None:
            good = self._status == 0
            if self._log.strict:
                good[int(np.flatnonzero(~good)[0]) :] = False
            self._good = np.flatnonzero(good)
        return True

    def _drop_group(self, fi: int, gi: int, row: int, exc: OSError) -> None:
        """The rows of row group ``gi`` from ``row`` on are bad records (NOTE [page checksums]).

        Raises:
            DataError: under ``strict``, naming the file and the row group (``reason``
                ``bad_checksum``, ``position`` the group's first row in the file).
        """
        path, first = self._paths[fi], self._file_row(fi, gi, 0)
        stop = first + self._files[fi].metadata.row_group(gi).num_rows
        if self._log.strict:
            where = f"row group {gi} (rows {{position}} to {stop - 1}, 0-based) of {path}"
            raise self._log.error(
                BAD_CHECKSUM,
                first,
                where,
                source=path,
                detail=f"{exc}; the file changed after it was written (disk or copy corruption): "
                "restore it, or write it again with herald convert",
            )
        raw = ()
        if self._log.settings.quarantine_path is not None:
            raw = [
                json.dumps(
                    {
                        "file": path,
                        "row_group": gi,
                        "rows": [first + row, stop],
                        "reason": REASONS[BAD_CHECKSUM],
                        "error": str(exc),
                    }
                ).encode()
            ]
        self._log.record(np.full(max(stop - first - row, 0), BAD_CHECKSUM, np.int8), raw)

    def _file_row(self, fi: int, gi: int, row: int) -> int:
        md = self._files[fi].metadata
        return sum(md.row_group(g).num_rows for g in range(gi)) + row

    def _pass(self, fi: int, gi: int, start: int, stop: int) -> None:
        """Move over rows ``[start, stop)`` of the group: count (and quarantine) its bad rows."""
        if self._status is None or self._log.strict or stop <= start:
            return
        codes = self._status[start:stop]
        bad = np.flatnonzero(codes) + start
        if not bad.size:
            return
        raw = ()
        if self._log.settings.quarantine_path is not None:
            first = self._file_row(fi, gi, 0)
            g = self._group
            raw = [
                json.dumps(
                    {
                        "file": self._paths[fi],
                        "row": first + int(r),
                        "reason": REASONS[self._status[r]],
                        "label": float(g.labels[r]),
                        "dense": g.dense[r].tolist(),
                    }
                ).encode()
                for r in bad
            ]
        self._log.record(codes, raw)

    def _read(self, max_rows: int) -> SampleBatch | None:
        fi, gi, row = self._pos
        while True:
            if fi >= len(self._files):
                self._pos = (fi, 0, 0)
                return None
            f = self._files[fi]
            if gi >= f.num_row_groups:
                fi, gi, row, self._group = fi + 1, 0, 0, None
                continue
            if self._group is None and not self._load_group(fi, gi, row):
                gi, row = gi + 1, 0
                continue
            n = len(self._group)
            if row >= n:
                gi, row, self._group = gi + 1, 0, None
                continue
            if self._good is None:
                out = self._group.slice(row, row + max_rows)
                row += len(out)
            else:
                idx = self._good[np.searchsorted(self._good, row) :][:max_rows]
                if idx.size == 0:  # nothing to serve from ``row`` on: pass the rest (strict: stop at the bad row)
                    bad = np.flatnonzero(self._status[row:]) + row
                    if self._log.strict and bad.size:
                        self._pos = (fi, gi, int(bad[0]))
                        r = int(bad[0])
                        raise self._log.error(
                            int(self._status[r]),
                            self._file_row(fi, gi, r),
                            f"row {{position}} (0-based) of {self._paths[fi]}",
                            source=self._paths[fi],
                            detail=describe(self._group.labels, self._group.dense, r),
                        )
                    self._pass(fi, gi, row, n)
                    gi, row, self._group = gi + 1, 0, None
                    continue
                out = self._group.take(idx)
                self._pass(fi, gi, row, int(idx[-1]) + 1)
                row = int(idx[-1]) + 1
            if row >= n:
                self._pass(fi, gi, row, n)
                gi, row, self._group = gi + 1, 0, None
            self._pos = (fi, gi, row)
            return out

    # ------------------------------------------------------------------- state
    def _get_state(self) -> dict:
        fi, gi, row = self._pos
        name = self._names[fi] if fi < len(self._names) else None
        return {"file_index": fi, "file": name, "row_group": gi, "row": row, "skipped": dict(self._log.skipped)}

    def _set_state(self, state: dict) -> None:
        fi, gi, row = state_int(state, "file_index"), state_int(state, "row_group"), state_int(state, "row")
        if fi < len(self._files):
            if state.get("file") != self._names[fi]:
                raise DataError(
                    f"state is for file {state.get('file')!r}, file {fi} here is "
                    f"{self._names[fi]!r}; pass the state of the same dataset"
                )
            if gi > self._files[fi].num_row_groups:
                raise DataError(f"malformed state: row group {gi} of {self._names[fi]} does not exist")
        elif fi > len(self._files):
            raise DataError(f"malformed state: file index {fi} > {len(self._files)} files")
        self._log.load(state.get("skipped", {}))
        self._pos, self._group = (fi, gi, row), None

    def close(self, timeout_s: float = 5.0) -> None:
        if not self._closed:
            self._log.close()
        super().close(timeout_s)

"""Parquet source: row groups read with pyarrow, converted by :mod:`herald.loader.formats.arrow`.

A path is one ``.parquet`` file or a directory (its ``*.parquet`` files in name
order, one dataset). Position = (file index, row group, row within the row group);
resume reads that row group again and skips the rows before the position.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import pyarrow.parquet as pq

from herald.config import require
from herald.errors import DataError
from herald.loader.formats.arrow import arrow_to_batch, infer_layout
from herald.loader.batch import SampleBatch, Schema
from herald.loader.source import Source, state_int


@dataclasses.dataclass(frozen=True)
class ParquetSettings:
    """Args: use_threads: let pyarrow decode columns of a row group in parallel."""

    use_threads: bool = True

    def __post_init__(self) -> None:
        require(isinstance(self.use_threads, bool), "use_threads must be a bool")


class ParquetSource(Source):
    """Rows of one Parquet file or a directory of them (NOTE [arrow layout] columns).

    Raises:
        DataError: no such file, no ``.parquet`` file in the directory, files with
            different layouts, or a column layout that cannot be mapped.
    """

    format_name = "parquet"

    def __init__(self, path, *, settings: ParquetSettings = ParquetSettings()):
        super().__init__()
        p = pathlib.Path(path)
        self.path = os.fspath(path)
        files = sorted(p.glob("*.parquet")) if p.is_dir() else [p]
        if not files or not files[0].exists():
            raise DataError(f"no Parquet file at {path}; write one with herald convert or herald datagen",
                            source=self.path)
        self._settings = settings
        try:
            self._files = [pq.ParquetFile(f) for f in files]
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read Parquet {path}: {exc}", source=self.path) from exc
        self._names = [f.name for f in files]
        self._layout = infer_layout(self._files[0].schema_arrow)
        for f, name in zip(self._files[1:], self._names[1:]):
            if infer_layout(f.schema_arrow) != self._layout:
                raise DataError(f"{name} has another column layout than {self._names[0]}; "
                                "a directory must hold one dataset", source=self.path)
        self._schema = Schema(tuple(t["name"] for t in self._layout["tables"]),
                              self._dense_dim(self._files[0].schema_arrow))
        self._pos = (0, 0, 0)
        self._group: SampleBatch | None = None

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
    def num_rows(self) -> int:
        return sum(f.metadata.num_rows for f in self._files)

    @property
    def metadata(self) -> dict[bytes, bytes]:
        """Key-value metadata of the first file (e.g. ``herald.synthetic``)."""
        return dict(self._files[0].schema_arrow.metadata or {})

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
            if self._group is None:
                table = f.read_row_group(gi, use_threads=self._settings.use_threads)
                self._group = arrow_to_batch(table, self._layout)
            if row >= len(self._group):
                gi, row, self._group = gi + 1, 0, None
                continue
            out = self._group.slice(row, row + max_rows)
            row += len(out)
            if row >= len(self._group):
                gi, row, self._group = gi + 1, 0, None
            self._pos = (fi, gi, row)
            return out

    def _get_state(self) -> dict:
        fi, gi, row = self._pos
        name = self._names[fi] if fi < len(self._names) else None
        return {"file_index": fi, "file": name, "row_group": gi, "row": row}

    def _set_state(self, state: dict) -> None:
        fi, gi, row = state_int(state, "file_index"), state_int(state, "row_group"), state_int(state, "row")
        if fi < len(self._files):
            if state.get("file") != self._names[fi]:
                raise DataError(f"state is for file {state.get('file')!r}, file {fi} here is "
                                f"{self._names[fi]!r}; pass the state of the same dataset")
            if gi > self._files[fi].num_row_groups:
                raise DataError(f"malformed state: row group {gi} of {self._names[fi]} does not exist")
        elif fi > len(self._files):
            raise DataError(f"malformed state: file index {fi} > {len(self._files)} files")
        self._pos, self._group = (fi, gi, row), None

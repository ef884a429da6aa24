"""The raw-format file sources: Criteo TSV, Avazu CSV, libFM, MovieLens.

Each is a :class:`herald.loader.source.Source`; layouts are documented in
:mod:`herald.loader.formats.layouts`. ``open_source`` (:mod:`herald.loader.registry`)
builds them from a path and keyword options.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from herald.config import require
from herald.errors import DataError
from herald.loader.batch import Schema
from herald.loader.formats import layouts as formats
from herald.loader.formats.text import TextFileSource, TextSettings
from herald.loader.policy import BadRecordLog, BadRecordSettings
from herald.loader.source import MemorySource


class CriteoSource(TextFileSource):
    """Criteo TSV (label, I1-I13, C1-C26; no header). Options: ``bucket_count`` (0 = full
    64-bit ids), ``chunk_bytes``, ``bad_records``, ``quarantine_path``."""

    def __init__(self, path, *, bucket_count: int = 0, bad=BadRecordSettings(), text=TextSettings()):
        super().__init__(path, formats.criteo_format(bucket_count), bad=bad, text=text)


class AvazuSource(TextFileSource):
    """Avazu CSV, with or without the header line (detected: the first line starts with
    ``id,click,``, the published header; any other first line is a record, so a
    malformed one is counted as bad rather than dropped as a header)."""

    def __init__(self, path, *, bucket_count: int = 0, bad=BadRecordSettings(), text=TextSettings()):
        super().__init__(
            path,
            formats.avazu_format(bucket_count),
            bad=bad,
            text=text,
            header=lambda line: line.startswith(b"id,click,"),
        )


class LibfmSource(TextFileSource):
    """libFM with one active index per field (Frappe: 10 fields); see ``LibfmFormat``."""

    def __init__(
        self, path, *, table_names=formats.LibfmFormat.FRAPPE_FIELDS, bad=BadRecordSettings(), text=TextSettings()
    ):
        super().__init__(path, formats.LibfmFormat(tuple(table_names)), bad=bad, text=text)


@dataclasses.dataclass(frozen=True)
class MovieLensSettings:
    """Args: threshold: label = 1 when rating >= threshold (rating units, 1-5 stars)."""

    threshold: float = 4.0

    def __post_init__(self) -> None:
        require(0.0 <= self.threshold <= 10.0, f"threshold must be in [0, 10], got {self.threshold}")


class MovieLensSource(MemorySource):
    """MovieLens ratings (``ratings.csv`` with header, or ml-100k ``u.data``).

    Rows are served in timestamp order (stable sort, so ties keep file order), which
    needs the whole file: it is decoded once at open (the files are small; use
    ``herald convert`` for anything large). Tables ``user`` and ``item`` hold the raw
    ids; label = ``rating >= threshold``; no dense features. Bad records are counted
    at open (the whole file is passed then); ``stats["skipped"]`` is complete from the
    start. Position = row index in timestamp order.
    """

    format_name = "movielens"

    def __init__(self, path, *, settings=MovieLensSettings(), bad=BadRecordSettings()):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise DataError(f"cannot open {self.path}: {exc}; check the path", source=self.path) from exc
        header = data.startswith(b"userId,")
        # ratings.csv is comma-separated, u.data tab-separated: the more frequent wins
        sep = b"\t" if data.count(b"\t", 0, 1 << 16) > data.count(b",", 0, 1 << 16) else b","
        fmt = formats.movielens_format(sep)
        self._schema = fmt.schema
        buf = np.frombuffer(data, np.uint8)
        starts, ends, _ = formats.split_lines(buf, True)
        first = 1 if header else 0
        starts, ends = starts[first:], ends[first:]
        decoded = fmt.decode(buf, starts, ends)
        self._log = BadRecordLog(bad, self.path)
        bad_rows = np.flatnonzero(decoded.status)
        if bad_rows.size:
            if self._log.strict:
                raise self._log.error(int(decoded.status[bad_rows[0]]), int(bad_rows[0]) + first + 1)
            raw = [data[starts[k] : ends[k]] for k in bad_rows] if bad.quarantine_path else ()
            self._log.record(decoded.status, raw)
        good = np.flatnonzero(decoded.status == 0)
        order = good[np.argsort(decoded.aux[1, good], kind="stable")]
        batch = decoded.batch(order)
        batch.labels = (decoded.aux[0, order] >= settings.threshold).astype(np.float32)
        super().__init__(batch)
        self.ratings = decoded.aux[0, order]
        self.timestamps = decoded.aux[1, order].astype(np.int64)

    @property
    def schema(self) -> Schema:
        return self._schema

    def _skipped(self) -> dict:
        return self._log.skipped

    def close(self, timeout_s: float = 5.0) -> None:
        self._log.close()
        super().close(timeout_s)

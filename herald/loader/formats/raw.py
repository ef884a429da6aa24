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
from herald.loader.batch import SampleBatch, Schema
from herald.loader.formats import layouts as formats
from herald.loader.formats import movielens_side as side
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
    """Args: threshold: label = 1 when rating >= threshold (rating units, 1-5 stars);
    side_features: add the tables of NOTE [movielens side features] (``genres``,
    ``history``; ml-100k also ``age``, ``gender``, ``occupation``, ``zip``) from the side
    files beside the ratings file; history_length: most ids (the most recent) in a
    sample's ``history``, >= 1."""

    threshold: float = 4.0
    side_features: bool = False
    history_length: int = 50

    def __post_init__(self) -> None:
        require(0.0 <= self.threshold <= 10.0, f"threshold must be in [0, 10], got {self.threshold}")
        require(isinstance(self.side_features, bool), f"side_features must be a bool, got {self.side_features!r}")
        require(
            isinstance(self.history_length, int) and not isinstance(self.history_length, bool),
            f"history_length must be an int, got {self.history_length!r}",
        )
        require(self.history_length >= 1, f"history_length must be >= 1, got {self.history_length}")


class MovieLensSource(MemorySource):
    """MovieLens ratings (``ratings.csv`` with header, or ml-100k ``u.data``).

    Rows are served in timestamp order (stable sort, so ties keep file order), which
    needs the whole file: it is decoded once at open (the files are small; use
    ``herald convert`` for anything large). Tables ``user`` and ``item`` hold the raw
    ids; label = ``rating >= threshold``; no dense features. Bad records are counted
    at open (the whole file is passed then); ``stats["skipped"]`` is complete from the
    start. Position = row index in timestamp order.

    With ``settings.side_features`` the tables of NOTE [movielens side features]
    (:mod:`herald.loader.formats.movielens_side`) follow ``user`` and ``item``, built at
    open from the side files beside ``path`` (a missing one raises DataError naming it);
    ``stats`` then adds ``side_skipped`` (side file -> reason -> bad rows skipped) and
    ``history_truncated`` (samples whose history was cut to ``history_length``).
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
        self.ratings = decoded.aux[0, order]
        self.timestamps = decoded.aux[1, order].astype(np.int64)
        self._side: side.SideFeatures | None = None
        if settings.side_features:
            self._side = side.side_features(
                self.path, sep == b"\t", batch.values[0], batch.values[1], self.timestamps, settings.history_length
            )
            batch = SampleBatch(
                batch.labels,
                batch.dense,
                batch.values + self._side.values,
                batch.offsets + self._side.offsets,
                batch.table_names + self._side.names,
                validate=False,
            )
            self._schema = batch.schema
        super().__init__(batch)

    @property
    def schema(self) -> Schema:
        return self._schema

    @property
    def multi_hot_tables(self) -> frozenset[str]:
        return frozenset(side.LATEST_TABLES) if self._side is not None else frozenset()

    @property
    def stats(self) -> dict:
        if self._side is None:
            return super().stats
        return {
            **super().stats,
            "side_skipped": {f: dict(r) for f, r in self._side.skipped.items()},
            "history_truncated": self._side.history_truncated,
        }

    def _skipped(self) -> dict:
        return self._log.skipped

    def close(self, timeout_s: float = 5.0) -> None:
        self._log.close()
        super().close(timeout_s)

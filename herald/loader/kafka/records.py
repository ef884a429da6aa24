"""Kafka records -> position-tagged chunks of samples (the decoding half of the Kafka source).

A *chunk* is what one poll delivered for one partition, decoded: the good rows as a
:class:`SampleBatch` plus, per row, the Kafka offset of the record it came from and
its index inside that record (a ``tsv``/``csv`` record is one raw line, one sample;
an ``arrow`` record is one Arrow IPC stream of many samples).
Bad records stay in the chunk as (offset, row, reason) so the source counts them
when its position passes them (NOTE [bad records] in :mod:`herald.loader.policy`).

Decoding itself is the loader's: text lines go through
:mod:`herald.loader.formats.layouts` (the same kernels as the file sources), Arrow through
:mod:`herald.loader.formats.arrow`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from herald.errors import DataError
from herald.loader.batch import SampleBatch, Schema
from herald.loader.formats import layouts as formats
from herald.loader.formats.arrow import arrow_to_batch
from herald.loader.formats.decode import decode_lines
from herald.loader.kernels import REASONS
from herald.loader.validation import value_status

# Kafka-only reasons, beside NOTE [record status]'s REASONS.
BAD_ARROW = "bad_arrow"  # payload is not a readable Arrow IPC stream
SCHEMA_MISMATCH = "schema_mismatch"  # an Arrow stream with other columns than the source's schema

FORMATS = {"tsv": "criteo", "csv": "avazu", "arrow": "arrow"}


@dataclasses.dataclass
class Chunk:
    """Decoded samples of consecutive records of one partition.

    Attributes:
        partition: Kafka partition.
        batch: the good rows, ``n`` samples.
        offsets: int64 [n], Kafka offset of each row's record.
        rows: int64 [n], index of the row inside its record.
        last: bool [n], True where the row is the record's last sample (bad ones included).
        end: the position once the chunk is drained: (offset after its last record, 0), or
            under ``strict`` the first bad record (see :meth:`truncate_at_first_bad`).
        bad_offsets, bad_rows: int64 [k], where the bad records are, in order.
        bad_reasons: k reason names.
        cursor: rows already delivered.
        bad_counted: bad records already counted (those before the position).
        record_at, record_ms: int64 [r], each polled record's offset (ascending) and its
            timestamp (ms since the epoch; -1 where the broker gives none, as 0.9 does):
            NOTE [lag] in herald/loader/kafka/source.py. Empty until the source sets them.
    """

    partition: int
    batch: SampleBatch
    offsets: np.ndarray
    rows: np.ndarray
    last: np.ndarray
    end: tuple[int, int]
    bad_offsets: np.ndarray
    bad_rows: np.ndarray
    bad_reasons: list[str]
    cursor: int = 0
    bad_counted: int = 0
    record_at: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    record_ms: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def remaining(self) -> int:
        return len(self.batch) - self.cursor

    def position_after(self, cursor: int) -> tuple[int, int]:
        """(next offset, rows of that record already delivered) once ``cursor`` >= 1 rows are out.

        A drained chunk is at ``end`` (past its trailing bad records, if any).
        """
        if cursor >= len(self.batch):
            return self.end
        j = cursor - 1
        if self.last[j]:
            return int(self.offsets[j]) + 1, 0
        return int(self.offsets[j]), int(self.rows[j]) + 1

    def truncate_at_first_bad(self) -> Chunk:
        """For ``strict``: the rows before the first bad record, ending at that record."""
        if not self.bad_reasons:
            return self
        pos = (int(self.bad_offsets[0]), int(self.bad_rows[0]))
        idx = np.flatnonzero(self._before(self.offsets, self.rows, pos))
        return self._subset(idx, pos, np.arange(1))

    def _subset(self, idx: np.ndarray, end: tuple[int, int], bad_idx: np.ndarray) -> Chunk:
        """The rows ``idx`` (int64 [n]) and the bad records ``bad_idx`` (int64 [k]) of this
        chunk, as a chunk ending at ``end``."""
        return Chunk(
            self.partition,
            self.batch.take(idx),
            self.offsets[idx],
            self.rows[idx],
            self.last[idx],
            end,
            self.bad_offsets[bad_idx],
            self.bad_rows[bad_idx],
            [self.bad_reasons[i] for i in bad_idx],
            record_at=self.record_at,
            record_ms=self.record_ms,
        )

    def delivered_ms(self) -> int:
        """The timestamp (ms; -1: unknown) of the record of the last row delivered (``cursor`` >= 1)."""
        return self.timestamp_ms(int(self.offsets[self.cursor - 1]))

    def first_bad_error(self, fmt: str, source_name: str) -> DataError:
        """The :class:`DataError` of this chunk's first bad record under ``strict`` (NOTE [bad
        records]): the format ``fmt``, the reason, where (``source_name``/partition, offset)."""
        off, row = int(self.bad_offsets[0]), int(self.bad_rows[0])
        return DataError(
            f"bad {fmt} record: {self.bad_reasons[0]}"
            + (f" (sample {row} of the message)" if row else "")
            + "; fix the producer or open the source with bad_records='skip' to drop and count bad records",
            source=f"{source_name}/{self.partition}",
            position=off,
            reason=self.bad_reasons[0],
        )

    def timestamp_ms(self, offset: int) -> int:
        """The timestamp (ms since the epoch) of the record at ``offset``; -1: unknown."""
        i = int(np.searchsorted(self.record_at, offset))
        return int(self.record_ms[i]) if i < self.record_at.shape[0] and self.record_at[i] == offset else -1

    @staticmethod
    def _before(offsets: np.ndarray, rows: np.ndarray, position: tuple[int, int]) -> np.ndarray:
        off, row = position
        return (offsets < off) | ((offsets == off) & (rows < row))

    def bad_before(self, position: tuple[int, int]) -> int:
        """Number of bad records strictly before ``position`` (offset, row)."""
        return int(np.count_nonzero(self._before(self.bad_offsets, self.bad_rows, position)))

    def drop_before(self, position: tuple[int, int]) -> Chunk:
        """This chunk without the rows and bad records before ``position`` (resume skip-ahead)."""
        keep = ~self._before(self.offsets, self.rows, position)
        bkeep = ~self._before(self.bad_offsets, self.bad_rows, position)
        if keep.all() and bkeep.all():
            return self
        return self._subset(np.flatnonzero(keep), self.end, np.flatnonzero(bkeep))


def _empty_chunk(partition: int, schema: Schema, end_offset: int, bad: list) -> Chunk:
    z = np.zeros(0, np.int64)
    return Chunk(
        partition,
        SampleBatch.empty(schema),
        z,
        z,
        np.zeros(0, bool),
        (end_offset, 0),
        np.array([b[0] for b in bad], np.int64),
        np.array([b[1] for b in bad], np.int64),
        [b[2] for b in bad],
    )


class TextDecoder:
    """``tsv`` (Criteo) and ``csv`` (Avazu) records: one raw line per Kafka message.

    Decoded by :func:`herald.loader.formats.decode.decode_lines` (the contract of
    ``decode_records``: a trailing ``\\n`` or ``\\r\\n`` is removed, a message with an
    inner newline is a ``field_count`` error, an empty message an ``empty_line``
    error), which keeps each record's status so the source can name bad offsets.
    """

    def __init__(self, fmt: str, bucket_count: int = 0):
        self.format = fmt
        self._name = "criteo" if fmt == "tsv" else "avazu"
        self._bucket_count = bucket_count
        self.schema = (formats.criteo_format if fmt == "tsv" else formats.avazu_format)(bucket_count).schema

    def decode(self, partition: int, offsets: np.ndarray, values: list[bytes]) -> Chunk:
        """Decode the ``values`` (one line per record) at ``offsets`` (int64 [m]) of ``partition``."""
        decoded = decode_lines(self._name, values, bucket_count=self._bucket_count)
        good = np.flatnonzero(decoded.status == 0)
        bad = np.flatnonzero(decoded.status != 0)
        zeros = np.zeros(good.shape[0], np.int64)
        return Chunk(
            partition,
            decoded.batch(good),
            offsets[good],
            zeros,
            np.ones(good.shape[0], bool),
            (int(offsets[-1]) + 1, 0),
            offsets[bad],
            np.zeros(bad.shape[0], np.int64),
            [REASONS[c] for c in decoded.status[bad]],
        )


class ArrowDecoder:
    """``arrow`` records: each Kafka message is one Arrow IPC stream (one or more record batches).

    A payload that pyarrow cannot read (truncated, corrupt) is a bad record
    ``bad_arrow``; a readable one whose columns differ from the source's schema
    is ``schema_mismatch``. ``schema`` is fixed by the first good message unless given.
    Inside a good message, each sample's label and dense values are checked (NOTE
    [value checks] in :mod:`herald.loader.validation`): a bad sample is a bad record
    ``bad_label`` / ``bad_dense`` at (offset, its row in the message), the others are kept.
    """

    format = "arrow"

    def __init__(self, schema: Schema | None = None):
        self.schema = schema

    def _read(self, value: bytes) -> SampleBatch:
        import pyarrow as pa

        try:
            table = pa.ipc.open_stream(pa.py_buffer(value)).read_all()
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise _Bad(BAD_ARROW, str(exc)) from exc
        try:
            batch = arrow_to_batch(table)
        except (DataError, pa.ArrowException, KeyError, ValueError, TypeError) as exc:
            raise _Bad(SCHEMA_MISMATCH, str(exc)) from exc
        if self.schema is None:
            self.schema = batch.schema
        elif batch.schema != self.schema:
            raise _Bad(SCHEMA_MISMATCH, f"columns {batch.schema} differ from the topic's {self.schema}")
        return batch

    def decode(self, partition: int, offsets: np.ndarray, values: list[bytes]) -> Chunk:
        batches, offs, rows, lasts, bad = [], [], [], [], []
        for off, value in zip(offsets.tolist(), values):
            try:
                b = self._read(value or b"")
            except _Bad as exc:
                bad.append((off, 0, exc.reason))
                continue
            n = len(b)
            status = value_status(b.labels, b.dense)
            keep = np.arange(n, dtype=np.int64)
            if status is not None:
                bad.extend((off, int(r), REASONS[status[r]]) for r in np.flatnonzero(status))
                keep = np.flatnonzero(status == 0)
                b = b.take(keep)
            if keep.size:
                batches.append(b)
                offs.append(np.full(keep.size, off, np.int64))
                rows.append(keep)
                lasts.append(keep == n - 1)
        end = int(offsets[-1]) + 1
        if not batches:
            return _empty_chunk(partition, self.schema or Schema((), 0), end, bad)
        z = np.zeros(0, np.int64)
        return Chunk(
            partition,
            SampleBatch.concat(batches),
            np.concatenate(offs),
            np.concatenate(rows),
            np.concatenate(lasts),
            (end, 0),
            np.array([b[0] for b in bad], np.int64) if bad else z,
            np.array([b[1] for b in bad], np.int64) if bad else z,
            [b[2] for b in bad],
        )


class _Bad(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def make_decoder(fmt: str, bucket_count: int = 0):
    """The decoder of ``fmt`` (``tsv``, ``csv`` or ``arrow``); ``bucket_count`` applies to text ids."""
    return ArrowDecoder() if fmt == "arrow" else TextDecoder(fmt, bucket_count)

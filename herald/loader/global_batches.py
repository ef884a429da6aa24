"""GlobalBatches: the one producer of the exact global batches a job trains on, over
any Source (a file's training split, synthetic data, a Kafka topic).

Built on :class:`~herald.loader.batcher.GlobalBatcher` (``drop_last=False``, no
shuffle): epochs over the first ``train_rows`` rows, ``max_steps`` counted over the
whole job (a resumed producer goes on counting), and the final partial global batch
of each epoch dropped and counted in :attr:`GlobalBatches.info`. What a source adds
per batch (Kafka: the topic position after it and record-derived sample ids) comes
from a :class:`~herald.loader.batcher.ReadTracker` strategy such as :class:`KafkaRecords`.

NOTE [kafka delivery] (docs/kafka.md, "Training from Kafka"): the dispatcher
commits the position after global batch t only when step t and every step before
it have been trained, acked by all workers, and written into a checkpoint (PS rows
+ dense parameters). A restart restores the latest checkpoint and resumes the
topic from the position stored with it, so the restored model holds every sample
before that position exactly once and none after it; the samples after it are
delivered again (at-least-once delivery, each sample counted once in the model).
A partial global batch at the end of a bounded stream is never trained or committed.

Sample ids of Kafka samples identify the record they came from, so a replayed
sample gets the same id as its first delivery::

    bits 63..56  dispatcher rank
    bits 55..48  partition          (< 256)
    bits 47..16  offset             (< 2**32)
    bits 15..0   row within the record (an arrow record holds many samples, < 65,536)
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from herald.errors import ConfigError, DataError
from herald.loader.batch import SampleBatch
from herald.loader.batcher import GlobalBatcher, ReadTracker
from herald.loader.lag import LagHistory
from herald.loader.source import Source
from herald.loader.splits import RowRange

_INFO_KEYS = ("batches", "samples", "dropped_samples")


def record_sample_ids(
    dispatcher_rank: int, partitions: np.ndarray, offsets: np.ndarray, rows: np.ndarray
) -> np.ndarray:
    """uint64 [n] sample ids from (partition int32 [n], offset int64 [n], row int64 [n]).

    Raises:
        DataError: a field exceeds its bit range (see NOTE [kafka delivery]).
    """
    if partitions.size and (partitions.max() >= 256 or offsets.max() >= 2**32 or rows.max() >= 65536):
        raise DataError(
            "Kafka sample ids hold partitions < 256, offsets < 2**32 and < 65,536 samples per "
            "record; use fewer partitions or smaller arrow records"
        )
    return (
        (np.uint64(dispatcher_rank) << np.uint64(56))
        | (partitions.astype(np.uint64) << np.uint64(48))
        | (offsets.astype(np.uint64) << np.uint64(16))
        | rows.astype(np.uint64)
    )


class KafkaRecords(ReadTracker):
    """Tracker of a :class:`~herald.loader.kafka.source.KafkaSource`: each batch carries
    ``(sample ids uint64 [rows], KafkaPosition after it)`` (NOTE [kafka delivery]).

    Args:
        dispatcher_rank: top 8 bits of the sample ids, 0-255.
    """

    def __init__(self, dispatcher_rank: int = 0):
        self.dispatcher_rank = dispatcher_rank
        self._row_of: dict[tuple[int, int], int] = {}  # (partition, offset) -> rows of it seen so far
        self._ids: list[np.ndarray] = []
        self._position = None

    def reset(self, source: Source) -> None:
        # A resumed source starts ``skip`` samples into a record: number its rows from there.
        self._row_of, self._ids = {}, []
        self._position = source.position
        for partition, (offset, skip) in source.position.offsets.items():
            if skip:
                self._row_of[(int(partition), int(offset))] = int(skip)

    def after_read(self, source: Source, rows: int) -> None:
        partitions, offsets = source.last_read_records
        in_record = getattr(source, "last_read_rows", None)
        if in_record is not None and in_record.shape[0] == offsets.shape[0]:
            # the source knows each row's index in its record (bad rows included): ids stay
            # those of the first delivery when a resumed source skips into a record
            self._ids.append(record_sample_ids(self.dispatcher_rank, partitions, offsets, in_record))
            self._position = source.last_read_position
            return
        row = np.empty(offsets.shape[0], np.int64)
        for j, key in enumerate(zip(partitions.tolist(), offsets.tolist())):
            row[j] = self._row_of.get(key, 0)
            self._row_of[key] = row[j] + 1
        if len(self._row_of) > 1 << 16:  # forget records long behind: keep the newest per partition
            newest: dict[int, int] = {}
            for p, o in self._row_of:
                newest[p] = max(o, newest.get(p, -1))
            self._row_of = {k: v for k, v in self._row_of.items() if k[1] == newest[k[0]]}
        self._ids.append(record_sample_ids(self.dispatcher_rank, partitions, offsets, row))
        self._position = source.last_read_position

    def take(self, rows: int) -> tuple[np.ndarray, Any]:
        ids = np.concatenate(self._ids) if self._ids else np.zeros(0, np.uint64)
        self._ids = []
        if ids.shape[0] != rows:
            raise DataError(f"KafkaRecords saw {ids.shape[0]} rows read for a batch of {rows}; this is a bug")
        return ids, self._position


class GlobalBatches:
    """Iterator of global batches of exactly ``global_batch`` samples from ``source``.

    Args:
        source: any :class:`Source`, positioned at its start (or where a batch should
            begin); owned (and closed) by the producer.
        global_batch: samples per batch (workers x batch size), >= 1.
        epochs: passes over the rows (>= 1; a stream has one).
        train_rows: read only the first ``train_rows`` rows each epoch (None: all).
        max_steps: stop once this many batches were produced in total, counting
            those before a restored state (None: until the data ends).
        tracker: a :class:`ReadTracker` giving each batch ``(sample ids, position)``,
            e.g. :class:`KafkaRecords`; None: the source gives neither.
        prefetch_batches: batches read ahead by a thread (0: read in the caller's thread).

    :attr:`info` counts ``batches`` and ``samples`` produced and ``dropped_samples``
    (each epoch's final partial batch: not trained, never silently). :attr:`skipped`
    counts the bad records (reason -> n, NOTE [bad records]) the source passed up to
    the last batch returned, each once however many epochs re-read it. After batch ``i``
    is returned, :meth:`sample_ids` and :meth:`position` give what the tracker recorded
    for it, until :meth:`release`.

    Raises:
        ConfigError: fewer rows than one global batch, or invalid settings.
    """

    def __init__(
        self,
        source: Source,
        global_batch: int,
        *,
        epochs: int = 1,
        train_rows: int | None = None,
        max_steps: int | None = None,
        tracker: ReadTracker | None = None,
        prefetch_batches: int = 2,
    ):
        if train_rows is not None:
            source = RowRange(source, 0, train_rows)
        rows = source.num_rows
        if rows is not None and rows < global_batch:
            source.close()
            raise ConfigError(
                f"{rows} training rows are fewer than one global batch "
                f"({global_batch} = workers x batch size); lower --batch-size or --workers"
            )
        if max_steps is not None and max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1 or None, got {max_steps}")
        self.source, self.global_batch, self.max_steps, self.rows_per_epoch = source, global_batch, max_steps, rows
        self._batcher = GlobalBatcher(
            source, global_batch, drop_last=False, epochs=epochs, prefetch_batches=prefetch_batches, tracker=tracker
        )
        self.info = dict.fromkeys(_INFO_KEYS, 0)
        self.skipped: dict[str, int] = {}
        self.lag = LagHistory()  # NOTE [lag] in herald/loader/kafka/source.py
        self._tracked: dict[int, tuple[np.ndarray | None, Any]] = {}

    def __iter__(self) -> GlobalBatches:
        return self

    def __next__(self) -> SampleBatch:
        while self.max_steps is None or self.info["batches"] < self.max_steps:
            try:
                batch = next(self._batcher)
            except StopIteration:  # the source is at its end: bad records after the last row count too
                self._count_skipped(self.source.stats.get("skipped", {}))
                raise
            self._count_skipped(self._batcher.state_dict()["source"].get("skipped", {}))
            if len(batch) < self.global_batch:
                self.info["dropped_samples"] += len(batch)
                continue
            if self._batcher.last_tracked is not None:
                self._tracked[self.info["batches"]] = self._batcher.last_tracked
            self.info["batches"] += 1
            self.info["samples"] += len(batch)
            self.lag.add(self.info["batches"], self.source.lag())
            return batch
        raise StopIteration

    def _count_skipped(self, at_position: dict) -> None:
        # Every epoch passes the same records, and counts grow along an epoch: the largest
        # count seen per reason is the number of distinct bad records passed.
        if any(v > self.skipped.get(k, 0) for k, v in at_position.items()):
            self.skipped = {k: max(v, self.skipped.get(k, 0)) for k, v in {**self.skipped, **at_position}.items()}

    def sample_ids(self, batch_index: int) -> np.ndarray | None:
        """uint64 [global_batch] ids of batch ``batch_index`` from the tracker (None without one)."""
        tracked = self._tracked.get(batch_index)
        return None if tracked is None else tracked[0]

    def position(self, batch_index: int) -> Any:
        """The tracker's source position right after batch ``batch_index`` (None without one)."""
        tracked = self._tracked.get(batch_index)
        return None if tracked is None else tracked[1]

    def release(self, upto: int) -> None:
        """Forget what was tracked for batches ``<= upto`` (trained and committed)."""
        for k in [k for k in self._tracked if k <= upto]:
            del self._tracked[k]

    def state_dict(self) -> dict:
        """Position after the last batch returned: epoch and batches consumed (the
        batcher's state, holding the source's), the :attr:`info` and :attr:`skipped` counts."""
        return {
            "format": "global_batches",
            "global_batch": self.global_batch,
            "rows_per_epoch": self.rows_per_epoch,
            "info": dict(self.info),
            "skipped": dict(self.skipped),
            "batcher": self._batcher.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after the batch ``state`` was saved at: the source is moved by its own
        (exact) state; ``info`` and the ``max_steps`` count go on from the saved counts.

        Raises:
            DataError: malformed state; ConfigError: saved with another global batch or
            training split (resume with the same --workers, --batch-size, --eval-fraction).
        """
        if not isinstance(state, dict) or state.get("format") != "global_batches":
            raise DataError("not a GlobalBatches state; pass GlobalBatches.state_dict()")
        for key in ("global_batch", "rows_per_epoch"):
            if state.get(key) != getattr(self, key):
                raise ConfigError(
                    f"state saved with {key}={state.get(key)!r}, this producer has "
                    f"{getattr(self, key)!r}; resume with the same source, --workers, "
                    "--batch-size and --eval-fraction"
                )
        info = state.get("info")
        if (
            not isinstance(info, dict)
            or set(info) != set(_INFO_KEYS)
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in info.values())
        ):
            raise DataError(
                f"malformed GlobalBatches state: 'info' must map {list(_INFO_KEYS)} to ints >= 0, got {info!r}"
            )
        skipped = state.get("skipped", {})  # absent in states of older versions
        if not isinstance(skipped, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in skipped.items()
        ):
            raise DataError(f"malformed GlobalBatches state: 'skipped' must map reason -> count, got {skipped!r}")
        self._batcher.load_state_dict(state.get("batcher"))
        self.info = dict(info)
        self.skipped = dict(skipped)
        self._tracked.clear()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the prefetch thread and close the source, within ``timeout_s`` together; idempotent."""
        deadline = time.monotonic() + timeout_s
        self._batcher.close(timeout_s)
        self.source.close(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> GlobalBatches:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Global batches from a Kafka topic, with the position after each batch and
record-derived sample ids (Persia §4.1), for online training.

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

from typing import Any, Iterator

import numpy as np

from herald.errors import DataError
from herald.loader.batch import SampleBatch


def record_sample_ids(dispatcher_rank: int, partitions: np.ndarray, offsets: np.ndarray,
                      rows: np.ndarray) -> np.ndarray:
    """uint64 [n] sample ids from (partition int32 [n], offset int64 [n], row int64 [n]).

    Raises:
        DataError: a field exceeds its bit range (see NOTE [kafka delivery]).
    """
    if partitions.size and (partitions.max() >= 256 or offsets.max() >= 2**32 or rows.max() >= 65536):
        raise DataError("Kafka sample ids hold partitions < 256, offsets < 2**32 and < 65,536 samples per "
                        "record; use fewer partitions or smaller arrow records")
    return ((np.uint64(dispatcher_rank) << np.uint64(56)) | (partitions.astype(np.uint64) << np.uint64(48))
            | (offsets.astype(np.uint64) << np.uint64(16)) | rows.astype(np.uint64))


class KafkaGlobalBatches:
    """Global batches of exactly ``global_batch`` samples read from a Kafka source.

    Args:
        source: a :class:`herald.loader.kafka.source.KafkaSource`.
        global_batch: samples per batch (workers x batch size).
        max_steps: stop after this many batches (None: until the source ends or is
            interrupted).
        dispatcher_rank: top 8 bits of the sample ids.

    After batch ``i`` is yielded, :meth:`position` gives the source position right
    after it and :meth:`sample_ids` its sample ids.
    """

    def __init__(self, source: Any, global_batch: int, max_steps: int | None = None, dispatcher_rank: int = 0):
        self.source, self.global_batch, self.max_steps = source, global_batch, max_steps
        self.dispatcher_rank = dispatcher_rank
        self._positions: dict[int, Any] = {}
        self._ids: dict[int, np.ndarray] = {}
        self._row_of: dict[tuple[int, int], int] = {}   # (partition, offset) -> rows of it seen so far
        self.info = {"batches": 0, "samples": 0, "dropped_samples": 0}

    def __iter__(self) -> Iterator[SampleBatch]:
        # A resumed source starts ``skip`` samples into a record: number its rows from there.
        for partition, (offset, skip) in self.source.position.offsets.items():
            if skip:
                self._row_of[(int(partition), int(offset))] = int(skip)
        while self.max_steps is None or self.info["batches"] < self.max_steps:
            parts, ids, need = [], [], self.global_batch
            while need:
                batch = self.source.read(need)
                if batch is None:
                    self.info["dropped_samples"] += sum(len(p) for p in parts)
                    return
                parts.append(batch)
                ids.append(self._ids_of_read())
                need -= len(batch)
            i = self.info["batches"]
            self._positions[i] = self.source.last_read_position
            self._ids[i] = np.concatenate(ids)
            self.info["batches"] += 1
            self.info["samples"] += self.global_batch
            yield SampleBatch.concat(parts)

    def _ids_of_read(self) -> np.ndarray:
        partitions, offsets = self.source.last_read_records
        rows = np.empty(offsets.shape[0], np.int64)
        for j, key in enumerate(zip(partitions.tolist(), offsets.tolist())):
            rows[j] = self._row_of.get(key, 0)
            self._row_of[key] = rows[j] + 1
        if len(self._row_of) > 1 << 16:  # forget records long behind: keep the newest per partition
            newest = {}
            for p, o in self._row_of:
                newest[p] = max(o, newest.get(p, -1))
            self._row_of = {k: v for k, v in self._row_of.items() if k[1] == newest[k[0]]}
        return record_sample_ids(self.dispatcher_rank, partitions, offsets, rows)

    def sample_ids(self, batch_index: int) -> np.ndarray:
        """uint64 [global_batch] ids of batch ``batch_index`` (until :meth:`release`)."""
        return self._ids[batch_index]

    def position(self, batch_index: int) -> Any:
        """The source position right after batch ``batch_index``."""
        return self._positions[batch_index]

    def release(self, upto: int) -> None:
        """Forget the bookkeeping of batches ``<= upto`` (trained and committed)."""
        for d in (self._positions, self._ids):
            for k in [k for k in d if k <= upto]:
                del d[k]
